"""Lease-free reads of disk-only keys: the value read from the holder's bucket files on this host.

A key whose only replica is on a holder's SSD has no address a transfer engine can read, and
the store client reads it through the holder's offload RPC: that grants the key a lease (the
application's `remove` fails with -706 for the lease TTL) and, on a master with
`--promotion_on_hit`, counts towards copying the key back into memory, evicting others. This
reader opens the holder's offload directory instead (it runs on the holder's host) and asks the
master only through `/batch_query_keys`, so the cluster behaves as if no one had looked.

As with raw memory reads, the master is asked again after the read: a key it no longer knows
is VANISHED (-704); one whose disk replica it no longer lists at that size, or whose bucket left
the disk meanwhile, is MOVED. A key removed and put again, whose new bucket was written after
the directory was indexed, is read from its old bucket unseen: `confirm` indexes the directory
afresh before a finding is reported.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import xxhash

from audit.connection import AdminClient
from audit.errors import ERROR_NAMES, MOVED, NOT_PEEKABLE
from audit.readers.buckets import StoredValue, index_directories, stored_key
from audit.readers.buffers import ALIGNMENT, FetchedBatch, HostBuffer, Slot, plan_batches
from audit.readers.confirm import Confirmation, KeyRead, confirmation_of
from audit.readers.descriptors import query_answers
from audit.records import KeyInfo, KeyRecord

OBJECT_NOT_FOUND = -704
TRANSFER_FAIL = -800
DEFAULT_TENANT = "default"  # a bucket stores `tenant \0 key`; the admin API answers for this tenant only


def _disk_endpoint(key: KeyInfo) -> str | None:
    """The holder's offload RPC endpoint, as the listing described the key's disk replica."""
    return next((replica.get("endpoint") for replica in key.replicas if replica.get("tier") == "local_disk"), None)


def _disk_sizes(answer: dict | None) -> set[int] | None:
    """The sizes of the disk replicas the master lists for a key; None when it no longer knows the key."""
    if answer is None or (not answer.get("ok") and answer.get("error") == "OBJECT_NOT_FOUND"):
        return None
    return {replica.get("object_size") for replica in answer.get("local_disk_values") or []}


class DiskReader:
    """Same interface as `audit.readers.PeekReader`, for the default tenant's disk-only keys whose
    holder's offload directory (`MOONCAKE_OFFLOAD_FILE_STORAGE_PATH`, bucket backend) is on this host."""

    mode = "disk"

    def __init__(self, admin: AdminClient, directories: Iterable[Path], buffer_bytes: int):
        self.admin = admin
        self.directories = list(directories)
        self.index = index_directories(self.directories)
        half = max(buffer_bytes // 2, ALIGNMENT)
        self.buffers = [HostBuffer(half), HostBuffer(half)]

    @property
    def capacity(self) -> int:
        return self.buffers[0].nbytes

    def holds(self, key: KeyInfo) -> bool:
        """Whether `key` is disk-only and one of the directories stores it: this reader's to read."""
        return (self._stored(key) is not None
                and not any(replica.get("tier", "memory") == "memory" for replica in key.replicas))

    def _stored(self, key: KeyInfo) -> StoredValue | None:
        return self.index.get(stored_key(DEFAULT_TENANT, key.name))

    def order(self, keys: Sequence[KeyInfo]) -> list[KeyInfo]:
        """Keys by bucket file and offset: a directory read front to back (keys not found first)."""
        def place(key: KeyInfo) -> tuple[str, int]:
            value = self._stored(key)
            return ("", 0) if value is None else (str(value.path), value.offset)
        return sorted(keys, key=place)

    def fetch(self, slots: list[Slot], turn: int) -> FetchedBatch:
        needed = slots[-1].offset + (slots[-1].key.size or 0)
        if needed > self.capacity:  # a single value larger than a buffer half
            buffer, one_off = HostBuffer(needed), True
        else:
            buffer, one_off = self.buffers[turn % 2], False
        reads = self._read(slots, buffer)
        return FetchedBatch(slots, [read.code for read in reads], buffer, one_off,
                            replicas=[read.rows for read in reads])

    def confirm(self, records: Sequence[KeyRecord]) -> dict[str, Confirmation]:
        """Index the directories afresh, read the keys of `records` again, and say per key whether
        the second read saw the bytes the first one judged."""
        self.index = index_directories(self.directories)
        by_name = {record.key: record for record in records if record.xxh3 is not None}
        keys = [KeyInfo(name=record.key, size=record.size) for record in by_name.values()]
        confirmations: dict[str, Confirmation] = {}
        for slots in plan_batches(keys, self.capacity):
            buffer = HostBuffer(slots[-1].offset + (slots[-1].key.size or 0))
            for slot, read in zip(slots, self._read(slots, buffer)):
                confirmations[slot.key.name] = confirmation_of(by_name[slot.key.name], read)
        return confirmations

    def _read(self, slots: list[Slot], buffer: HostBuffer) -> list[KeyRead]:
        files: dict[Path, int] = {}
        try:
            attempts = [self._read_one(slot, buffer, files) for slot in slots]
        finally:
            for descriptor in files.values():
                os.close(descriptor)
        after = query_answers(self.admin, (slot.key.name for slot in slots))
        return [self._settle(slot, *attempt, after.get(slot.key.name)) for slot, attempt in zip(slots, attempts)]

    def _read_one(self, slot: Slot, buffer: HostBuffer,
                  files: dict[Path, int]) -> tuple[StoredValue | None, int, int | None]:
        """The stored value read into the slot: where it was, 0 or a negative code, its XXH3-64."""
        value = self._stored(slot.key)
        if value is None or "," in slot.key.name:  # no bucket here holds it, or the master cannot be asked of it
            return None, NOT_PEEKABLE, None
        if value.size != slot.key.size:
            return value, MOVED, None  # the bucket holds another value once stored under that name
        into = buffer.array[slot.offset:slot.offset + value.size]
        prefix = bytearray(value.key_size)
        try:
            if value.path not in files:
                files[value.path] = os.open(value.path, os.O_RDONLY)
            read = os.preadv(files[value.path], [prefix, into], value.offset)
        except FileNotFoundError:
            return value, MOVED, None  # the bucket left the disk (evicted) since it was indexed
        except OSError:
            return value, TRANSFER_FAIL, None
        if read != value.key_size + value.size or bytes(prefix) != value.stored_key:
            return value, TRANSFER_FAIL, None
        return value, 0, xxhash.xxh3_64_intdigest(into)

    def _settle(self, slot: Slot, value: StoredValue | None, code: int, digest: int | None,
                answer: dict | None) -> KeyRead:
        sizes = _disk_sizes(answer)
        if sizes is None:
            return KeyRead(OBJECT_NOT_FOUND, [])
        if value is None:
            return KeyRead(code, [])
        if code == 0 and value.size not in sizes:
            code = MOVED
        row = {"tier": "local_disk", "endpoint": _disk_endpoint(slot.key), "address": None, "file": str(value.path),
               "offset": value.value_offset, "size": value.size, "xxh3": None, "status": "ok"}
        if code != 0:
            row.update(status="moved" if code == MOVED else "failed",
                       error={"code": code, "name": ERROR_NAMES.get(code, "UNKNOWN")})
            return KeyRead(code, [row])
        row["xxh3"] = f"{digest:016x}"
        return KeyRead(value.size, [row], digest)

    def close(self) -> None:
        """Nothing is held between batches: files are opened per batch, buffers are plain memory."""
