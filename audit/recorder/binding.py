"""Layer-0 binding in the guards: a state whose layer-0 conv rows (or an attention block whose
layer-0 V rows) are not images of tokens under the process's own weights is ``WEIGHTS_MISMATCH``;
one whose rows are images of other tokens than those the process's own scheduler recorded for the
key's chunk hash (its request's tokens: a conv state's last tokens before the boundary, a KV
block's own tokens, `audit.recorder.prefixes`) is ``PREFIX_MISMATCH``, and so is an attention block
whose layer-0 K is not its tokens' K at the block's recorded start (`_misplaced`). The load guard
refuses such a value (`audit.recorder.guard`), the put guard withholds it (`audit.recorder.wrapper`).

The weights are those vLLM loaded (the manifest's ``model_path``); the token-image table is built
(or read from the user's cache) in a daemon thread once the process has described its caches, so
vLLM never waits for it, and until it is ready nothing is bound (`status` says so). The scheduler
writes a request's prefix records when it allocates it, before the worker loads or computes, so
they are on disk when its values are checked; a key without one is judged on its weights alone.
A value whose rows may hold embeddings its request was given (a multimodal item's, recorded by the
scheduler; or any unrecorded one of a model that takes an encoder's) is not refused for binding to
no token (`audit.judge.prefixes.supplied_rows`).
"""

from __future__ import annotations

import itertools
import json
import logging
import re
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from audit.checks.binding import BOUND_KV_DTYPES, ROUNDED_DTYPES, ROW_TOLERANCE, keys_fit, nearest_on_checked, placed_keys, row_tolerance
from audit.checks.floats import decode_floats
from audit.judge.prefixes import encoded_prefix_matches, prefix_matches, supplied_rows
from audit.layouts.manifest import segment_layer
from audit.prefixrecords import (
    PREFIX_RECORD_PREFIX,
    TOKEN_BYTES,
    PrefixRecords,
    parse_prefix_record,
    record_region,
    record_start,
    token_bytes,
    window_and_digest,
)
from audit.recorder.deny import RecordTail

logger = logging.getLogger("vllm.mooncake_audit")

_GROUP = re.compile(r"@group:(\d+)@")


def key_group(key: str) -> int:
    """The KV-cache group a vLLM key names (``@group:N@``; 0 for a key without one)."""
    match = _GROUP.search(key)
    return int(match.group(1)) if match else 0
CAPACITY = 1 << 16  # prefix records kept (about 20 MB): a request's hashes are recorded just before its loads
WEIGHTS_MISMATCH = "WEIGHTS_MISMATCH"
PREFIX_MISMATCH = "PREFIX_MISMATCH"


@dataclass(frozen=True)
class Layer0Rows:
    """Where a group's keys hold layer 0's token rows: which segment, and the region there: a conv
    state ("conv", its shape as vLLM's MambaSpec gives it), an attention page ("v": (heads,
    tokens, 2 * head_size), read as `audit.judge.binding.token_rows` reads it) or an MLA page
    ("latent": (1, tokens, latent width), the image's columns first)."""

    segment: int
    offset: int
    length: int
    dtype: str
    shape: tuple[int, ...]
    kind: str = "conv"


def _attention_rows(group: dict, segment: dict) -> Layer0Rows | None:
    """Layer 0's attention page, where its segment is one whole page of K and V for every KV head
    and token of the block (vLLM's CPU backend), or of a latent a token (an ``MLAAttentionSpec``);
    None otherwise (a K/V split, fp8 e5m2, an fp8 latent)."""
    attention, block_size = group.get("attention") or {}, group.get("block_size")
    heads, size, dtype = attention.get("num_kv_heads"), attention.get("head_size"), attention.get("dtype")
    latent = str(group.get("spec") or "").startswith("MLA")
    if dtype not in BOUND_KV_DTYPES or (latent and dtype in ROUNDED_DTYPES) or not heads or not size or not block_size \
            or (not latent and (attention.get("head_size_v") or size) != size):
        return None
    width = int(size) if latent else 2 * int(size)
    length = int(heads) * int(block_size) * width * BOUND_KV_DTYPES[dtype]
    if int(segment["block_len"]) != length:
        return None
    return Layer0Rows(int(segment["index"]), 0, length, dtype, (int(heads), int(block_size), width),
                      "latent" if latent else "v")


def row_elements(geometry: Layer0Rows, columns: np.ndarray, width: int) -> np.ndarray | None:
    """Where a value's layer-0 token rows (oldest first) hold the images' check `columns`: element
    indices (tokens, check) into the region's numbers, so that a guard gathers those few numbers
    and decodes them, not the page. None where its rows are not `width` wide. An attention page is
    read in the CPU backend's order (a head's K of every token, then its V:
    `audit.judge.binding.token_rows`); an MLA page a latent a token, the image's columns first; a conv
    state is "SD" (state_len, dim) or its transpose."""
    if geometry.kind == "latent":
        heads, tokens, latent = geometry.shape
        return np.arange(heads * tokens * latent).reshape(heads * tokens, latent)[:, columns] if width <= latent else None
    if geometry.kind == "v":
        heads, tokens, double = geometry.shape
        if heads * (double // 2) != width:
            return None
        head, dim = np.divmod(columns, double // 2)
        return np.arange(heads * 2 * tokens * (double // 2)).reshape(heads, 2, tokens, double // 2)[head, 1, :, dim].T
    elements = np.arange(int(np.prod(geometry.shape))).reshape(geometry.shape)
    if max(elements.shape) != width:
        return None
    return elements[columns, :].T if elements.shape[0] > elements.shape[1] else elements[:, columns]


def _later_readings(data: np.ndarray, geometry: Layer0Rows, filled: int | None, columns) -> Iterator[np.ndarray]:
    """An attention page's first `filled` V rows on the check columns under the page interface's
    other byte orders (`audit.judge.binding.token_rows` after its first): nothing is read until a
    page's first reading does not bind."""
    from audit.judge.binding import token_rows

    for rows in itertools.islice(token_rows(data, geometry, "v"), 1, None):
        yield rows[:filled, columns]


KEY_ROWS = 4  # of a page's filled rows, the guards compare this many K rows (its first and last among them)


@dataclass(frozen=True, eq=False)
class PageGather:
    """What the guards gather of an attention page in one `take`: its first `filled` V rows on the
    images' check columns, then KEY_ROWS of its K rows (`rows`) on the K table's columns, as the CPU
    backend keeps them (K transposed); `split`: where the K numbers begin."""

    elements: np.ndarray
    split: int
    v_shape: tuple[int, int]
    rows: np.ndarray
    k_shape: tuple[int, int]


def page_gather(geometry: Layer0Rows, v_elements: np.ndarray, keys, filled: int) -> PageGather:
    """A page's `PageGather` for its first `filled` rows (`v_elements`: `row_elements` of every row)."""
    heads, tokens, width = geometry.shape
    held = min(filled, tokens)  # (a record of more tokens than the page holds: its V says so)
    rows = np.unique(np.linspace(0, held - 1, min(KEY_ROWS, held)).round().astype(np.int64))
    k_elements = np.arange(heads * width * tokens).reshape(heads, 2, width // 2, tokens)[keys.head, 0][keys.columns]
    v, k = v_elements[:filled], k_elements[:, rows].T
    return PageGather(np.concatenate([v.ravel(), k.ravel()]), v.size, v.shape, rows, k.shape)


def _decoded(numbers: np.ndarray, dtype: str) -> np.ndarray:
    """Raw numbers gathered from a page (unsigned integers of the dtype's width) as float32."""
    if dtype == "float32":
        return numbers.view(np.float32)
    return decode_floats(numbers.view(np.uint8).reshape(-1), dtype).reshape(numbers.shape)


def _other_prefix(encoded, tokens: np.ndarray, expected, twins, region: str) -> bool:
    """Whether a page's decoded tokens (and their `token_bytes`) are not those its record names: its
    digest first, then `prefix_matches` where the digest alone cannot say (twins, a text digest)."""
    return not encoded_prefix_matches(encoded, expected, region) and prefix_matches(tokens, expected, twins, region) is False


def _misplaced(keyed: list[tuple], keys) -> list[int]:
    """Of attention pages whose V rows bound (index, (page bytes, geometry), tokens, V's byte order,
    recorded start), those whose K rows of the table's head, read each way `audit.judge.binding.key_rows`
    reads them and turned by each rotation K may have, are not their tokens' K at consecutive
    positions from that start: every row judged. `StateBinder._judge_pages` sends here the pages
    whose sampled rows do not fit, and the reading loop the pages V bound in another byte order."""
    from audit.judge.binding import key_rows

    return [index for index, (data, geometry), tokens, order, start in keyed
            if not placed_keys(key_rows(data, geometry, order, keys.head), tokens, keys, start, geometry.shape[1],
                               row_tolerance(geometry.dtype))[0]]


class StateBinder:
    def __init__(self, directory: Path):
        self._tail = RecordTail([Path(directory)], f"{PREFIX_RECORD_PREFIX}*.jsonl*")
        self.prefixes = PrefixRecords()
        self.layer0: dict[int, Layer0Rows] = {}
        self.tolerance = ROW_TOLERANCE  # its rows' `row_tolerance` (a model's attention pages share one cache dtype)
        self.images = None
        self.status = "not described yet"
        self.building: threading.Thread | None = None  # the thread building the images (joined by tests)
        self._gathers: dict[int, tuple] = {}  # each group's (Layer0Rows, `row_elements`, raw number dtype)
        self._groups: dict[str, int] = {}  # a key's stem (all but its hash) -> its KV-cache group
        self._pages: dict[tuple[int, int], PageGather] = {}  # (group, rows filled) -> what its pages give up
        self._gathers_of = None  # the images those were made for (`describe` clears them too)

    def describe(self, document: dict, *, background: bool = True) -> threading.Thread | None:
        """The consumer's manifest: each group's layer-0 conv state or attention page, and the
        weights it loaded."""
        self.layer0, self._gathers, self._pages = {}, {}, {}
        for group in document.get("groups") or []:
            conv = next((s for s in group.get("states") or () if s.get("name") == "conv"), None)
            segment = next((s for s in group.get("segments") or () if segment_layer(document, s) == 0), None)
            if segment is None or segment.get("offset_in_page"):
                continue
            if conv is not None:
                self.layer0[int(group["group"])] = Layer0Rows(int(segment["index"]), int(conv["offset"]),
                                                              int(conv["length"]), conv["dtype"], tuple(conv["shape"]))
            elif (rows := _attention_rows(group, segment)) is not None:
                self.layer0[int(group["group"])] = rows
        if any(rows.kind == "conv" for rows in self.layer0.values()):  # a hybrid's image rule is its conv state's
            self.layer0 = {group: rows for group, rows in self.layer0.items() if rows.kind == "conv"}
        self.tolerance = max((row_tolerance(rows.dtype) for rows in self.layer0.values()), default=ROW_TOLERANCE)
        model_path = document.get("model_path")
        if not self.layer0 or not model_path:
            self.status = ("no layer-0 conv state or attention page" if not self.layer0
                           else "the loaded model is not a directory here")
            return None
        self.status = "building the token images"

        def build() -> None:
            from audit.layouts import LayoutError
            from audit.layouts.weights import token_images

            try:
                images = token_images(Path(model_path), document.get("model") or Path(model_path).name,
                                      int(document.get("tp_size") or 1), int(document.get("tp_rank") or 0))
                for warmed in ("table", "table_squares", "probe_signs", "twins"):  # built here, off vLLM's path
                    getattr(images, warmed)
            except (LayoutError, OSError, ValueError) as error:
                self.status = f"not bound: {error}"
                return
            self.images, self.status = images, "bound"
            logger.info("mooncake-audit guard: layer-0 binding ready (%s)", model_path)

        if not background:
            build()
            return None
        self.building = threading.Thread(target=build, name="mooncake-audit-token-images", daemon=True)
        self.building.start()
        return self.building

    def refusals(self, keys: Sequence[str], loaded: Sequence[int],
                 region_bytes: Callable[[list[tuple[int, int, int, int]]], list[np.ndarray]]) -> dict[int, str]:
        """Of the `loaded` values (indices into `keys`), those to refuse: index -> reason.
        `region_bytes` gives, for each (index, segment, offset, length) asked at once, those bytes of
        that value's segment in host memory (fewer where the segment ends sooner)."""
        images = self.images
        if images is None:
            return {}
        pending: list[tuple[int, np.ndarray, Iterator]] = []  # (index, rows on the check columns, later readings)
        region, columns = record_region(images.region), images.check_columns
        if self._gathers_of is not images:
            self._gathers, self._pages, self._gathers_of = {}, {}, images
        bound: list[tuple[int, int, tuple, str]] = []  # (index, group, its gather, chunk hash), for the values bound here
        for index in loaded:
            stem, _, chunk_hash = keys[index].rpartition("@")
            if (group := self._groups.get(stem)) is None:
                if len(self._groups) > 1024:  # (a key's stem names its model, ranks and group: a few a process)
                    self._groups.clear()
                group = self._groups[stem] = key_group(keys[index])
            if (gather := self._gathers.get(group)) is None:
                gather = self._gathers[group] = self._gather(self.layer0.get(group), images)
            if gather[1] is not None:
                bound.append((index, group, gather, chunk_hash))
        regions = region_bytes([(index, geometry.segment, geometry.offset, geometry.length)
                                for index, _, (geometry, _, _), _ in bound])
        records = {index: self.prefixes.packed(chunk_hash, region) for index, _, _, chunk_hash in bound}
        if None in records.values():  # (its scheduler records a request before its loads: read what is new, once)
            self._refresh()
            records.update((index, self.prefixes.packed(chunk_hash, region))
                           for index, _, _, chunk_hash in bound if records[index] is None)
        pages = {}  # index -> ((its attention page's bytes, its geometry), its recorded start), for K
        batches: dict[tuple, list] = {}  # (group, rows filled) -> [its gather, (index, page bytes, start)...]
        for (index, group, (geometry, elements, raw), _), data in zip(bound, regions):
            if len(data) != geometry.length:
                continue
            record = records[index]
            if geometry.kind == "conv":  # (the gathers take these few numbers, not the page)
                pending.append((index, _decoded(data.view(raw).take(elements), geometry.dtype), iter(())))
                continue
            # a partial tail block: its own tokens' rows only, as its request's record says (None: all)
            filled = None if record is None else window_and_digest(record)[0]
            start = record_start(record)
            if start is not None and geometry.kind == "v" and images.keys is not None:  # V and K in one take
                if (batch := batches.get((group, filled))) is None:
                    if (pair := self._pages.get((group, filled))) is None:
                        pair = self._pages[group, filled] = page_gather(geometry, elements, images.keys, filled)
                    batch = batches[group, filled] = [(pair, geometry, raw)]
                batch.append((index, data, start))
                continue
            rows = _decoded(data.view(raw).take(elements[:filled]), geometry.dtype)
            later = _later_readings(data, geometry, filled, columns) if geometry.kind == "v" else iter(())
            pending.append((index, rows, later))
        found = {}
        for (_, filled), ((pair, geometry, raw), *members) in batches.items():
            pending += self._judge_pages(members, pair, geometry, raw, filled, records, found, pages)
        decided: dict[int, tuple] = {}  # index -> (its tokens, their token_bytes, all rows near an image, its reading)
        reading = 0
        while pending:  # a page's later byte orders only for values the likelier ones did not bind
            decoded, distances = nearest_on_checked(np.concatenate([rows for _, rows, _ in pending]), images,
                                                    self.tolerance)
            near, encoded, start, later = (distances <= self.tolerance).tolist(), token_bytes(decoded), 0, []
            for index, rows, readings in pending:
                end = start + len(rows)
                bound = all(near[start:end])
                if bound or index not in decided:
                    decided[index] = (decoded[start:end], encoded[start * TOKEN_BYTES:end * TOKEN_BYTES], bound, reading)
                if not bound and (rows := next(readings, None)) is not None:
                    later.append((index, rows, readings))
                start = end
            pending, reading = later, reading + 1
        keyed = []  # (index, its page, its tokens, its reading, its recorded start): attention pages bound by V
        for index, (tokens, encoded, bound, order) in decided.items():
            expected = records[index]
            if not bound:  # (unless its rows may be embeddings its request was given: kept)
                if supplied_rows(keys[index].rpartition("@")[2], images, self.prefixes) is None:
                    found[index] = WEIGHTS_MISMATCH
            elif expected is not None and _other_prefix(encoded, tokens, expected, images.twins, region):
                found[index] = PREFIX_MISMATCH
            elif index in pages:
                keyed.append((index, pages[index][0], tokens, order, pages[index][1]))
        if keyed:
            found.update(dict.fromkeys(_misplaced(keyed, images.keys), PREFIX_MISMATCH))
        return found

    def _judge_pages(self, members: list[tuple], pair: PageGather, geometry: Layer0Rows, raw: np.dtype, filled: int,
                     records: dict, found: dict, pages: dict) -> list[tuple]:
        """Attention pages of one group and fill with a recorded start (a load's pages, as a rule),
        judged as arrays: V and K gathered into one array (`PageGather`), decoded once, V's rows
        searched at once, each page's tokens' digest against its record, the sampled K rows at their
        positions at once. Verdicts go to `found`. A page whose V rows do not bind in the CPU
        backend's order is handed back, with its later readings, to `refusals`' reading loop; a page
        whose K does not fit on its sample is judged on every row, each way its K may lie."""
        images = self.images
        numbers = np.empty((len(members), len(pair.elements)), raw)
        for row, (_, data, _) in enumerate(members):
            numbers[row] = data.view(raw)[pair.elements]  # (a fancy index: a quarter cheaper than np.take's out=)
        values = _decoded(numbers, geometry.dtype)
        held = pair.v_shape[0]
        decoded, distances = nearest_on_checked(values[:, :pair.split].reshape(-1, pair.v_shape[1]), images,
                                                self.tolerance)
        near = (distances <= self.tolerance).reshape(len(members), held).all(axis=1).tolist()
        encoded, region, tokens = token_bytes(decoded), record_region(images.region), decoded.reshape(len(members), held)
        sampled = values[:, pair.split:].reshape(len(members), *pair.k_shape)
        handed_back, keyed = [], []
        for row, ((index, data, start), bound) in enumerate(zip(members, near)):
            pages[index] = ((data, geometry), start)
            if not bound:  # (its later byte orders, in `refusals`' loop, from the first again)
                handed_back.append((index, values[row, :pair.split].reshape(pair.v_shape),
                                    _later_readings(data, geometry, filled, images.check_columns)))
            elif _other_prefix(encoded[row * held * TOKEN_BYTES:(row + 1) * held * TOKEN_BYTES], tokens[row],
                               records[index], images.twins, region):
                found[index] = PREFIX_MISMATCH
            else:
                keyed.append(row)
        if keyed:
            at = np.asarray(keyed)
            starts = np.fromiter((members[row][2] for row in keyed), np.int64, len(keyed))
            fits = keys_fit(sampled[at].reshape(-1, pair.k_shape[1]), tokens[at][:, pair.rows].ravel(),
                            (starts[:, None] + pair.rows).ravel(), images.keys,
                            self.tolerance).reshape(len(keyed), -1).all(axis=1)
            unfit = [(members[row][0], pages[members[row][0]][0], tokens[row], 0, members[row][2])
                     for row, fit in zip(keyed, fits.tolist()) if not fit]
            if unfit:  # (its K may lie another way, or be turned by another rotation: every row)
                found.update(dict.fromkeys(_misplaced(unfit, images.keys), PREFIX_MISMATCH))
        return handed_back

    @staticmethod
    def _gather(geometry: Layer0Rows | None, images) -> tuple:
        """A group's (layer-0 rows, their check columns' element indices, raw number dtype); the
        indices None where its values are not bound (no such rows, another kind, not a float)."""
        from audit.checks.floats import FLOAT_DTYPES

        bits = None if geometry is None or geometry.kind != images.region else FLOAT_DTYPES.get(geometry.dtype)
        if bits is None:
            return geometry, None, None
        return geometry, row_elements(geometry, images.check_columns, images.columns), np.dtype(f"u{bits.itemsize}")

    def _refresh(self) -> None:
        """The prefix records written since the last read (once a call to `refusals`, and only where a
        key has none: a key still without one is judged on its weights alone); past CAPACITY hashes,
        the oldest half goes."""
        for line in self._tail.lines():
            try:
                self.prefixes.add(*parse_prefix_record(json.loads(line)))
            except (ValueError, TypeError):
                self.prefixes.skipped += 1
        self.prefixes.trim(CAPACITY)
