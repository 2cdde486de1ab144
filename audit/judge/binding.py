"""WEIGHTS_MISMATCH: a state whose layer-0 conv rows (or attention V rows) are not the images of any
token under the weights the operator gave (`--model-config DIR` holding the checkpoint).

Such a state is finite, non-zero and well formed, and still not what these weights compute for any
prefix: another checkpoint published under the same model name, bytes read in the wrong dtype,
garbage. The rows are decoded in `audit.checks.binding`; this module finds them in a value (layer
0's conv region, or the V half of its attention page) and says what they show. An attention page
whose V binds is also held to its K (`bind_keys`): its tokens' K turned to the block's positions,
else PREFIX_MISMATCH."""

from __future__ import annotations

import itertools
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from audit.checks.binding import (
    BOUND_KV_DTYPES,
    ROUNDED_DTYPES,
    ROW_TOLERANCE,
    key_positions,
    keys_fit,
    nearest_tokens,
    placed_keys,
    probed_key_rows,
    row_tolerance,
)
from audit.checks.floats import FLOAT_DTYPES, decode_floats
from audit.judge.fingerprints import ProducerWeights
from audit.judge.prefixes import check_prefixes, hex_hashes, supplied_rows
from audit.layouts import LayoutError
from audit.layouts.checkpoint import Checkpoint
from audit.layouts.weights import token_images
from audit.layouts.rotary import decode_starts
from audit.prefixrecords import CONV, KV, record_start, window_and_digest
from audit.prefixtable import PrefixTable
from audit.producers.vllm import split_stem
from audit.records import KeyRecord, Verdict

# A value already flagged for its state (zero, NaN/Inf, or a reading not decided) is not decoded.
_ALREADY_FLAGGED = frozenset({Verdict.ZERO_STATE, Verdict.ZERO_VALUE, Verdict.NONFINITE, Verdict.PARTIAL_ZERO,
                              Verdict.SIZE_MISMATCH, Verdict.AMBIGUOUS_LAYOUT})


NO_LAYER0_STATE = "no key read holds layer 0's token rows (no key of it was read, or none holds layer 0)"


@dataclass
class Bindings:
    """The token images of every model directory given with its weights, by (model, TP size, TP
    rank), built when a key of theirs is first judged; `unbound` says why a model is not bound,
    `decoded` how many of its keys had their layer-0 rows decoded, `prefix_checked` how many keys
    had them compared with a prefix record."""

    directories: dict[str, Path] = field(default_factory=dict)  # model name (as in keys) -> directory
    unbound: dict[str, str] = field(default_factory=dict)
    producers: ProducerWeights | None = None  # the manifests' fingerprints against these directories'
    prefixes: PrefixTable | None = None       # the producers' prefix records (--block-tables DIR)
    decoded: Counter = field(default_factory=Counter)
    prefix_checked: int = 0
    k_checked: int = 0  # attention pages whose layer-0 K was checked at its tokens' positions
    supplied: Counter = field(default_factory=Counter)  # keys bound to no token, not flagged: (model, `supplied_rows`' why)
    _images: dict = field(default_factory=dict, repr=False)
    _counting: threading.Lock = field(default_factory=threading.Lock, repr=False)  # batches are judged in threads

    @classmethod
    def of(cls, model_configs, model_name: str | None = None) -> Bindings:
        directories = {}
        for path in map(Path, model_configs):
            if path.is_dir() and Checkpoint.found(path):
                directories[model_name or path.name] = path
        return cls(directories)

    def images(self, model: str, tp_size: int, tp_rank: int):
        if model not in self.directories or model in self.unbound:
            return None
        ident = (model, tp_size, tp_rank)
        if ident not in self._images:
            try:
                self._images[ident] = token_images(self.directories[model], model, tp_size, tp_rank)
            except (LayoutError, OSError, ValueError) as error:
                self.unbound[model] = str(error)
                return None
        return self._images[ident]

    def summary(self, in_tasks: bool = False) -> dict:
        """For the report: which models' keys were bound, and why the others' were not. `in_tasks`
        (--ray): each task bound its own keys (their verdicts are in the records); what they bound
        is not brought back, so the models given are listed as such."""
        extra = {} if self.producers is None else {"fingerprints": self.producers.summary()}
        if self.prefixes is not None:  # PREFIX_MISMATCH: what the records could say
            extra["prefix_records"] = {"hashes": len(self.prefixes), "conflicting": len(self.prefixes.conflicts),
                                       "skipped_lines": self.prefixes.skipped, "keys_checked": self.prefix_checked}
        if in_tasks:
            return {"bound": [], "not_bound": {}, "row_tolerance": ROW_TOLERANCE,
                    "bound_in_tasks": sorted(self.directories), **extra}
        bound = set(self.decoded) - set(self.unbound)  # images built are not enough: a key decoded
        not_bound = {model: self.unbound.get(model, NO_LAYER0_STATE) for model in self.directories
                     if model not in bound}
        keys = {model: images.keys_not_bound for (model, _, _), images in self._images.items()
                if model in bound and images.region == "v" and images.keys is None}
        positions = {"k_checked": self.k_checked, "k_not_bound": keys} if self.k_checked or keys else {}
        if self.supplied:
            extra["supplied_rows"] = self._supplied_summary(bound)
        return {"bound": sorted(bound), "not_bound": not_bound, "row_tolerance": ROW_TOLERANCE,
                "keys_decoded": {model: self.decoded[model] for model in sorted(bound)}, **positions, **extra}

    def _supplied_summary(self, bound: set[str]) -> dict:
        """Keys left unflagged per why; and the models none of whose keys decoded bound to a token,
        where some went unrecorded: the text of a multimodal model's prompts binds, so such a store
        is of other weights unless every key read is of an image (or its records are missing)."""
        whys = Counter()
        for (_, why), keys in self.supplied.items():
            whys[why] += keys
        none_bound = sorted(model for model in bound if self.supplied[model, "unrecorded"]
                            and self.supplied[model, "unrecorded"] + self.supplied[model, "recorded"] == self.decoded[model])
        return {"recorded": whys["recorded"], "unrecorded": whys["unrecorded"],
                **({"no_key_bound": none_bound} if none_bound else {})}

    def __getstate__(self) -> dict:  # (--ray: a task's plan is pickled; a lock cannot be)
        return {name: value for name, value in self.__dict__.items() if name != "_counting"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _counting=threading.Lock())

    def count_k_checked(self, checked: int) -> None:
        with self._counting:
            self.k_checked += checked

    def count(self, decoded: Counter, prefix_checked: int, supplied: Counter) -> None:
        """Add a batch's keys decoded (per model), compared with their prefix records, and left
        unflagged for rows that may be supplied embeddings (`supplied_rows`)."""
        with self._counting:
            self.decoded.update(decoded)
            self.prefix_checked += prefix_checked
            self.supplied.update(supplied)


def layer0_region(layout, kind: str | None = None):
    """Layer 0's region in `layout` whose rows are token images, of `kind` (`TokenImages.region`) or
    any: its conv state ("conv"), its attention page of (heads, tokens, 2 * head_size) ("v": its V
    rows), or an MLA page of (1, tokens, latent) ("latent": each token's normed latent first, asked
    for by an MLA model's images, since a one-head page has that shape too); None where layer 0 holds
    none (a kernel-block split or a one-head slice of a page, as a manifest may describe it, is not
    read): only there is a row a function of one token."""
    for segment, region in layout.regions():
        if segment.layer != 0:
            continue
        if region.kind == "state" and region.name == "conv":
            found = "conv"
        elif region.kind == "kv" and len(region.shape) == 3 and region.dtype in BOUND_KV_DTYPES:
            found = "latent" if kind == "latent" and region.shape[0] == 1 else "v" if region.shape[2] % 2 == 0 else None
            if found == "latent" and region.dtype in ROUNDED_DTYPES:
                found = None
        else:
            continue
        if found is not None and kind in (None, found):
            return region
    return None


@dataclass(frozen=True)
class Values:
    """The values `bind_values` reads, by record index: which were read, and each one's bytes when
    asked for (a fetched batch's view is made only for a key whose rows are not gathered from
    `placed`). `placed`: the buffer a fetched batch's values lie in (host memory, or a torch tensor
    in GPU memory), and each one's offset in it, so that a stack of conv rows is one gather from it."""

    read: list[int]
    value: Callable[[int], object]
    placed: tuple[object, list[int]] | None = None

    @classmethod
    def listed(cls, values: list) -> Values:
        """Values given as a list, None where unread."""
        return cls([i for i, value in enumerate(values) if value is not None], values.__getitem__)


def bind_values(records: list[KeyRecord], values: Values, readings: list, bindings: Bindings) -> None:
    """WEIGHTS_MISMATCH on each record whose value's (`Values`) layer-0 token rows (conv rows, or
    attention's V: `layer0_region`) are not all images of tokens under its model's weights, under
    any of its readings (``readings[i]``: the layouts it may be read with, the one it is judged by
    first): a size that fits bfloat16 and float16 alike is bound under the reading that decodes to
    tokens, and flagged only when none does. The batch's rows are decoded at once, per (model, TP
    size, rank): every value's first reading (conv states of one layout stacked and decoded as one
    array: binding's cost a key stays a few microseconds), then the next reading of the values none
    has bound yet (a wrong reading's rows go the long way, a search of the whole vocabulary, so a
    healthy value is never read twice)."""
    judged = [i for i in values.read if readings[i]
              and not (records[i].verdicts and _ALREADY_FLAGGED.intersection(records[i].verdicts))]
    tried: dict[int, list] = {}  # record index -> (images, tokens, distances), one per reading decoded
    decoded: Counter = Counter()  # keys decoded, per model
    supplied: Counter = Counter()  # keys bound to no token and not flagged: (model, `supplied_rows`' why)
    of_prefix: list[tuple] = []  # (images, records bound, their tokens), each compared with its prefix record
    keyed: dict[int, tuple] = {}  # id(images) -> (images, attention pages bound: their K checked as one batch)
    stacked, one_by_one = _stacked_rows(judged, records, values, readings, bindings)
    later_of = {i: _readings(records[i], values.value(i), readings[i], bindings) for i in one_by_one}
    for images, members, rows, tolerance, wheres, probed in stacked:
        tokens, distances = nearest_tokens(rows.reshape(-1, images.columns), images, tolerance)
        tokens, distances = tokens.reshape(len(members), -1), distances.reshape(len(members), -1)
        binds = (distances <= tolerance).all(axis=1)
        decoded[images.model] += len(members)
        if bindings.prefixes is not None:  # the keys bound at once: their prefixes compared as one batch
            of_prefix.append((images, [records[members[j]] for j in np.flatnonzero(binds).tolist()], tokens[binds]))
        if probed is not None:  # attention pages bound: their K at their positions, as one array?
            at = np.flatnonzero(binds)
            bindings.count_k_checked(bind_stacked_keys(
                [(records[members[j]], members[j], wheres[j]) for j in at.tolist()], values.value,
                probed[at], tokens[at], images.keys))
        for j in np.flatnonzero(~binds).tolist():  # the first reading, decoded, does not bind:
            i = members[j]                         # the later ones are made one at a time
            tried[i] = [(images, tokens[j], distances[j], None if wheres is None else wheres[j], tolerance)]
            later_of[i] = itertools.islice(_readings(records[i], values.value(i), readings[i], bindings), 1, None)
    pending = [(i, reading, later) for i, later in later_of.items() if (reading := next(later, None)) is not None]
    while pending:
        groups: dict[int, list] = {}
        for i, (images, rows, order, tolerance), _ in pending:
            groups.setdefault(id(images), [images, []])[1].append((i, rows, order, tolerance))
        for images, members in groups.values():
            tokens, distances = nearest_tokens(np.concatenate([rows for _, rows, _, _ in members]), images,
                                               max(tolerance for *_, tolerance in members))
            start = 0
            for i, rows, order, tolerance in members:
                end = start + len(rows)
                tried.setdefault(i, []).append((images, tokens[start:end], distances[start:end], order, tolerance))
                start = end
        unbound = [(i, later) for i, _, later in pending if not (tried[i][-1][2] <= tried[i][-1][4]).all()]
        pending = [(i, reading, later) for i, later in unbound if (reading := next(later, None)) is not None]
    one_by_one_prefixes: dict[int, tuple] = {}  # id(images) -> (images, records, their tokens): one check each
    for i, outcomes in tried.items():
        bound = [(images, tokens, order) for images, tokens, distances, order, tolerance in outcomes
                 if (distances <= tolerance).all()]
        if not bound:
            images, tokens, distances, _, tolerance = outcomes[0]
            if not _every_reading_decoded(records[i], readings[i]):
                continue
            split = split_stem(records[i].key)
            if (why := supplied_rows(split and split[1], images, bindings.prefixes)) is not None:
                supplied[images.model, why] += 1
            else:
                _flag(records[i], tokens, distances, images, tolerance)
            continue
        images, tokens, where = bound[0]
        if where is not None and images.keys is not None:  # an attention page: its K at its tokens' positions?
            keyed.setdefault(id(images), (images, []))[1].append((records[i], values.value(i), where, tokens))
        if bindings.prefixes is not None:  # these weights' state: of the prefix its hash names?
            one_by_one_prefixes.setdefault(id(images), (images, [], []))
            one_by_one_prefixes[id(images)][1].append(records[i])
            one_by_one_prefixes[id(images)][2].append(tokens)
    for images, pages in keyed.values():
        bindings.count_k_checked(bind_keys(pages, images))
    for images, bound_records, tokens in one_by_one_prefixes.values():  # rows of one length: one array, settled at once
        of_prefix.append((images, bound_records, np.stack(tokens) if len({len(t) for t in tokens}) == 1 else tokens))
    decoded.update(tried[i][0][0].model for i in one_by_one if i in tried)
    checked = sum(check_prefixes(bound_records, tokens, images, bindings.prefixes)
                  for images, bound_records, tokens in of_prefix)
    bindings.count(decoded, checked, supplied)


def _stacked_rows(judged: list[int], records, values: Values, readings,
                  bindings: Bindings) -> tuple[list, list]:
    """The first readings that are conv states, or attention pages whose every row is their block's
    (in the CPU backend's byte order), stacked per (images, region): a list of (images, record
    indices, rows (keys, rows, columns), tolerance, each page's `where` (None for conv states), each
    page's K rows on the key table's columns (`probed_key_rows`' (keys, rows, columns), where the
    images have K; else None)); and
    the record indices left to read one at a time (a partial tail block, whose rows depend on its
    record; values in GPU memory given without their buffer; a width that does not fit the images,
    which `_readings` reports)."""
    groups: dict[tuple, list] = {}  # (id(images), id(region)) -> [images, region, record indices]
    members_of: dict[tuple, object] = {}  # (the key's readings, its size[, its rank]) -> its group's indices
    one_by_one = []
    for i in judged:
        record, layouts = records[i], readings[i]
        ident = (*map(id, layouts), record.size)
        if (found := members_of.get(ident, _UNSEEN)) is _UNSEEN:  # the rank matters where a layout is split
            found = members_of[ident] = _RANKED if any(layout.tp_size > 1 for layout in layouts) \
                else _members(groups, record.size, 0, layouts, bindings)
        if found is _RANKED:
            rank = record.parsed_fields().get("tp_rank", 0)
            if (found := members_of.get(ranked := (*ident, rank), _UNSEEN)) is _UNSEEN:
                found = members_of[ranked] = _members(groups, record.size, rank, layouts, bindings)
        if found is None or (values.placed is None and not isinstance(values.value(i), np.ndarray)):
            one_by_one.append(i)
        else:
            found.append(i)
    stacked = []
    for images, region, members in groups.values():
        wheres = None
        if images.region == "v":  # a page's rows are its block's where its record says all of them are
            windows, starts = _block_records([records[i] for i in members], bindings.prefixes)
            whole = [window is None or window >= region.shape[1] for window in windows]
            one_by_one += [i for i, kept in zip(members, whole) if not kept]
            members = [i for i, kept in zip(members, whole) if kept]
            wheres = [(region, 0, start) for start, kept in zip(starts, whole) if kept]
        numbers = decode_floats(_gathered(values, members, region), region.dtype) if members else None
        if numbers is None:
            continue
        probed = None
        if images.region == "v":  # (heads, K|V, tokens, head_size) a page: each token's V over the heads
            heads, tokens, width = region.shape
            rows = numbers.reshape(len(members), heads, 2, tokens, width // 2)[:, :, 1].transpose(0, 2, 1, 3)
            rows = np.ascontiguousarray(rows.reshape(len(members), tokens, heads * (width // 2)), dtype=np.float32)
            if images.keys is not None:  # K as `key_rows` reads it first: a head's K transposed (head_size, tokens)
                keys = numbers.reshape(len(members), heads, 2, width // 2, tokens)[:, images.keys.head, 0]
                probed = np.ascontiguousarray(keys[:, images.keys.columns].transpose(0, 2, 1), dtype=np.float32)
        else:
            rows = numbers.reshape(len(members), *region.shape).astype(np.float32)
            rows = rows if region.shape[0] <= region.shape[1] else rows.transpose(0, 2, 1)
        stacked.append((images, members, rows, row_tolerance(region.dtype), wheres, probed))
    return stacked, one_by_one


def _gathered(values: Values, members: list[int], region) -> np.ndarray:
    """The members' `region` bytes, one after another, in host memory. From a batch's buffer where
    its values lie a fixed step apart (a batch of keys of one size, as a rule): one strided copy; from
    GPU memory, one copy to the host for the whole group, not one a key."""
    if values.placed is None:
        return np.concatenate([values.value(i)[region.offset:region.offset + region.length] for i in members])
    buffer, offsets = values.placed
    starts = [offsets[i] + region.offset for i in members]
    step = starts[1] - starts[0] if len(starts) > 1 else region.length
    evenly = step >= region.length and starts[-1] + region.length <= len(buffer) \
        and not (len(starts) > 2 and (np.diff(starts) != step).any())
    if isinstance(buffer, np.ndarray):
        if not evenly:
            return np.concatenate([buffer[start:start + region.length] for start in starts])
        view = np.lib.stride_tricks.as_strided(buffer[starts[0]:], (len(starts), region.length), (step, 1),
                                               writeable=False)
        return view.reshape(-1)
    import torch  # (a batch in GPU memory: torch is there)

    on_device = buffer.as_strided((len(starts), region.length), (step, 1), starts[0]) if evenly \
        else torch.cat([buffer[start:start + region.length] for start in starts])
    return on_device.reshape(-1).cpu().numpy()


_UNSEEN, _RANKED = object(), object()  # (markers: a reading not met yet; one whose group depends on the rank)


def _members(groups: dict[tuple, list], size: int, rank: int, layouts, bindings: Bindings) -> list | None:
    """The indices of `groups`' group for the first reading of a key of `size`, `rank` and `layouts`
    (`_first_stacked_reading`); None where it is not stacked."""
    first = _first_stacked_reading(size, rank, layouts, bindings)
    return None if first is None else groups.setdefault((id(first[0]), id(first[1])), [*first, []])[2]


def _first_stacked_reading(size: int, rank: int, layouts, bindings: Bindings) -> tuple | None:
    """(images, region) of the first reading `_readings` would decode, where it is a conv state or an
    attention page (V rows) whose rows fit the images; None otherwise."""
    for layout in layouts:
        if layout.size != size or layer0_region(layout) is None:
            continue
        images = bindings.images(layout.model, layout.tp_size, rank if layout.tp_size > 1 else 0)
        region = None if images is None else layer0_region(layout, images.region)
        if region is None or region.dtype not in FLOAT_DTYPES:
            return None
        if images.region == "conv" and len(region.shape) == 2:
            return (images, region) if max(region.shape) == images.columns else None
        if images.region == "v" and len(region.shape) == 3:
            return (images, region) if region.shape[0] * (region.shape[2] // 2) == images.columns else None
        return None
    return None


def _readings(record: KeyRecord, value, layouts, bindings: Bindings) -> Iterator[tuple]:
    """(images, rows, where, tolerance) of `value`'s layer-0 token rows under each of its readings, the
    likeliest first, each made only when asked for; `where`, for an attention page's V rows: (its
    region, which of `token_rows`' byte orders), where its K rows are (`key_rows`); `tolerance`: the
    rows' `row_tolerance`."""
    seen = set()
    for layout in layouts:
        if layout.size != record.size or layer0_region(layout) is None:
            continue
        rank = record.parsed_fields().get("tp_rank", 0) if layout.tp_size > 1 else 0
        images = bindings.images(layout.model, layout.tp_size, rank)
        region = None if images is None else layer0_region(layout, images.region)
        if region is None or region in seen:
            continue
        seen.add(region)
        block = _block_record(record, images.region, bindings.prefixes)
        filled = None if block is None else window_and_digest(block)[0]
        for order, rows in enumerate(token_rows(value, region, images.region)):
            rows = rows[:filled, :images.columns] if images.region == "latent" else rows[:filled]
            if rows.shape[1] != images.columns:  # (every byte order of a region has the same width)
                bindings.unbound[layout.model] = (f"layer 0's {images.region} rows have {rows.shape[1]} columns "
                                                  f"at TP {layout.tp_size}, the image rule {images.columns}")
                break
            yield (images, rows, ((region, order, record_start(block)) if images.region == "v" else None),
                   row_tolerance(region.dtype))


def _block_record(record: KeyRecord, kind: str, prefixes: PrefixTable | None):
    """An attention page's block record, as kept (None: a conv state, or no record): how many of its
    V (or latent) rows are its block's tokens (a partial tail block is keyed at its last token, and
    its later rows hold whatever the page held before), and where recorded the block's start."""
    if kind == CONV or prefixes is None:
        return None
    split = split_stem(record.key)
    return prefixes.packed(split[1], KV) if split else None


def _block_records(records: list[KeyRecord], prefixes: PrefixTable | None) -> tuple[list, list]:
    """`_block_record` of attention pages, as two lists: how many of each page's rows are its block's
    tokens (None: no record) and the block's start (None: not recorded). A batch of hex hashes of one
    length is looked up as one array (`hex_hashes`, `PrefixTable.tabled`); a hash no table holds,
    and every other batch, one at a time."""
    if prefixes is None:
        return [None] * len(records), [None] * len(records)
    hashes = hex_hashes([record.key for record in records]) if isinstance(prefixes, PrefixTable) else None
    if hashes is None:
        found, windows, starts = np.zeros(len(records), bool), [None] * len(records), [None] * len(records)
    else:
        found, _, windows, starts = prefixes.tabled(hashes, KV)
        windows, starts = windows.tolist(), (starts.astype(np.int64) - 1).tolist()
    for j in np.flatnonzero(~found).tolist():
        block = _block_record(records[j], KV, prefixes)
        windows[j] = None if block is None else window_and_digest(block)[0]
        starts[j] = record_start(block)
    return windows, [None if start is not None and start < 0 else start for start in starts]


def token_rows(value, region, kind: str) -> Iterator[np.ndarray]:
    """The region's token rows as float32 (n, columns), oldest token first, under each byte order it
    may have, one at a time; none for a dtype that is not a float. A value in device memory brings only these bytes
    to the host. A conv state is vLLM's "SD" layout (state_len, dim), or its transpose ("DS"). An
    attention page is (heads, tokens, 2 * head_size) numbers, and a token's V row is its V over the
    heads: vLLM 0.32's CPU backend keeps each head's K of every token, then its V of every token
    (``cpu_attn.py``: ``kv_cache.view(blocks, heads, block_size * 2, -1).chunk(2, dim=2)``; proved on
    a real vLLM's keys); the page interface's own orders, a token's ``k|v`` per head
    (``KVCacheLayout.LBHNC``) or per token (``LBNHC``), are read too: a value binds under any. An MLA
    page is a latent a token (rotary part last: the caller keeps the image's columns)."""
    data = value[region.offset:region.offset + region.length]
    if not isinstance(data, np.ndarray):  # a torch tensor on the GPU
        data = data.cpu().numpy()
    numbers = decode_floats(data, region.dtype)
    if numbers is None:
        return
    if kind == "conv":
        rows = numbers.reshape(region.shape).astype(np.float32)
        yield rows if rows.shape[0] <= rows.shape[1] else rows.T
        return
    heads, tokens, width = region.shape
    if kind == "latent":
        yield numbers.reshape(heads * tokens, width).astype(np.float32)
        return
    size = width // 2
    by_head = numbers.reshape(heads, 2, tokens, size)[:, 1].transpose(1, 0, 2)   # CPU_ATTN
    interleaved = numbers.reshape(heads, tokens, 2, size)[:, :, 1].transpose(1, 0, 2)  # LBHNC, k|v per token
    token_major = numbers.reshape(tokens, heads, 2, size)[:, :, 1]                   # LBNHC
    orders = (by_head, interleaved) if heads == 1 else (by_head, interleaved, token_major)  # one head: the same
    for v in orders:  # views: each copied only when its turn comes
        yield np.ascontiguousarray(v.reshape(tokens, heads * size), dtype=np.float32)


def key_rows(value, region, order: int, head: int) -> Iterator[np.ndarray]:
    """One KV head's layer-0 K rows (tokens, head_size), oldest first, under `token_rows`' `order`-th
    byte order of an attention page, each way its K may lie: vLLM 0.32's CPU backend keeps a head's
    K transposed, a dimension's every token together ((head_size, tokens), then its V by token:
    proved on a real vLLM's keys), a backend that keeps K as it keeps V by token; the page
    interface's orders keep a token's k beside its v."""
    data = value[region.offset:region.offset + region.length]
    if not isinstance(data, np.ndarray):  # a torch tensor on the GPU
        data = data.cpu().numpy()
    heads, tokens, width = region.shape
    numbers, size = decode_floats(data, region.dtype), width // 2
    if order == 0:
        yield numbers.reshape(heads, 2, size, tokens)[head, 0].T
        yield numbers.reshape(heads, 2, tokens, size)[head, 0]
    elif order == 1:
        yield numbers.reshape(heads, tokens, 2, size)[head, :, 0]
    else:
        yield numbers.reshape(tokens, heads, 2, size)[:, head, 0]


def bind_keys(pages: list[tuple], images) -> int:
    """PREFIX_MISMATCH on each attention page (record, value, (region, byte order, recorded start),
    tokens its V rows bound to) whose K rows, read any way they may lie (`key_rows`), are not those
    tokens' K at consecutive positions from its block's start: the start its producer recorded for
    the key's hash, else any multiple of the page's rows (`key_positions`): KV computed at other
    positions (a block of the same tokens from elsewhere in a prompt, an off-by-some position), or K
    of other tokens than its V. Each page's K rows read in its V's order, pages of one region and row
    count are judged as one array (`bind_stacked_keys`). How many pages were checked."""
    keys = images.keys
    probed = [probed_key_rows(next(key_rows(value, region, order, keys.head))[:len(tokens)], keys)
              for _, value, (region, order, _), tokens in pages]
    groups: dict[tuple, list[int]] = {}
    for j, (_, _, (region, _, _), _) in enumerate(pages):
        groups.setdefault((id(region), len(probed[j])), []).append(j)
    for members in groups.values():
        bind_stacked_keys([(pages[j][0], j, pages[j][2]) for j in members], lambda j: pages[j][1],
                          np.stack([probed[j] for j in members]),
                          np.stack([np.asarray(pages[j][3])[:len(probed[j])] for j in members]), keys)
    return len(pages)


def bind_stacked_keys(pages: list[tuple], value_of: Callable[[int], object], probed: np.ndarray,
                      tokens: np.ndarray, keys) -> int:
    """`bind_keys` of attention pages of one region and row count, as one array (a batch's stacked
    pages, `_stacked_rows`, or those `bind_keys` read one at a time): each page (record, its value's
    index for `value_of`, which is asked only for a page that does not fit, (region, byte order,
    recorded start)), its K rows on the key table's columns
    (`probed`: pages, rows, columns) and the tokens its V rows bound to (pages, rows). The starts not
    recorded decoded at once, every row's distance at its position taken at once; a page that does
    not fit there judged alone, every way its K may lie (`_bind_page_keys`). How many pages were checked."""
    if not pages:
        return 0
    region, rows = pages[0][2][0], probed.shape[1]
    recorded = [start for _, _, (_, _, start) in pages]
    starts = np.array([0 if start is None else start for start in recorded], np.int64)
    placed = np.array([start is not None for start in recorded])
    if not placed.all():
        unrecorded = np.flatnonzero(~placed)
        decoded = decode_starts(probed[unrecorded].view(np.complex64), keys.turned[tokens[unrecorded]],
                                keys.rotary, keys.pairs)
        starts[unrecorded] = decoded
        placed[unrecorded] = decoded % region.shape[1] == 0  # (a block starts at a multiple of its rows)
    positions = starts[:, None] + np.arange(rows)
    fits = keys_fit(probed.reshape(-1, probed.shape[2]), tokens.reshape(-1).astype(np.int64), positions.reshape(-1),
                    keys, row_tolerance(region.dtype)).reshape(len(pages), rows).all(axis=1) & placed
    for j in np.flatnonzero(~fits).tolist():
        record, index, where = pages[j]
        _bind_page_keys(record, value_of(index), where, tokens[j], keys)
    return len(pages)


def _bind_page_keys(record: KeyRecord, value, where: tuple, tokens, keys) -> None:
    """`bind_keys` of one page, every way its K may lie (`placed_keys`); flagged with the evidence of
    the likeliest."""
    region, order, recorded = where
    block, tokens, tolerance = region.shape[1], np.asarray(tokens), row_tolerance(region.dtype)
    placed, (rows, start, distances) = placed_keys(key_rows(value, region, order, keys.head), tokens, keys,
                                                   recorded, block, tolerance)
    if placed:
        return
    decoded = start if recorded is None else key_positions(rows, tokens, keys)[0]
    if Verdict.PREFIX_MISMATCH not in record.verdicts:
        record.verdicts.append(Verdict.PREFIX_MISMATCH)
    worst = int(np.argmax(distances))
    record.evidence["key_positions"] = {
        "layer": 0, "region": "k", "decoded_start": decoded, "recorded_start": recorded, "block_tokens": block,
        "rows_beyond_tolerance": int((distances > tolerance).sum()), "rows": len(distances),
        "worst_row": worst, "worst_distance": round(float(distances[worst]), 6), "row_tolerance": tolerance,
        "rotary": keys.source.get("rotary")}


def _every_reading_decoded(record: KeyRecord, layouts) -> bool:
    """Whether each reading of the key's size holds layer-0 rows that can be decoded (`layer0_region`):
    where one does not (an fp8 e5m2 page beside a bfloat16 reading of the same size), the reading that
    did not bind may be the wrong one, and the key is not flagged."""
    return all(layer0_region(layout) is not None for layout in layouts if layout.size == record.size)


def _flag(record: KeyRecord, tokens, distances, images, tolerance: float) -> None:
    record.verdicts.append(Verdict.WEIGHTS_MISMATCH)
    record.evidence["weights_mismatch"] = {
        "layer": 0, "region": images.region, "row_tolerance": tolerance,
        "rows": [{"row": row, "nearest_token": int(token), "distance": round(float(distance), 6)}
                 for row, (token, distance) in enumerate(zip(tokens, distances))],
        "weights": images.source}
