"""The reference checker: numpy + xxhash over host memory.

With a layout, every region of the value is checked (digest, zero flag, NaN/Inf for float
dtypes) and the whole-value digest is taken over the same bytes, which are read from memory once:
the whole-value digest goes first (xxh3 keeps up with DRAM best), and the other passes find the
bytes in cache (values larger than `PIECE_BYTES` are walked in pieces of whole regions).

- per region, XXH3-64; a region whose digest is the fixed digest of that many zero bytes has its
  bytes confirmed zero;
- NaN/Inf: one exact screen per run of same-dtype regions (two max reductions, see
  `floats.Screen`); only where it fires are regions counted element by element, so the counts
  are exactly `count_nonfinite`'s;
- `check_values` screens consecutive small values of a one-dtype layout together.

Several layouts of the same bytes (the readings a value size leaves open: bfloat16 against
float16, or boundaries that differ) are checked in that same pass (`check_readings`): the whole
digest once; each distinct byte range's digest and zero test once, whichever readings share it;
the NaN/Inf screen's two maxima once per element width over the ranges the readings' runs cut in
common (float16 and bfloat16 words have the same maxima, only the thresholds differ). A reading
adds work only for its own boundaries.

A value none of whose regions is all zero or holds a NaN or Inf (nearly every one) keeps its
regions as their digests (`CleanRegions`): the RegionChecks are made only if something looks.

Everything derived from a layout (offsets, zero digests, runs) is computed once per layout.
Results are identical to checking region by region (`check_region`); benchmarks/ holds the
previous implementation and compares the two.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from audit.checks.floats import SCREENS, count_nonfinite, element_maxima, fires_any
from audit.checks.types import ByIdentity, CleanRegions, RegionCheck, fast_constructor, make_region_check
from audit.checks.zero import is_zero, zero_digest

PIECE_BYTES = 4 << 20          # inside any server CPU's L3: the passes after the first read from cache
SMALL_VALUE_BYTES = 64 << 10   # values up to this size are screened for NaN/Inf a stretch at a time
STRETCH_BYTES = 256 << 10      # how many bytes of consecutive small values one screen covers


@dataclass(frozen=True, slots=True)
class ValueCheck:
    xxh3: int
    zero: bool
    regions: Sequence[RegionCheck] | None = None  # in layout order, when a layout applied (a tuple, or CleanRegions)


def check_value_by_region(data: np.ndarray, layout) -> ValueCheck:
    """The plain path: each region checked on its own, the whole digest streamed from them. The
    reference the cached, screened path must equal; used for values that path does not take."""
    whole = xxhash.xxh3_64()
    regions = []
    for _, region in layout.regions():
        view = data[region.offset: region.offset + region.length]
        whole.update(view)
        regions.append(check_region(view, region.dtype))
    digest = whole.intdigest()
    zero = digest == zero_digest(data.nbytes) and all(r.zero for r in regions)
    return ValueCheck(xxh3=digest, zero=zero, regions=tuple(regions))


def check_region(data: np.ndarray, dtype: str) -> RegionCheck:
    digest = xxhash.xxh3_64_intdigest(data)
    zero = is_zero(data, digest)
    nan, inf = (0, 0) if zero else count_nonfinite(data, dtype)
    return RegionCheck(xxh3=digest, zero=zero, nan=nan, inf=inf)


_value_check = fast_constructor(ValueCheck, ("xxh3", "zero", "regions"))


class _Reading:
    """One layout's regions within a piece, as indexes into what the piece computes once for all."""

    __slots__ = ("picks", "regions", "runs", "clean")

    def __init__(self, picks, regions: list, runs: list):
        self.picks = picks      # span index per region; None where the regions are the piece's spans
        self.regions = regions  # (span index, start, end, zero digest, dtype, run index or -1) per region
        self.runs = runs        # (atom indexes, Screen) per run of same-float-dtype regions
        self.clean = ([False] * len(regions), [0] * len(regions))  # zero, nan/inf columns of clean regions


class _Piece:
    """Consecutive whole regions of every reading, checked together while in cache: each distinct
    byte range (span) hashed once, each atom's element maxima taken once for every reading."""

    __slots__ = ("start", "end", "spans", "slices", "zero_digests", "atoms", "blocks", "readings", "unfired", "alone")

    def __init__(self, start: int, end: int, spans: list, atoms: list, readings: list):
        self.start = start
        self.end = end
        self.spans = spans  # (start, end, zero digest of its length), in byte order
        self.slices = [slice(begin, stop) for begin, stop, _ in spans]
        self.zero_digests = frozenset(entry[2] for entry in spans)
        self.atoms = atoms  # (start, end, itemsize): the screens of every reading's runs are made of these
        self.blocks = _blocks(atoms, readings)
        self.readings = readings
        self.unfired = [[False] * len(reading.runs) for reading in readings]
        # one reading: its runs are the atoms, screened directly (start, end, Screen)
        self.alone = ([(atoms[index][0], atoms[index][1], screen) for (index,), screen in readings[0].runs]
                      if len(readings) == 1 else None)


def _atoms_of(run: tuple, cuts: list[int]) -> list[tuple]:
    """The run (start, end, itemsize) cut where any reading's run of that width starts or ends, when
    every cut falls on an element boundary of the run (else the run is its own atom): maxima then
    combine exactly (the max of a run is the max of its atoms')."""
    start, end, itemsize = run
    inner = [cut for cut in cuts if start < cut < end]
    if any((cut - start) % itemsize for cut in inner):
        return [run]
    edges = [start, *inner, end]
    return [(begin, stop, itemsize) for begin, stop in zip(edges, edges[1:])]


def _blocks(atoms: list[tuple], readings: list) -> list[tuple]:
    """Adjacent atoms of one width merged where their elements line up, with the lowest thresholds
    any reading's screen of them has (start, end, itemsize, unsigned, signed): maxima below those
    say at once that no reading's run fires, in as few reductions as one reading's runs take."""
    floors: list[list[int]] = [[1 << 64, 1 << 64] for _ in atoms]
    for reading in readings:
        for indexes, screen in reading.runs:
            for index in indexes:
                floors[index] = [min(floors[index][0], screen.unsigned_min), min(floors[index][1], screen.signed_min)]
    blocks: list[list] = []
    for (start, end, itemsize), (floor, signed_floor) in sorted(zip(atoms, floors)):
        last = blocks[-1] if blocks else None
        if last is not None and last[1] == start and last[2] == itemsize and (start - last[0]) % itemsize == 0:
            last[1], last[3], last[4] = end, min(last[3], floor), min(last[4], signed_floor)
        else:
            blocks.append([start, end, itemsize, floor, signed_floor])
    return [tuple(block) for block in blocks]


def _runs(regions: list) -> tuple[list, list]:
    """(span bounds, dtype, run index) per region, and the runs (start, end, dtype) of adjacent
    regions of one float dtype: one screen covers a run."""
    entries, runs, previous = [], [], None
    for region in regions:
        end = region.offset + region.length
        if SCREENS.get(region.dtype) is None:
            run = -1
        elif previous is not None and previous.dtype == region.dtype:
            run = len(runs) - 1
            runs[run][1] = end
        else:
            run = len(runs)
            runs.append([region.offset, end, region.dtype])
        previous = region if run >= 0 else None
        entries.append(((region.offset, end), region.dtype, run))
    return entries, runs


def _piece(members: list[list]) -> _Piece:
    """`members`: per reading, its regions in the piece (every reading's span the same bytes)."""
    bounds = sorted({(region.offset, region.offset + region.length) for regions in members for region in regions})
    span_of = {bound: index for index, bound in enumerate(bounds)}
    spans = [(start, end, zero_digest(end - start)) for start, end in bounds]
    shaped = [_runs(regions) for regions in members]
    cuts: dict[int, set[int]] = {}
    for _, runs in shaped:
        for start, end, dtype in runs:
            cuts.setdefault(SCREENS[dtype].itemsize, set()).update((start, end))
    atoms: dict[tuple, int] = {}
    readings = []
    for entries, runs in shaped:
        indexed = []
        for start, end, dtype in runs:
            itemsize = SCREENS[dtype].itemsize
            parts = _atoms_of((start, end, itemsize), sorted(cuts[itemsize]))
            indexed.append((tuple(atoms.setdefault(part, len(atoms)) for part in parts), SCREENS[dtype]))
        picks = [span_of[bound] for bound, _, _ in entries]
        regions = [(span, *bounds[span], spans[span][2], dtype, run) for span, (_, dtype, run) in zip(picks, entries)]
        readings.append(_Reading(None if picks == list(range(len(bounds))) else picks, regions, indexed))
    return _Piece(bounds[0][0], max(end for _, end in bounds), spans, list(atoms), readings)


class _Plan:
    """What a value's readings (one layout, or several of the same bytes) imply for checking,
    computed once."""

    __slots__ = ("readings", "size", "zero_digest", "pieces", "width", "screens")

    def __init__(self, readings: tuple, piece_bytes: int):
        self.readings = readings
        self.size = readings[0].size
        self.zero_digest = zero_digest(self.size)
        regions = [[region for _, region in layout.regions()] for layout in readings]
        # a piece may end only where no reading's region goes on: where every reading starts one
        common = sorted(set.intersection(*({region.offset for region in own} for own in regions)))
        end = max(region.offset + region.length for own in regions for region in own)
        cuts, first = [], common[0]
        for start, stop in zip(common, common[1:] + [end]):
            if start > first and stop - first > piece_bytes:
                cuts.append(start)
                first = start
        edges = [common[0], *cuts, end]
        self.pieces = [_piece([[region for region in own if begin <= region.offset < stop] for own in regions])
                       for begin, stop in zip(edges, edges[1:])]
        # One float width for every region of every reading: a screen can cover many values at once.
        screens = {SCREENS.get(region.dtype) for own in regions for region in own}
        widths = {screen.itemsize for screen in screens if screen is not None}
        single = None not in screens and len(widths) == 1
        self.width = widths.pop() if single else None
        self.screens = tuple(screens) if single else ()

    def fires(self, data: np.ndarray) -> bool:
        """Whether the bytes hold a NaN or Inf under any reading (the plan has one float width)."""
        screens = self.screens
        return screens[0].any(data) if len(screens) == 1 else fires_any(data, screens)


def _check_clean_run(buffer: np.ndarray, offsets: list[int], plan: _Plan, single: bool) -> list:
    """Values of a one-piece plan at `offsets`, screened together: no NaN/Inf in any. The same
    results as `HostChecker._check` (`single`: the first reading's check alone, not the tuple),
    with less interpreter work per value."""
    digest_of = xxhash.xxh3_64_intdigest
    make_value = _value_check
    piece = plan.pieces[0]
    bounds = [(part.start, part.stop) for part in piece.slices]
    zero_digests = piece.zero_digests
    pickings = [reading.picks for reading in piece.readings]
    first_picks = pickings[0]
    size = plan.size
    bytes_ = memoryview(buffer)
    results = []
    for offset in offsets:
        digest = digest_of(bytes_[offset: offset + size])
        digests = [digest_of(bytes_[offset + start: offset + stop]) for start, stop in bounds]
        if not zero_digests.isdisjoint(digests):
            checks = HostChecker._check(buffer[offset: offset + size], plan, True)
            results.append(checks[0] if single else checks)
        elif single and first_picks is None:
            results.append(make_value(digest, False, CleanRegions(tuple(digests))))
        else:
            checks = tuple(make_value(digest, False, CleanRegions(
                tuple(digests) if picks is None else tuple([digests[i] for i in picks])))
                for picks in pickings)
            results.append(checks[0] if single else checks)
    return results


def _opaque(data: np.ndarray) -> ValueCheck:
    digest = xxhash.xxh3_64_intdigest(data)
    return _value_check(digest, is_zero(data, digest), None)


class HostChecker:
    name = "numpy"

    def __init__(self, piece_bytes: int = PIECE_BYTES):
        self.piece_bytes = piece_bytes
        self._plan = ByIdentity(lambda readings: _Plan(readings, piece_bytes)).get

    def check_values(self, buffer: np.ndarray, items) -> list[ValueCheck]:
        """`items`: (offset, length, layout or None) per value in `buffer`.

        Small values of a single-float-dtype layout lying one after another are screened for
        NaN/Inf together (one screen per `STRETCH_BYTES`), which is most of their cost when
        screened one by one; a stretch whose screen fires is checked value by value."""
        return self._check_items(buffer, items, True)

    def check_readings(self, buffer: np.ndarray, items) -> list[tuple[ValueCheck, ...]]:
        """`items`: (offset, length, readings) per value in `buffer`, `readings` a tuple of layouts
        of that length (several readings of the same bytes), or () for opaque bytes. Each value's
        checks, one per reading (the opaque check alone for ()), from one pass over its bytes:
        equal to `check_values` under each reading in turn."""
        return self._check_items(buffer, items, False)

    def _check_items(self, buffer: np.ndarray, items, single: bool) -> list:
        results: list = []
        count = len(items)
        flat = (isinstance(buffer, np.ndarray) and buffer.dtype == np.uint8 and buffer.ndim == 1
                and buffer.flags.c_contiguous)
        opaque, append = _opaque, results.append
        index = 0
        while index < count:
            offset, length, layouts = items[index]
            if not layouts:  # None or (): opaque bytes
                check = opaque(buffer[offset: offset + length])
                append(check if single else (check,))
                index += 1
                continue
            readings = (layouts,) if single else layouts
            plan = self._plan(readings) if flat and length <= SMALL_VALUE_BYTES else None
            if plan is None or plan.width is None or length != plan.size or offset % plan.width:
                checks = self._check_readings(buffer[offset: offset + length], readings)
                results.append(checks[0] if single else checks)
                index += 1
                continue
            stop, end = index + 1, offset + length
            while stop < count:
                following, size, other = items[stop]
                if (other is not layouts or size != length or following < end or following % plan.width
                        or following + size - offset > STRETCH_BYTES):
                    break
                stop, end = stop + 1, following + size
            if len(plan.pieces) == 1 and not plan.fires(buffer[offset:end]):
                results += _check_clean_run(buffer, [items[position][0] for position in range(index, stop)], plan,
                                            single)
            else:
                checked = [self._check(buffer[items[position][0]: items[position][0] + length], plan, False)
                           for position in range(index, stop)]
                results += [checks[0] for checks in checked] if single else checked
            index = stop
        return results

    def check_value(self, data: np.ndarray, layout=None) -> ValueCheck:
        """`layout`: a `audit.layouts.Layout` whose size equals the value's, or None (opaque)."""
        if layout is None:
            return _opaque(data)
        return self._check_readings(data, (layout,))[0]

    def _check_readings(self, data: np.ndarray, readings: tuple) -> tuple[ValueCheck, ...]:
        plan = self._plan(readings)
        if data.nbytes != plan.size or not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 1:
            return tuple(check_value_by_region(data, layout) for layout in readings)
        return self._check(data, plan, False)

    @staticmethod
    def _check(data: np.ndarray, plan: _Plan, clean: bool) -> tuple[ValueCheck, ...]:
        """`data` is a whole value of `plan`'s size; `clean`: already screened, no NaN/Inf. One
        check per reading of the plan."""
        digest_of = xxhash.xxh3_64_intdigest
        make = make_region_check
        pieces = plan.pieces
        whole = xxhash.xxh3_64() if len(pieces) > 1 else None
        bytes_ = memoryview(data)
        found: list[list] = [[] for _ in plan.readings]  # per reading: its RegionChecks, or digests while clean
        as_digests = [True] * len(found)  # every region so far neither zero nor NaN/Inf: `found` holds digests
        zeros = [0] * len(found)
        # The first pass over the bytes reads them from memory; xxh3 keeps up with memory best,
        # so the whole-value digest goes first and the other passes find the bytes in cache.
        digest = digest_of(data) if whole is None else None
        for piece in pieces:
            if whole is not None:
                whole.update(bytes_[piece.start:piece.end])
            if clean:
                fired = piece.unfired
            elif piece.alone is not None:
                fired = [[screen.any(data[start:end]) for start, end, screen in piece.alone]]
            else:
                if any(top >= floor or signed >= signed_floor for (top, signed), floor, signed_floor in (
                        (element_maxima(data[start:end], itemsize), floor, signed_floor)
                        for start, end, itemsize, floor, signed_floor in piece.blocks)):
                    maxima = [element_maxima(data[start:end], itemsize) for start, end, itemsize in piece.atoms]
                    fired = [[any(screen.fires(maxima[atom]) for atom in atoms) for atoms, screen in reading.runs]
                             for reading in piece.readings]
                else:  # the common case: nothing reaches any reading's thresholds
                    fired = piece.unfired
            digests = [digest_of(bytes_[part]) for part in piece.slices]
            maybe_zero = not piece.zero_digests.isdisjoint(digests)
            zero_spans: dict[int, bool] | None = {} if len(found) > 1 else None  # span -> confirmed zero, once
            for number, reading in enumerate(piece.readings):
                regions = found[number]
                own = digests if reading.picks is None else [digests[i] for i in reading.picks]
                if not maybe_zero and not any(fired[number]):
                    # The common case: no region can be zero (no digest is a zero digest) and there
                    # is no NaN/Inf anywhere in the piece.
                    if as_digests[number]:
                        regions.extend(own)
                    else:
                        falses, naughts = reading.clean
                        regions.extend(map(make, own, falses, naughts, naughts))
                    continue
                if as_digests[number]:  # the digests so far become the RegionChecks they stand for
                    regions = found[number] = [make(region_digest, False, 0, 0) for region_digest in regions]
                    as_digests[number] = False
                for (span, start, end, zero_of_length, dtype, run), region_digest in zip(reading.regions, own):
                    view = data[start:end]
                    if region_digest == zero_of_length:
                        if zero_spans is None:
                            zero = is_zero(view, region_digest)
                        elif span in zero_spans:
                            zero = zero_spans[span]
                        else:
                            zero = zero_spans[span] = is_zero(view, region_digest)
                        if zero:
                            zeros[number] += 1
                            regions.append(make(region_digest, True, 0, 0))
                            continue
                    if run >= 0 and fired[number][run] and SCREENS[dtype].any(view):
                        nan, inf = count_nonfinite(view, dtype)
                        regions.append(make(region_digest, False, nan, inf))
                    else:
                        regions.append(make(region_digest, False, 0, 0))
        if whole is not None:
            digest = whole.intdigest()
        value_zero = digest == plan.zero_digest
        if len(found) == 1:
            regions = CleanRegions(tuple(found[0])) if as_digests[0] else tuple(found[0])
            return (_value_check(digest, value_zero and zeros[0] == len(regions), regions),)
        return tuple(_value_check(digest, value_zero and zero == len(regions),
                                  CleanRegions(tuple(regions)) if is_clean else tuple(regions))
                     for zero, regions, is_clean in zip(zeros, found, as_digests))
