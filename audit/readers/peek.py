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
from audit.readers.descriptors import GONE, Replica, names_only, query_answers, query_replicas, replicas_of
from audit.readers.engine import RawRead, RawTransfer
from audit.readers.order import in_reading_order
from audit.records import KeyInfo, KeyRecord

OBJECT_NOT_FOUND = -704
CONFIRM_KEEP_BYTES = 16 << 20  # a confirmation's buffers up to this size are kept for the next one


def _listed_replicas(key: KeyInfo) -> list[Replica] | None:
    """The key's memory replicas as its listing described them, in the master's order; None when
    it came with none (a key not from a listing, or one with no memory replica): asked for then."""
    replicas = key.replicas
    if len(replicas) == 1:  # nearly every listed key: one memory replica, as the table's columns give it
        only = replicas[0]
        endpoint, address, size = only.get("endpoint"), only.get("address"), only.get("size")
        if only.get("tier") == "memory" and type(endpoint) is str and type(address) is int and type(size) is int:
            return [Replica(endpoint, address, size)]
    memory = [replica for replica in replicas if replica.get("tier") == "memory"]
    if not memory:
        return None
    try:
        return [Replica(str(r["endpoint"]), int(r["address"]), int(r["size"])) for r in memory]
    except (KeyError, TypeError, ValueError):
        return None


def _row(replica: Replica, status: str, digest: int | None, code: int | None) -> dict:
    row = {**replica.to_json(), "xxh3": None if digest is None else f"{digest:016x}", "status": status}
    if code is not None:
        row["error"] = {"code": code, "name": ERROR_NAMES.get(code, "UNKNOWN")}
    return row


def _read_fine(key: KeyInfo, replica: Replica, digest: int) -> KeyRead:
    """A key read whole from its one replica, which the master still lists."""
    return KeyRead(key.size or 0, [{"endpoint": replica.endpoint, "address": replica.address, "size": replica.size,
                                    "xxh3": f"{digest:016x}", "status": "ok"}], digest)


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
    if len(attempts) == 1 and primary == 0:  # the common key: one replica, read fine
        replica, code, digest = attempts[0]
        if code == 0 and replica in after:
            return _read_fine(key, replica, digest)
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


class _Scratch:
    """Where second and later replicas land: registered on first use (a store of single-replica
    keys never needs it), `nbytes` large."""

    def __init__(self, transfer, nbytes: int):
        self.transfer = transfer
        self.nbytes = nbytes
        self.buffer: RegisteredBuffer | None = None

    def get(self) -> RegisteredBuffer:
        if self.buffer is None:
            self.buffer = RegisteredBuffer(self.transfer, self.nbytes)
        return self.buffer

    def release(self) -> None:
        if self.buffer is not None:
            self.buffer.release()
            self.buffer = None


class PeekReader:
    """Same interface as `audit.readers.lease.LeaseReader`; reads every replica, takes no lease.

    `transfer`: a RawTransfer to read through (one engine for a run's sample reads and its scan);
    without one the reader starts its own, and closes it with itself. `buffer_type` makes its two
    buffers (`HostMemoryAhead.registered`: in memory touched ahead)."""

    mode = "peek"

    def __init__(self, settings: Settings, admin: AdminClient, buffer_bytes: int, transfer: RawTransfer | None = None,
                 buffer_type=RegisteredBuffer):
        self.admin = admin
        self._owns_transfer = transfer is None
        self.transfer = RawTransfer(settings) if transfer is None else transfer
        half = max(buffer_bytes // 2, ALIGNMENT)
        try:
            self.buffers = [buffer_type(self.transfer, half), buffer_type(self.transfer, half)]
        except BaseException:
            if self._owns_transfer:
                self.transfer.close()
            raise
        self.scratch = _Scratch(self.transfer, half)  # second and later replicas land here
        self._confirming: tuple[RegisteredBuffer, _Scratch] | None = None  # kept for the next confirmation

    @property
    def capacity(self) -> int:
        return self.buffers[0].nbytes

    def order(self, keys: Sequence[KeyInfo]) -> Sequence[KeyInfo]:
        """Keys by holder and address: neighbours in a holder's memory are read as one transfer."""
        return in_reading_order(keys, self.capacity)

    def fetch(self, slots: list[Slot], turn: int) -> FetchedBatch:
        needed = slots[-1].offset + (slots[-1].key.size or 0)
        if needed > self.capacity:  # a single value larger than a buffer half
            buffer, scratch = RegisteredBuffer(self.transfer, needed), _Scratch(self.transfer, needed)
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
            buffer, scratch = self._confirm_buffers(needed)
            try:
                reads = self._read(slots, buffer, scratch)
            finally:
                if buffer.nbytes > CONFIRM_KEEP_BYTES:
                    buffer.release()
                    scratch.release()
                    self._confirming = None
            for slot, read in zip(slots, reads):
                confirmations[slot.key.name] = confirmation_of(by_name[slot.key.name], read)
        return confirmations

    def _confirm_buffers(self, needed: int) -> tuple[RegisteredBuffer, _Scratch]:
        """Buffers for a confirmation of `needed` bytes: those of the last one when they are large
        enough (a check confirms a few findings per batch: registering memory each time costs
        more than the read), else new ones, kept when small."""
        if self._confirming is not None and self._confirming[0].nbytes >= needed:
            return self._confirming
        if self._confirming is not None:
            self._confirming[0].release()
            self._confirming[1].release()
            self._confirming = None
        size = max(needed, min(2 * needed, CONFIRM_KEEP_BYTES))
        self._confirming = (RegisteredBuffer(self.transfer, size), _Scratch(self.transfer, size))
        return self._confirming

    def _read(self, slots: list[Slot], buffer: RegisteredBuffer, scratch: _Scratch, fresh: bool = False) -> list[KeyRead]:
        """Every key's first replica is read into `buffer` at its slot's offset (the bytes the checks
        see), its second at the same offset in `scratch`, both in one transfer call, so a holder
        that does not answer is waited for once; third and later replicas follow, one call each.

        Where to read: the memory replicas the listing described (`slot.key.replicas`), else (or
        `fresh`) the master's answer just before the read. Either way the master is asked again
        after the read; a key the listing described otherwise than that answer is read once more,
        with a fresh answer before it, exactly as a key the listing did not describe."""
        names = [slot.key.name for slot in slots]
        listed = [None] * len(slots) if fresh else [_listed_replicas(slot.key) for slot in slots]
        ask = [name for name, replicas in zip(names, listed) if replicas is None]
        asked = query_replicas(self.admin, ask) if ask else {}
        before = [replicas if replicas is not None else asked.get(name, []) for name, replicas in zip(names, listed)]
        attempts: list[dict[int, tuple[Replica, int, int | None]]] = [{} for _ in slots]
        primary: list[int | None] = [None] * len(slots)  # the replica whose bytes are in `buffer`
        rounds = max((len(replicas or ()) for replicas in before), default=0)
        for replica_indices in [range(0, min(rounds, 2))] + [range(r, r + 1) for r in range(2, rounds)]:
            planned = []  # in replica order, so a key's first replica read fine becomes its primary
            for replica_index in replica_indices:
                target = buffer if replica_index == 0 else scratch.get()
                for i, slot in enumerate(slots):
                    replicas = before[i] or ()
                    if replica_index >= len(replicas):
                        continue
                    replica = replicas[replica_index]
                    if replica.size != slot.key.size:  # replaced since listing: reading could overflow the slot
                        attempts[i][replica_index] = (replica, MOVED, None)
                    else:
                        planned.append((i, replica_index, replica, target))
            bases = {id(target): target.array.ctypes.data for target in {id(t): t for *_, t in planned}.values()}
            codes = self.transfer.read([RawRead(replica.endpoint, bases[id(target)] + slots[i].offset,
                                                replica.address, replica.size) for i, _, replica, target in planned])
            views = {id(target): memoryview(target.array) for target in {id(t): t for *_, t in planned}.values()}
            for (i, replica_index, replica, target), code in zip(planned, codes):
                offset = slots[i].offset
                digest = xxhash.xxh3_64_intdigest(views[id(target)][offset: offset + replica.size]) if code == 0 else None
                attempts[i][replica_index] = (replica, code, digest)
                if code == 0 and primary[i] is None:
                    primary[i] = replica_index
                    if target is not buffer:
                        buffer.array[offset: offset + replica.size] = target.array[offset: offset + replica.size]
        answers = query_answers(self.admin, names)
        reads: list[KeyRead] = []
        again = []  # keys the listing described otherwise than the master does now
        for i, (slot, name) in enumerate(zip(slots, names)):
            answer, mine, tried = answers.get(name), listed[i], attempts[i]
            if mine is not None and len(mine) == 1 and primary[i] == 0 and len(tried) == 1 and answer is not None \
                    and names_only(answer, mine[0]):  # the common key: listed, read fine, still there
                replica, _, digest = tried[0]
                reads.append(_read_fine(slot.key, replica, digest))
                continue
            after = [] if answer is None else replicas_of(answer)
            reads.append(_settle(slot.key, before[i], after, [tried[r] for r in sorted(tried)], primary[i]))
            if mine is not None and after is not GONE and after != mine:
                again.append(i)
        if again:  # described otherwise since the listing: read as a key the listing did not describe
            for i, read in zip(again, self._read([slots[i] for i in again], buffer, scratch, fresh=True)):
                reads[i] = read
        return reads

    def close(self) -> None:
        for buffer in self.buffers:
            buffer.release()
        self.scratch.release()
        if self._confirming is not None:
            self._confirming[0].release()
            self._confirming[1].release()
            self._confirming = None
        if self._owns_transfer:
            self.transfer.close()
