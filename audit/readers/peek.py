"""`peek` read mode: every replica's bytes read raw, without a lease, and checked for a race.

`batch_get_into` grants each key a read lease (FACTS §3): audited keys then outlive unaudited ones
in eviction, and the application's `remove()` fails with -706 until the lease ends. A peek read
asks the master only through `/batch_query_keys` (lease-free) and reads each memory replica with
a TransferEngine of its own, so the cluster behaves as if no one had looked.

The price is a race: a raw read does not stop eviction or removal from reusing the memory. So the
descriptors are asked again after the read; a replica that is no longer listed exactly as it was
(endpoint, address, size) may have been overwritten by another value meanwhile, and is MOVED
(recorded, never checked as bad bytes). A key the master no longer knows is VANISHED (-704).
What slips through (a key removed and re-put at the same address during the read) changes the
bytes between two reads, which `confirm` catches before a finding is reported.
"""

from __future__ import annotations

from collections.abc import Sequence
import xxhash

from audit.connection import AdminClient, Settings
from audit.errors import ERROR_NAMES, MOVED, NOT_PEEKABLE
from audit.readers.buffers import ALIGNMENT, FetchedBatch, RegisteredBuffer, Slot, plan_batches
from audit.readers.confirm import Confirmation, KeyRead, confirmation_of
from audit.readers.descriptors import GONE, Replica, query_replicas
from audit.readers.engine import RawRead, RawTransfer
from audit.records import KeyInfo, KeyRecord

OBJECT_NOT_FOUND = -704


def _row(replica: Replica, status: str, digest: int | None, code: int | None) -> dict:
    row = {**replica.to_json(), "xxh3": None if digest is None else f"{digest:016x}", "status": status}
    if code is not None:
        row["error"] = {"code": code, "name": ERROR_NAMES.get(code, "UNKNOWN")}
    return row


def _settle(key: KeyInfo, before: list[Replica] | None, after: list[Replica] | None,
            attempts: list[tuple[Replica, int, int | None]], primary: int | None) -> KeyRead:
    """Decide a key from what was read and what the master said before and after.

    `attempts`: (replica, 0 or a negative code, digest) in replica order; `primary`: the index of
    the attempt whose bytes are in the buffer (the first one read).
    """
    if before is GONE or after is GONE:
        return KeyRead(OBJECT_NOT_FOUND, [])
    if not before:
        return KeyRead(NOT_PEEKABLE, [])
    still_listed = set(after)
    rows, statuses = [], []
    for replica, code, digest in attempts:
        if code == MOVED or replica not in still_listed:
            status, digest, code = "moved", None, MOVED
        else:
            status = "ok" if code == 0 else "failed"
        statuses.append(status)
        rows.append(_row(replica, status, digest, None if status == "ok" else code))
    if primary is not None and statuses[primary] == "ok":
        return KeyRead(key.size or 0, rows, attempts[primary][2])
    if primary is not None or "moved" in statuses:
        return KeyRead(MOVED, rows)
    return KeyRead(next(code for _, code, _ in attempts), rows)


class PeekReader:
    """Same interface as `audit.readers.lease.LeaseReader`; reads every replica, takes no lease."""

    mode = "peek"

    def __init__(self, settings: Settings, admin: AdminClient, buffer_bytes: int):
        self.admin = admin
        self.transfer = RawTransfer(settings)
        half = max(buffer_bytes // 2, ALIGNMENT)
        try:
            self.buffers = [RegisteredBuffer(self.transfer, half), RegisteredBuffer(self.transfer, half)]
            self.scratch = RegisteredBuffer(self.transfer, half)  # second and later replicas land here
        except BaseException:
            self.transfer.close()
            raise

    @property
    def capacity(self) -> int:
        return self.buffers[0].nbytes

    def fetch(self, slots: list[Slot], turn: int) -> FetchedBatch:
        needed = slots[-1].offset + (slots[-1].key.size or 0)
        if needed > self.capacity:  # a single value larger than a buffer half
            buffer, scratch = RegisteredBuffer(self.transfer, needed), RegisteredBuffer(self.transfer, needed)
            try:
                reads = self._read(slots, buffer, scratch)
            except BaseException:
                buffer.release()
                raise
            finally:
                scratch.release()
            one_off = True
        else:
            buffer, one_off = self.buffers[turn % 2], False
            reads = self._read(slots, buffer, self.scratch)
        return FetchedBatch(slots, [read.code for read in reads], buffer, one_off,
                            replicas=[read.rows for read in reads])

    def confirm(self, records: Sequence[KeyRecord]) -> dict[str, Confirmation]:
        """Read the keys of `records` again (fresh descriptors, own buffers: safe beside a running
        scan) and say, per key, whether the second read saw the bytes the first one judged.

        A record without a digest (NULL_BACKED on a key that could not be read) rests on a block
        table, not on bytes: it is not read again and gets no confirmation.
        """
        by_name = {record.key: record for record in records if record.xxh3 is not None}
        keys = [KeyInfo(name=record.key, size=record.size, fields=record.fields) for record in by_name.values()]
        confirmations: dict[str, Confirmation] = {}
        for slots in plan_batches(keys, self.capacity):
            needed = max(slots[-1].offset + (slots[-1].key.size or 0), ALIGNMENT)
            buffer, scratch = RegisteredBuffer(self.transfer, needed), RegisteredBuffer(self.transfer, needed)
            try:
                reads = self._read(slots, buffer, scratch)
            finally:
                buffer.release()
                scratch.release()
            for slot, read in zip(slots, reads):
                confirmations[slot.key.name] = confirmation_of(by_name[slot.key.name], read)
        return confirmations

    def _read(self, slots: list[Slot], buffer: RegisteredBuffer, scratch: RegisteredBuffer) -> list[KeyRead]:
        """Every key's first replica is read into `buffer` at its slot's offset (the bytes the checks
        see), its second at the same offset in `scratch`, both in one transfer call, so a holder
        that does not answer is waited for once; third and later replicas follow, one call each."""
        names = [slot.key.name for slot in slots]
        before = query_replicas(self.admin, names)
        attempts: list[dict[int, tuple[Replica, int, int | None]]] = [{} for _ in slots]
        primary: list[int | None] = [None] * len(slots)  # the replica whose bytes are in `buffer`
        rounds = max((len(before.get(name) or []) for name in names), default=0)
        for replica_indices in [range(0, min(rounds, 2))] + [range(r, r + 1) for r in range(2, rounds)]:
            planned = []  # in replica order, so a key's first replica read fine becomes its primary
            for replica_index in replica_indices:
                target = buffer if replica_index == 0 else scratch
                for i, slot in enumerate(slots):
                    replicas = before.get(slot.key.name) or []
                    if replica_index >= len(replicas):
                        continue
                    replica = replicas[replica_index]
                    if replica.size != slot.key.size:  # replaced since listing: reading could overflow the slot
                        attempts[i][replica_index] = (replica, MOVED, None)
                    else:
                        planned.append((i, replica_index, replica, target))
            codes = self.transfer.read([RawRead(replica.endpoint, target.array.ctypes.data + slots[i].offset,
                                                replica.address, replica.size) for i, _, replica, target in planned])
            for (i, replica_index, replica, target), code in zip(planned, codes):
                view = target.array[slots[i].offset: slots[i].offset + replica.size]
                attempts[i][replica_index] = (replica, code, xxhash.xxh3_64_intdigest(view) if code == 0 else None)
                if code == 0 and primary[i] is None:
                    primary[i] = replica_index
                    if target is not buffer:
                        buffer.array[slots[i].offset: slots[i].offset + replica.size] = view
        after = query_replicas(self.admin, names)
        return [_settle(slot.key, before.get(name, []), after.get(name, []),
                        [attempts[i][r] for r in sorted(attempts[i])], primary[i])
                for i, (slot, name) in enumerate(zip(slots, names))]

    def close(self) -> None:
        for buffer in [*self.buffers, self.scratch]:
            buffer.release()
        self.transfer.close()
