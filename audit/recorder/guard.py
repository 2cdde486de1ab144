"""The load guard: every value a consumer loads is checked where it landed, before its model reads it.

A value is refused when the deny list knows it (refused before, or published from the null block by
the put records: `audit.recorder.deny`), or when its bytes fail `audit.checks.loaded.refusal`: a
recurrent-state region all zero, the whole value zero, NaN/Inf in a float region. The regions come
from the consumer's own manifest (`audit.recorder.manifest.describe_worker`: each group's segments,
state offsets and dtypes); a group it could not describe is checked segment by segment for zeros.
On a CUDA KV cache the Triton region kernel checks the batch in place; on the CPU, numpy reads the
pages through their addresses. With a `StateBinder`, a value those checks pass is bound at layer 0
(`audit.recorder.binding`: WEIGHTS_MISMATCH, PREFIX_MISMATCH).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from audit.checks.loaded import LoadedRegion, combine, device_region_flags, refusal
from audit.recorder.binding import StateBinder, key_group
from audit.recorder.cachebytes import CacheBytes
from audit.recorder.deny import DenyList

_WHOLE = np.iinfo(np.int64).max  # a region's length that is its segment's (`_laid_out`)


def group_regions(document: dict) -> dict[int, list[list[LoadedRegion] | None]]:
    """Per KV-cache group id, per segment of its keys: the regions the guard checks (None: unknown)."""
    groups: dict[int, list[list[LoadedRegion] | None]] = {}
    for group in document.get("groups") or []:
        segments = group.get("segments")
        if not segments:
            continue
        states = group.get("states") or []
        attention_dtype = (group.get("attention") or {}).get("dtype")
        described: list[list[LoadedRegion] | None] = []
        for segment in segments:
            length = int(segment["block_len"])
            if segment.get("layer") is None:  # a slot of another group's layer: no state of ours
                described.append([LoadedRegion(0, length, None, False)])
            elif states:
                if segment.get("offset_in_page", 0):
                    described.append(None)
                    continue
                regions = [LoadedRegion(int(s["offset"]), int(s["length"]), s.get("dtype"), True) for s in states]
                end = max(r.offset + r.length for r in regions)
                if end < length:
                    regions.append(LoadedRegion(end, length - end, None, False))  # the page's zero padding
                described.append(regions)
            else:
                described.append([LoadedRegion(0, length, attention_dtype or segment.get("dtype"), False)])
        groups[int(group["group"])] = described
    return groups


class LoadGuard:
    def __init__(self, deny: DenyList, binder: StateBinder | None = None):
        self.deny = deny
        self.binder = binder
        self.regions: dict[int, list[list[LoadedRegion] | None]] = {}
        self.memory = CacheBytes()  # the consumer's caches, described
        self._layouts: dict[tuple, tuple] = {}  # `_laid_out`'s, by (group's regions, segments)
        self.refusals = 0

    def describe(self, document: dict, kv_caches: dict, *, in_kernel: bool | None = None) -> None:
        """The consumer's manifest and caches: which regions its keys' segments hold, and, where the
        caches live on a GPU (or `in_kernel` says so: the Triton interpreter on CPU tensors), byte
        views of their storages for the kernel."""
        self.regions = group_regions(document)
        self._layouts = {}
        if self.binder is not None:
            self.binder.describe(document)
        self.memory = CacheBytes(kv_caches, in_kernel=in_kernel)

    def known(self, keys: Sequence[str]) -> dict[int, str]:
        """Keys refused without a read: index -> reason."""
        self.deny.refresh()
        found = {}
        for index, key in enumerate(keys):
            reason = self.deny.reason(key)
            if reason is not None:
                found[index] = reason
        return found

    def check(self, keys: Sequence[str], addrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]],
              results: Sequence[int]) -> dict[int, str]:
        """Loaded values (result >= 0) whose bytes refuse them: index -> reason."""
        loaded = [i for i, rc in enumerate(results) if rc is not None and rc >= 0]
        if not loaded:
            return {}
        if self.memory.storages:
            found = self._check_on_device(keys, addrs, sizes, loaded)
        else:
            found = {}
            for index in loaded:
                segments = [self.memory.host_view(ptr, size) for ptr, size in zip(addrs[index], sizes[index])]
                reason = refusal(segments, self._regions_of(keys[index]))
                if reason is not None:
                    found[index] = reason
        if self.binder is not None:  # layer 0: these weights' state, of the request's own tokens?
            unrefused = [index for index in loaded if index not in found]
            found.update(self.binder.refusals(keys, unrefused, lambda wanted: self.memory.of_segments(
                addrs, sizes, wanted)))
        return found

    def _laid_out(self, described, segments: int) -> tuple:
        """The regions of a value of `segments` segments whose group is `described`, as arrays
        (segment, offset, length, dtype, state): a segment not described is one state region of
        its own length (kept per group and segment count until the next `describe`)."""
        ident = (id(described), segments)
        if (found := self._layouts.get(ident)) is None:
            rows = [(segment, *region) for segment in range(segments)
                    for region in ((described[segment] if described is not None and segment < len(described) else None)
                                   or [LoadedRegion(0, _WHOLE, None, True)])]
            segment, offset, length, dtypes, states = zip(*rows) if rows else ((),) * 5  # (no segment: no region)
            found = self._layouts[ident] = (np.array(segment, dtype=np.int64), np.array(offset, dtype=np.int64),
                                            np.array(length, dtype=np.int64), np.array(dtypes, dtype=object),
                                            np.array(states, dtype=bool))
        return found

    def _regions_of(self, key: str) -> list[list[LoadedRegion] | None] | None:
        return self.regions.get(key_group(key))

    def _check_on_device(self, keys, addrs, sizes, loaded: list[int]) -> dict[int, str]:
        """Every region of the batch, in one kernel launch per dtype across the caches' storages;
        judged per value. The regions are laid out as arrays a group of values at a time (its
        values' segments share their regions), not a region at a time."""
        of_shape: dict[tuple, list] = {}  # (its group's regions, segments) -> [those regions, positions in `loaded`]
        for position, index in enumerate(loaded):
            described = self._regions_of(keys[index])
            of_shape.setdefault((id(described), len(addrs[index])), [described, []])[1].append(position)
        columns: list[list] = [[], [], [], [], [], []]  # slots, offsets, lengths, dtypes, states, values
        for described, positions in of_shape.values():
            segment, offset, length, dtypes, states = self._laid_out(described, len(addrs[loaded[positions[0]]]))
            address = np.array([addrs[loaded[p]] for p in positions], dtype=np.int64)[:, segment]  # (values, regions)
            size = np.array([sizes[loaded[p]] for p in positions], dtype=np.int64)[:, segment]
            slots, bases = self.memory.slots_of(address)
            lengths = np.minimum(length, size - offset)
            kept = lengths > 0
            for column, values in zip(columns, (slots, address - bases + offset, lengths,
                                                np.broadcast_to(dtypes, kept.shape), np.broadcast_to(states, kept.shape),
                                                np.broadcast_to(np.array(positions)[:, None], kept.shape))):
                column.append(values[kept])
        slots, offsets, lengths, dtypes, states, value_of = (np.concatenate(column) for column in columns)
        zero, nonfinite = device_region_flags([view for _, _, view in self.memory.storages], slots, offsets, lengths,
                                              dtypes.tolist())
        verdicts = combine(zero, nonfinite, states, value_of, len(loaded))
        return {index: reason for index, reason in zip(loaded, verdicts) if reason is not None}
