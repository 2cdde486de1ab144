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

import re
from collections.abc import Sequence


from audit.checks.loaded import LoadedRegion, combine, device_region_flags, refusal
from audit.recorder.binding import StateBinder
from audit.recorder.cachebytes import CacheBytes, host_bytes
from audit.recorder.deny import DenyList

_GROUP = re.compile(r"@group:(\d+)@")


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
        self.refusals = 0

    def describe(self, document: dict, kv_caches: dict, *, in_kernel: bool | None = None) -> None:
        """The consumer's manifest and caches: which regions its keys' segments hold, and, where the
        caches live on a GPU (or `in_kernel` says so: the Triton interpreter on CPU tensors), byte
        views of their storages for the kernel."""
        self.regions = group_regions(document)
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
                segments = [host_bytes(ptr, size) for ptr, size in zip(addrs[index], sizes[index])]
                reason = refusal(segments, self._regions_of(keys[index]))
                if reason is not None:
                    found[index] = reason
        if self.binder is not None:  # layer 0: these weights' state, of the request's own tokens?
            unrefused = [index for index in loaded if index not in found]
            found.update(self.binder.refusals(keys, unrefused, lambda wanted: self.memory.of_segments(
                addrs, sizes, wanted)))
        return found

    def _regions_of(self, key: str) -> list[list[LoadedRegion] | None] | None:
        match = _GROUP.search(key)
        return self.regions.get(int(match.group(1)) if match else 0)

    def _check_on_device(self, keys, addrs, sizes, loaded: list[int]) -> dict[int, str]:
        """Every region of the batch, in one kernel launch per dtype across the caches' storages;
        judged per value."""
        slots, offsets, lengths, dtypes = [], [], [], []
        states: list[bool] = []
        value_of: list[int] = []
        for value, index in enumerate(loaded):
            described = self._regions_of(keys[index])
            for segment, (address, size) in enumerate(zip(addrs[index], sizes[index])):
                slot = self.memory.storage_of(address)
                base = self.memory.storages[slot][0]
                regions = (described[segment] if described is not None and segment < len(described) else None) \
                    or [LoadedRegion(0, size, None, True)]
                for offset, length, dtype, state in regions:
                    length = min(length, size - offset)
                    if length > 0:
                        slots.append(slot)
                        offsets.append(address - base + offset)
                        lengths.append(length)
                        dtypes.append(dtype)
                        states.append(state)
                        value_of.append(value)
        flags = device_region_flags([view for _, _, view in self.memory.storages], slots, offsets, lengths, dtypes)
        verdicts = combine(flags, states, value_of, len(loaded))
        return {index: reason for index, reason in zip(loaded, verdicts) if reason is not None}
