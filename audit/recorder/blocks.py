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

NULL_BLOCK_ID = 0  # vLLM's null block (vllm/v1/attention/backends/utils.py)


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

    Updates replace the arrays whole, so a put running in another thread sees either the old or
    the new set, never half of one.
    """

    def __init__(self) -> None:
        self._bases = np.empty(0, np.int64)
        self._lengths = np.empty(0, np.int64)

    def add(self, base: int, nbytes: int) -> None:
        keep = self._bases != base
        bases = np.append(self._bases[keep], np.int64(base))
        lengths = np.append(self._lengths[keep], np.int64(nbytes))
        order = np.argsort(bases, kind="stable")
        self._bases, self._lengths = bases[order], lengths[order]

    def remove(self, base: int) -> None:
        keep = self._bases != base
        self._bases, self._lengths = self._bases[keep], self._lengths[keep]

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
            return self._resolve_matrix(matrix, size_matrix, self._bases, self._lengths)
        if len(addrs) == 1:
            return [KeyBlocks(len(addrs[0]), None, None, "addresses and sizes are not one integer per segment")]
        # Keys with different segment counts: resolve each on its own.
        return [self.resolve([row], [row_sizes])[0] for row, row_sizes in zip(addrs, sizes)]

    @staticmethod
    def _resolve_matrix(addrs: np.ndarray, sizes: np.ndarray, bases: np.ndarray,
                        lengths: np.ndarray) -> list[KeyBlocks]:
        keys, segments = addrs.shape
        if len(bases) == 0 or segments == 0:
            note = "no buffer registered" if segments else "no segments"
            return [KeyBlocks(segments, None, [None] * segments, note) for _ in range(keys)]
        region = np.searchsorted(bases, addrs, side="right") - 1
        # Keys whose segments fall in other regions than the first key's get their own layout.
        same_layout = (region == region[0]).all(axis=1)
        if not same_layout.all():
            results: list[KeyBlocks | None] = [None] * keys
            for rows in (np.flatnonzero(same_layout), np.flatnonzero(~same_layout)):
                part = RegisteredRegions._resolve_matrix(addrs[rows], sizes[rows], bases, lengths)
                for row, blocks in zip(rows.tolist(), part):
                    results[row] = blocks
            return results  # type: ignore[return-value]

        layout = region[0]
        safe = np.maximum(layout, 0)
        region_base, region_end = bases[safe], bases[safe] + lengths[safe]
        segment_base = np.zeros(segments, np.int64)
        segment_len = np.zeros(segments, np.int64)
        splits_evenly = np.ones(segments, bool)
        shared: list[np.ndarray] = []  # column groups that share one region
        for r in np.unique(layout[layout >= 0]).tolist():
            columns = np.flatnonzero(layout == r)
            count, length = len(columns), int(lengths[r])
            splits_evenly[columns] = length % count == 0
            segment_base[columns] = int(bases[r]) + (length // count) * np.arange(count)
            segment_len[columns] = length // count
            if count > 1:
                shared.append(columns)

        inside = (layout >= 0) & (addrs < region_end)
        offset = addrs - segment_base
        positive = sizes > 0
        divisor = np.where(positive, sizes, 1)
        aligned = positive & (offset % divisor == 0)
        within = (offset >= 0) & (offset + sizes <= segment_len)
        block = offset // divisor
        agree = np.ones_like(inside)
        for columns in shared:
            agree[:, columns] = block[:, columns] == block[:, columns[:1]]
        valid = inside & splits_evenly & aligned & within & agree
        row_valid = valid.all(axis=1).tolist()
        block_rows = block.tolist()
        if all(row_valid):
            return [KeyBlocks(segments, ids) for ids in block_rows]
        checks = [  # in the order a note names the first that fails
            (inside, "a segment lies outside every registered buffer"),
            (np.broadcast_to(splits_evenly, inside.shape), "a registered buffer does not split evenly into its segments"),
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
                       for a, b, hit in zip(addrs[row].tolist(), region_base.tolist(), inside[row].tolist())]
            results.append(KeyBlocks(segments, None, offsets, note))
        return results
