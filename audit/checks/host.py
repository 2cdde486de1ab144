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

Everything derived from a layout (offsets, zero digests, runs) is computed once per layout.
Results are identical to checking region by region (`check_region`); benchmarks/ holds the
previous implementation and compares the two.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import xxhash

from audit.checks.floats import SCREENS, count_nonfinite
from audit.checks.types import RegionCheck, fast_constructor, make_region_check
from audit.checks.zero import is_zero, zero_digest

PIECE_BYTES = 4 << 20          # inside any server CPU's L3: the passes after the first read from cache
SMALL_VALUE_BYTES = 64 << 10   # values up to this size are screened for NaN/Inf a stretch at a time
STRETCH_BYTES = 256 << 10      # how many bytes of consecutive small values one screen covers


@dataclass(frozen=True, slots=True)
class ValueCheck:
    xxh3: int
    zero: bool
    regions: tuple[RegionCheck, ...] | None = None  # in layout order, when a layout applied


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


class _Piece:
    """Consecutive whole regions of a value, checked together while in cache."""

    __slots__ = ("start", "end", "regions", "runs", "slices", "zero_digests", "clean", "unfired")

    def __init__(self, start: int, end: int, regions: list, runs: list):
        self.start = start
        self.end = end
        self.regions = regions  # (start, end, zero digest, dtype, run index or -1)
        self.runs = runs        # (start, end, Screen): one per run of same-float-dtype regions
        self.slices = [slice(begin, end) for begin, end, *_ in regions]
        self.zero_digests = frozenset(entry[2] for entry in regions)
        self.clean = ([False] * len(regions), [0] * len(regions))  # zero, nan/inf columns of clean regions
        self.unfired = [False] * len(runs)


class _Plan:
    """What a layout implies for checking, computed once."""

    __slots__ = ("layout", "size", "zero_digest", "pieces", "screen")

    def __init__(self, layout, piece_bytes: int):
        self.layout = layout  # held, so the id() key of the cache cannot be reused
        self.size = layout.size
        self.zero_digest = zero_digest(layout.size)
        self.pieces: list[_Piece] = []
        current: list = []
        for _, region in layout.regions():
            if current and region.offset + region.length - current[0].offset > piece_bytes:
                self.pieces.append(self._piece(current))
                current = []
            current.append(region)
        if current:
            self.pieces.append(self._piece(current))
        # One float dtype for every region: a screen can cover many such values at once.
        dtypes = {region.dtype for _, region in layout.regions()}
        self.screen = SCREENS.get(dtypes.pop()) if len(dtypes) == 1 else None

    @staticmethod
    def _piece(regions: list) -> _Piece:
        runs: list = []
        entries = []
        previous = None
        for region in regions:
            end = region.offset + region.length
            screen = SCREENS.get(region.dtype)
            if screen is None:
                run = -1
            elif previous is not None and previous.dtype == region.dtype:
                run = len(runs) - 1
                runs[run] = (runs[run][0], end, screen)
            else:
                run = len(runs)
                runs.append((region.offset, end, screen))
            previous = region if screen is not None else None
            entries.append((region.offset, end, zero_digest(region.length), region.dtype, run))
        return _Piece(regions[0].offset, regions[-1].offset + regions[-1].length, entries, runs)


def _check_clean_run(buffer: np.ndarray, offsets: list[int], plan: _Plan) -> list[ValueCheck]:
    """Values of a one-piece layout at `offsets`, screened together: no NaN/Inf in any. The
    same results as `HostChecker._check`, with less interpreter work per value."""
    digest_of = xxhash.xxh3_64_intdigest
    make, make_value = make_region_check, _value_check
    piece = plan.pieces[0]
    bounds = [(part.start, part.stop) for part in piece.slices]
    zero_digests = piece.zero_digests
    falses, naughts = piece.clean
    size = plan.size
    bytes_ = memoryview(buffer)
    results = []
    for offset in offsets:
        digest = digest_of(bytes_[offset: offset + size])
        digests = [digest_of(bytes_[offset + start: offset + stop]) for start, stop in bounds]
        if zero_digests.isdisjoint(digests):
            results.append(make_value(digest, False, tuple(map(make, digests, falses, naughts, naughts))))
        else:
            results.append(HostChecker._check(buffer[offset: offset + size], plan, True))
    return results


class HostChecker:
    name = "numpy"

    def __init__(self, piece_bytes: int = PIECE_BYTES):
        self.piece_bytes = piece_bytes
        self._plans: dict[int, _Plan] = {}

    def _plan(self, layout) -> _Plan:
        plan = self._plans.get(id(layout))
        if plan is None or plan.layout is not layout:
            if len(self._plans) >= 64:
                self._plans.clear()
            plan = self._plans[id(layout)] = _Plan(layout, self.piece_bytes)
        return plan

    def check_values(self, buffer: np.ndarray, items) -> list[ValueCheck]:
        """`items`: (offset, length, layout or None) per value in `buffer`.

        Small values of a single-float-dtype layout lying one after another are screened for
        NaN/Inf together (one screen per `STRETCH_BYTES`), which is most of their cost when
        screened one by one; a stretch whose screen fires is checked value by value."""
        results: list[ValueCheck] = []
        check_value = self.check_value
        count = len(items)
        flat = (isinstance(buffer, np.ndarray) and buffer.dtype == np.uint8 and buffer.ndim == 1
                and buffer.flags.c_contiguous)
        index = 0
        while index < count:
            offset, length, layout = items[index]
            plan = self._plan(layout) if flat and layout is not None and length <= SMALL_VALUE_BYTES else None
            if plan is None or plan.screen is None or length != plan.size or offset % plan.screen.itemsize:
                results.append(check_value(buffer[offset: offset + length], layout))
                index += 1
                continue
            itemsize = plan.screen.itemsize
            stop, end = index + 1, offset + length
            while stop < count:
                following, size, other = items[stop]
                if (other is not layout or size != length or following < end or following % itemsize
                        or following + size - offset > STRETCH_BYTES):
                    break
                stop, end = stop + 1, following + size
            if len(plan.pieces) == 1 and not plan.screen.any(buffer[offset:end]):
                results += _check_clean_run(buffer, [items[position][0] for position in range(index, stop)], plan)
            else:
                for position in range(index, stop):
                    start = items[position][0]
                    results.append(self._check(buffer[start: start + length], plan, False))
            index = stop
        return results

    def check_value(self, data: np.ndarray, layout=None) -> ValueCheck:
        """`layout`: a `audit.layouts.Layout` whose size equals the value's, or None (opaque)."""
        if layout is None:
            digest = xxhash.xxh3_64_intdigest(data)
            return ValueCheck(xxh3=digest, zero=is_zero(data, digest))
        plan = self._plan(layout)
        if data.nbytes != plan.size or not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 1:
            return check_value_by_region(data, layout)
        return self._check(data, plan, False)

    @staticmethod
    def _check(data: np.ndarray, plan: _Plan, clean: bool) -> ValueCheck:
        """`data` is a whole value of `plan`'s layout; `clean`: already screened, no NaN/Inf."""
        digest_of = xxhash.xxh3_64_intdigest
        make = make_region_check
        pieces = plan.pieces
        whole = xxhash.xxh3_64() if len(pieces) > 1 else None
        bytes_ = memoryview(data)
        regions: list[RegionCheck] = []
        append = regions.append
        zeros = 0
        # The first pass over the bytes reads them from memory; xxh3 keeps up with memory best,
        # so the whole-value digest goes first and the other passes find the bytes in cache.
        digest = digest_of(data) if whole is None else None
        for piece in pieces:
            if whole is not None:
                whole.update(bytes_[piece.start:piece.end])
            fired = piece.unfired if clean else [screen.any(data[start:end]) for start, end, screen in piece.runs]
            digests = [digest_of(bytes_[part]) for part in piece.slices]
            if not any(fired) and piece.zero_digests.isdisjoint(digests):
                # The common case: no region can be zero (no digest is a zero digest) and there
                # is no NaN/Inf anywhere in the piece.
                falses, naughts = piece.clean
                regions.extend(map(make, digests, falses, naughts, naughts))
            else:
                for (start, end, zero_of_length, dtype, run), own in zip(piece.regions, digests):
                    view = data[start:end]
                    if own == zero_of_length and is_zero(view, own):
                        zeros += 1
                        append(make(own, True, 0, 0))
                    elif run >= 0 and fired[run] and piece.runs[run][2].any(view):
                        nan, inf = count_nonfinite(view, dtype)
                        append(make(own, False, nan, inf))
                    else:
                        append(make(own, False, 0, 0))
        if whole is not None:
            digest = whole.intdigest()
        zero = digest == plan.zero_digest and zeros == len(regions)
        return _value_check(digest, zero, tuple(regions))
