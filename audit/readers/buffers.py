"""Where fetched bytes land: registered host or CUDA buffers, and batches packed to fit them.

Batches are bounded by bytes (one buffer half) and by `MAX_KEYS_PER_BATCH` (larger TCP batches
overflow Mooncake's per-peer queue, FACTS §3). Every value starts on a cache line.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from audit.records import KeyInfo

MAX_KEYS_PER_BATCH = 1000
ALIGNMENT = 64  # every value starts on a cache line: word views and GPU loads stay aligned

def _aligned(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


@dataclass(slots=True)
class Slot:
    key: KeyInfo
    offset: int


def plan_batches(keys: Sequence[KeyInfo], capacity: int,
                 max_keys: int = MAX_KEYS_PER_BATCH) -> Iterator[list[Slot]]:
    """Pack keys, in order, into batches that fit `capacity` bytes and `max_keys` keys."""
    batch: list[Slot] = []
    used = 0
    mask = ALIGNMENT - 1
    for key in keys:
        size = ((key.size or 0) + mask) & ~mask  # _aligned, inline: once per key
        if batch and (used + size > capacity or len(batch) >= max_keys):
            yield batch
            batch, used = [], 0
        batch.append(Slot(key, used))
        used += size
    if batch:
        yield batch


def host_memory(nbytes: int) -> np.ndarray:
    """Host memory for a buffer, its pages touched now, not during the first transfer."""
    array = np.empty(max(nbytes, ALIGNMENT), dtype=np.uint8)
    array.fill(0)  # numpy releases the GIL while it writes
    return array


class HostMemoryAhead:
    """A reader's host memory, touched in a thread while the scan still plans its keys (the chunk
    index, the layout fit, the store client's setup): the page faults of 256 MiB take 0.03 s, and
    0.15-0.3 s when the kernel compacts memory for huge pages (docs/benchmarks.md). `registered` is
    a buffer type: the sample reads that choose a group's reading borrow the memory first (a buffer
    released gives its memory back), then the scan's reader takes it."""

    def __init__(self, sizes: Sequence[int]):
        self._arrays: list[np.ndarray] = []
        self._thread = threading.Thread(target=self._touch, args=(list(sizes),), name="host-memory", daemon=True)
        self._thread.start()

    def _touch(self, sizes: list[int]) -> None:
        try:
            for nbytes in sizes:
                self._arrays.append(host_memory(nbytes))
        except MemoryError:
            pass  # the reader asks for it again, and reports the error

    def registered(self, store, nbytes: int) -> RegisteredBuffer:
        """A RegisteredBuffer of `nbytes` in the smallest memory touched ahead that holds it, else
        in new memory (what is left then goes first: memory is never held twice)."""
        self._thread.join()
        size = max(nbytes, ALIGNMENT)
        holding = [index for index, array in enumerate(self._arrays) if array.nbytes >= size]
        if not holding:
            self._arrays.clear()
            return RegisteredBuffer(store, nbytes)
        whole = self._arrays.pop(min(holding, key=lambda index: self._arrays[index].nbytes))
        return _Lent(store, size, whole, self._arrays)


class RegisteredBuffer:
    """Host memory registered with the store so transfers land in it directly; `array`: memory
    touched earlier (`host_memory`), else it is made here."""

    def __init__(self, store, nbytes: int, array: np.ndarray | None = None):
        self.store = store
        self.array = host_memory(nbytes) if array is None else array
        rc = store.register_buffer(self.array.ctypes.data, self.array.nbytes)
        if rc != 0:
            raise MemoryError(f"register_buffer of {nbytes} bytes failed ({rc})")

    @property
    def nbytes(self) -> int:
        return self.array.nbytes

    @property
    def address(self) -> int:
        return self.array.ctypes.data

    def release(self) -> None:
        self.store.unregister_buffer(self.address)


class HostBuffer:
    """Host memory that files are read into (`os.preadv`): no transfer engine writes to it, so
    nothing registers it."""

    def __init__(self, nbytes: int):
        self.array = host_memory(nbytes)

    @property
    def nbytes(self) -> int:
        return self.array.nbytes

    def release(self) -> None:
        """Nothing to unregister: the memory goes with the last reference to it."""


class _Lent(RegisteredBuffer):
    """A RegisteredBuffer in the first bytes of memory touched ahead; released, the memory goes back."""

    def __init__(self, store, nbytes: int, whole: np.ndarray, pool: list):
        super().__init__(store, nbytes, whole[:nbytes])
        self._whole, self._pool = whole, pool

    def release(self) -> None:
        super().release()
        self._pool.append(self._whole)


class CudaBuffer:
    """GPU memory (a torch tensor) registered with the store: values land in HBM with no host
    bounce, for the Triton checker. Needs the CUDA build of the Mooncake client."""

    def __init__(self, store, nbytes: int):
        import torch

        self.store = store
        self.array = torch.empty(max(nbytes, ALIGNMENT), dtype=torch.uint8, device="cuda")
        rc = store.register_buffer(self.array.data_ptr(), self.array.numel())
        if rc != 0:
            raise MemoryError(f"register_buffer of {nbytes} bytes of GPU memory failed ({rc})")

    @property
    def nbytes(self) -> int:
        return self.array.numel()

    @property
    def address(self) -> int:
        return self.array.data_ptr()

    def release(self) -> None:
        self.store.unregister_buffer(self.address)


@dataclass
class FetchedBatch:
    slots: list[Slot]
    results: list[int]          # bytes read, or a negative Mooncake error code
    buffer: RegisteredBuffer
    one_off: bool = False
    # Per slot, one entry per replica read ({"endpoint", "address", "size", "xxh3", "status"}),
    # from readers that read every replica (audit.readers.PeekReader); None from LeaseReader.
    replicas: list[list[dict]] | None = None

    def view(self, slot: Slot, length: int) -> np.ndarray:
        return self.buffer.array[slot.offset: slot.offset + length]

    def release(self) -> None:
        if self.one_off:
            self.buffer.release()
