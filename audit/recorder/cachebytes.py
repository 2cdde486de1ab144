"""Where the guards read a value's bytes: vLLM's KV caches, which the store reads from (a put) or
writes into (a load). In host memory a page is read in place through its address; in GPU memory
through byte views of the caches' storages, and what the host needs of a batch is copied once."""

from __future__ import annotations

import bisect
import ctypes
import functools
from collections.abc import Sequence

import numpy as np


def cache_tensors(kv_caches: dict):
    """Every tensor of vLLM's `kv_caches` (a layer's value is a tensor or a list of them)."""
    for value in kv_caches.values():
        yield from value if isinstance(value, (list, tuple)) else (value,)


@functools.lru_cache(maxsize=64)
def _byte_array(size: int) -> type:
    return ctypes.c_uint8 * size


def host_bytes(address: int, size: int) -> np.ndarray:
    """`size` bytes of host memory at `address` (a KV-cache page), as a uint8 view: no copy."""
    return np.frombuffer(_byte_array(size).from_address(address), dtype=np.uint8)


class CacheBytes:
    """The KV caches' bytes by address. `storages`: (base, bytes, uint8 view) of each storage in
    GPU memory (or, with `in_kernel`, of every cache tensor: the Triton interpreter on CPU tensors,
    as the tests run the kernel); empty where the caches are host memory. `host`: the same of each
    cache in host memory (a CPU tensor's storage, or a numpy array), whose pages are then sliced
    from one view made once (`host_view`) instead of a view made per page."""

    def __init__(self, kv_caches: dict | None = None, *, in_kernel: bool | None = None):
        storages, host = {}, {}
        for tensor in cache_tensors(kv_caches or {}):
            if getattr(tensor, "is_cuda", False) if in_kernel is None else in_kernel:
                storage = tensor.untyped_storage()
                storages[storage.data_ptr()] = storage
            elif (span := _host_span(tensor)) is not None:
                host[span[0]] = span
        self.storages = sorted((base, storage.nbytes(), _byte_view(storage)) for base, storage in storages.items())
        self.host = sorted((base, nbytes, view) for base, nbytes, view, _ in host.values())
        self._host_bases = [base for base, _, _ in self.host]
        self._kept = [owner for _, _, _, owner in host.values()]  # the storages the views read

    def host_view(self, address: int, size: int) -> np.ndarray:
        """`host_bytes(address, size)`, sliced from a described host cache where it lies in one."""
        slot = bisect.bisect_right(self._host_bases, address) - 1
        if slot >= 0:
            base, nbytes, view = self.host[slot]
            if address + size <= base + nbytes:
                return view[address - base:address - base + size]
        return host_bytes(address, size)

    def slots_of(self, addresses: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The storage (index into `storages`) of each of an array of addresses, and its base."""
        bases = np.array([base for base, _, _ in self.storages], dtype=np.int64)
        ends = bases + np.array([nbytes for _, nbytes, _ in self.storages], dtype=np.int64)
        slots = np.searchsorted(bases, addresses, side="right") - 1
        outside = (slots < 0) | (addresses >= ends[np.maximum(slots, 0)])
        if outside.any():
            raise ValueError(f"address {int(addresses[outside][0]):#x} lies outside every KV-cache storage the guard knows")
        return slots, bases[slots]

    def on_host(self, ranges: Sequence[tuple[int, int]]) -> list[np.ndarray]:
        """The bytes at each (address, length), in host memory: views of host caches; from GPU
        memory, one copy to the host for all of them (one synchronisation a batch, not one a key)."""
        if not self.storages:
            return [self.host_view(address, length) for address, length in ranges]
        import torch

        if not ranges:
            return []
        slots, bases = self.slots_of(np.array([address for address, _ in ranges], dtype=np.int64))
        pieces = [self.storages[slot][2][address - base:address - base + length]
                  for (address, length), slot, base in zip(ranges, slots.tolist(), bases.tolist())]
        copied = torch.cat(pieces).cpu().numpy()
        return np.split(copied, np.cumsum([len(piece) for piece in pieces[:-1]]).tolist())

    def of_segments(self, addrs, sizes, wanted: list[tuple[int, int, int, int]]) -> list[np.ndarray]:
        """For each (value, segment, offset, length) `wanted`, those bytes of the value's segment (at
        `addrs[value][segment]`, of `sizes[value][segment]` bytes) in host memory, fewer where the
        segment ends sooner: what `StateBinder.refusals` reads of a load or a put."""
        return self.on_host([(addrs[i][s] + offset, max(0, min(length, sizes[i][s] - offset)))
                             for i, s, offset, length in wanted])


def _host_span(tensor) -> tuple | None:
    """(base, bytes, uint8 view, owner) of a cache in host memory: a contiguous numpy array, or a CPU
    tensor's storage (the owner kept, so that its memory outlives the view); None for anything else."""
    if isinstance(tensor, np.ndarray):
        if not tensor.flags.c_contiguous or not tensor.nbytes:
            return None
        return tensor.ctypes.data, tensor.nbytes, tensor.reshape(-1).view(np.uint8), tensor
    if getattr(tensor, "device", None) is None or getattr(tensor.device, "type", None) != "cpu":
        return None
    storage = tensor.untyped_storage()
    if not storage.nbytes():
        return None
    return storage.data_ptr(), storage.nbytes(), host_bytes(storage.data_ptr(), storage.nbytes()), storage


def _byte_view(storage):
    import torch

    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (storage.nbytes(),))
