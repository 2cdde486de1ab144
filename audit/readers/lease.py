"""Lease reads: `batch_get_into` into two registered buffers that alternate, so the next batch can
be in flight while the current one is checked. A value larger than a buffer half is read alone
into a one-off buffer: never skipped.
"""

from __future__ import annotations

from audit.readers.buffers import ALIGNMENT, FetchedBatch, RegisteredBuffer, Slot


class LeaseReader:
    """Reads through `batch_get_into`: simple and fast, but every read grants the key a lease."""

    mode = "lease"

    def __init__(self, store, buffer_bytes: int, buffer_type=RegisteredBuffer):
        self.store = store
        self.buffer_type = buffer_type
        half = max(buffer_bytes // 2, ALIGNMENT)
        self.buffers = [buffer_type(store, half), buffer_type(store, half)]

    @property
    def capacity(self) -> int:
        return self.buffers[0].nbytes

    def order(self, keys):
        """Keys as given: each lease read is a transfer of its own, wherever the value lies."""
        return keys

    def fetch(self, slots: list[Slot], turn: int) -> FetchedBatch:
        needed = slots[-1].offset + (slots[-1].key.size or 0)
        if needed > self.capacity:  # a single value larger than a buffer half
            buffer, one_off = self.buffer_type(self.store, needed), True
        else:
            buffer, one_off = self.buffers[turn % 2], False
        base = buffer.address
        results = self.store.batch_get_into(
            [slot.key.name for slot in slots],
            [base + slot.offset for slot in slots],
            [slot.key.size or 0 for slot in slots],
        )
        return FetchedBatch(slots, list(results), buffer, one_off)

    def close(self) -> None:
        for buffer in self.buffers:
            buffer.release()
