"""From a published source address back to the physical block it was read from.

vLLM's connector reads key i's value from ``addrs[i][j] = segment_base_j + block_id * size_j``; every
segment lies in a memory region the producer registered with ``register_buffer``. A region holds
one segment (blocks-first layouts, recurrent state) or several equal ones (K/V-first attention: K
then V). The put is not told the segment bases, so they are derived: a region holding k of a key's
segments is split into k equal parts, taken in the order the key lists them. The derivation is
checked, never assumed: every segment must start inside its part at a multiple of its size and end
inside it, and segments sharing a region must agree on the block id. A key failing a check keeps
its raw offsets and a note instead of block ids.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from audit.blocktables import NULL_BLOCK_ID


@dataclass(frozen=True)
class KeyBlocks:
    """Where one key's value came from: a block id per segment, or why that is not known."""

    segments: int
    block_ids: list[int] | None
    offsets: list[int | None] | None = None  # bytes from the start of each segment's registered buffer
    note: str | None = None

    @property
    def null_backed(self) -> bool:
        """Any segment read from the null block (an unresolved segment at offset 0 is block 0 too)."""
        if self.block_ids is not None:
            return NULL_BLOCK_ID in self.block_ids
        return self.offsets is not None and 0 in self.offsets


class RegisteredRegions:
    """The buffers a store client registered, sorted by base address.

    Updates replace the whole snapshot, so a put running in another thread sees either the old or
    the new set, never half of one.
    """

    def __init__(self) -> None:
        self._snapshot = _Snapshot(np.empty(0, np.int64), np.empty(0, np.int64))

    def add(self, base: int, nbytes: int) -> None:
        old = self._snapshot
        keep = old.bases != base
        bases = np.append(old.bases[keep], np.int64(base))
        lengths = np.append(old.lengths[keep], np.int64(nbytes))
        order = np.argsort(bases, kind="stable")
        self._snapshot = _Snapshot(bases[order], lengths[order])

    def remove(self, base: int) -> None:
        old = self._snapshot
        keep = old.bases != base
        self._snapshot = _Snapshot(old.bases[keep], old.lengths[keep])

    def resolve(self, addrs: list[list[int]], sizes: list[list[int]]) -> list[KeyBlocks]:
        """One KeyBlocks per key, from each key's segment addresses and sizes."""
        if not addrs:
            return []
        try:
            matrix = np.asarray(addrs, dtype=np.int64)
            size_matrix = np.asarray(sizes, dtype=np.int64)
            rectangular = matrix.ndim == 2 and matrix.shape == size_matrix.shape
        except (ValueError, OverflowError, TypeError):
            rectangular = False
        if rectangular:
            return self._snapshot.resolve(matrix, size_matrix)
        if len(addrs) == 1:
            return [KeyBlocks(len(addrs[0]), None, None, "addresses and sizes are not one integer per segment")]
        # Keys with different segment counts: resolve each on its own.
        return [self.resolve([row], [row_sizes])[0] for row, row_sizes in zip(addrs, sizes)]


@dataclass(frozen=True)
class _Layout:
    """Per segment (column) of keys whose segments lie in the same regions: where each one is."""

    in_region: np.ndarray  # the column's address lies at or above some region's base
    region_base: np.ndarray
    region_end: np.ndarray
    segment_base: np.ndarray  # region base + rank among the key's segments in that region * part
    segment_len: np.ndarray  # region length / segments of the key in that region
    splits_evenly: np.ndarray
    first_in_region: np.ndarray  # column of the region's first segment: all must share its block id


class _Snapshot:
    """Registered regions at one moment, with the segment layouts derived from them so far."""

    MAX_LAYOUTS = 64  # a producer uses one or a few; a cap keeps an odd one from growing the cache

    def __init__(self, bases: np.ndarray, lengths: np.ndarray):
        self.bases, self.lengths = bases, lengths
        self._layouts: dict[bytes, _Layout] = {}

    def layout(self, regions: np.ndarray) -> _Layout:
        """The layout of keys whose segment j lies in region ``regions[j]`` (-1: below every region)."""
        cache_key = regions.tobytes()
        layout = self._layouts.get(cache_key)
        if layout is None:
            if len(self._layouts) >= self.MAX_LAYOUTS:
                self._layouts.clear()
            layout = self._layouts[cache_key] = self._derive(regions)
        return layout

    def _derive(self, regions: np.ndarray) -> _Layout:
        columns = len(regions)
        safe = np.maximum(regions, 0)
        _, group, counts = np.unique(regions, return_inverse=True, return_counts=True)
        order = np.argsort(group, kind="stable")  # columns grouped by region, in listed order
        group_start = np.cumsum(counts) - counts
        rank = np.empty(columns, np.int64)
        rank[order] = np.arange(columns) - group_start[group[order]]
        base, length, count = self.bases[safe], self.lengths[safe], counts[group]
        part = length // count
        return _Layout(in_region=regions >= 0, region_base=base, region_end=base + length,
                       segment_base=base + rank * part, segment_len=part, splits_evenly=length % count == 0,
                       first_in_region=order[group_start][group])

    def resolve(self, addrs: np.ndarray, sizes: np.ndarray) -> list[KeyBlocks]:
        keys, segments = addrs.shape
        if len(self.bases) == 0 or segments == 0:
            note = "no buffer registered" if segments else "no segments"
            return [KeyBlocks(segments, None, [None] * segments, note) for _ in range(keys)]
        regions = np.searchsorted(self.bases, addrs, side="right") - 1
        same_regions = (regions == regions[0]).all(axis=1)
        if not same_regions.all():  # keys placed differently from the first: resolved apart
            results: list[KeyBlocks | None] = [None] * keys
            for rows in (np.flatnonzero(same_regions), np.flatnonzero(~same_regions)):
                for row, blocks in zip(rows.tolist(), self.resolve(addrs[rows], sizes[rows])):
                    results[row] = blocks
            return results  # type: ignore[return-value]

        layout = self.layout(regions[0])
        inside = layout.in_region & (addrs < layout.region_end)
        offset = addrs - layout.segment_base
        positive = sizes > 0
        block, remainder = np.divmod(offset, np.where(positive, sizes, 1))
        aligned = positive & (remainder == 0)
        within = (offset >= 0) & (offset + sizes <= layout.segment_len)
        agree = block == block[:, layout.first_in_region]
        valid = inside & layout.splits_evenly & aligned & within & agree
        row_valid = valid.all(axis=1).tolist()
        block_rows = block.tolist()
        if all(row_valid):
            return [KeyBlocks(segments, ids) for ids in block_rows]
        checks = [  # in the order a note names the first that fails
            (inside, "a segment lies outside every registered buffer"),
            (np.broadcast_to(layout.splits_evenly, inside.shape),
             "a registered buffer does not split evenly into its segments"),
            (positive, "a segment size is not positive"),
            (aligned, "a segment's offset is not a multiple of its size"),
            (within, "a segment's block crosses the end of its segment"),
            (agree, "segments sharing one registered buffer disagree on the block id (segment bases ambiguous)"),
        ]
        results = []
        for row, ok in enumerate(row_valid):
            if ok:
                results.append(KeyBlocks(segments, block_rows[row]))
                continue
            column = int(np.flatnonzero(~valid[row])[0])
            note = next(text for passed, text in checks if not passed[row, column])
            offsets = [int(a - b) if hit else None
                       for a, b, hit in zip(addrs[row].tolist(), layout.region_base.tolist(), inside[row].tolist())]
            results.append(KeyBlocks(segments, None, offsets, note))
        return results
