"""Lease-free reads of disk-only keys: the value read from the holder's offload files on this host
(bucket or file-per-key backend, `audit.readers.offload_index`).

A key whose only replica is on a holder's SSD has no address a transfer engine can read, and
the store client reads it through the holder's offload RPC: that grants the key a lease (the
application's `remove` fails with -706 for the lease TTL) and, on a master with
`--promotion_on_hit`, counts towards copying the key back into memory, evicting others. This
reader opens the holder's offload directory instead (it runs on the holder's host) and asks the
master only through `/batch_query_keys`, so the cluster behaves as if no one had looked.

As with raw memory reads, the master is asked again after the read: a key it no longer knows
is VANISHED (-704); one whose disk replica it no longer lists at that size, or whose bucket left
the disk meanwhile, is MOVED. A holder writes a key into a bucket once (a key put again stays in
memory: `DiskCopies.unlisted_copy`), but a key put again on another holder of this host, whose new
bucket was written after the directories were indexed, is read from its old bucket unseen:
`confirm` indexes the directories afresh before a finding is reported.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Container, Iterable, Iterator, Sequence
from pathlib import Path

import xxhash

from audit.connection import AdminClient
from audit.errors import ERROR_NAMES, MOVED, NOT_PEEKABLE
from audit.readers.buckets import StoredValue, stored_key, tenant_and_key
from audit.readers.buffers import ALIGNMENT, MAX_KEYS_PER_BATCH, FetchedBatch, HostBuffer, Slot, plan_batches
from audit.readers.confirm import Confirmation, KeyRead, confirmation_of
from audit.readers.descriptors import Replica, query_answers, replicas_of
from audit.readers.mapped import PAGE, MappedWindow, window_bytes
from audit.readers.offload_index import DirectoryHolder, OffloadIndex, index_directories
from audit.readers.readahead import ReadAhead, window_bytes as read_ahead_window
from audit.readers.replicas import judge_disk_copy
from audit.records import KeyInfo, KeyRecord, Verdict

OBJECT_NOT_FOUND = -704
TRANSFER_FAIL = -800
DEFAULT_TENANT = "default"  # a bucket stores `tenant \0 key`; the admin API answers for this tenant only


def listed_on_disk(key: KeyInfo) -> bool:
    """Whether the listing shows `key` with a copy on a holder's SSD (`local_disk`)."""
    return any(replica.get("tier") == "local_disk" for replica in key.replicas)


def in_both_tiers(key: KeyInfo) -> bool:
    """Whether the listing shows `key` with a memory replica and a disk copy on a holder's SSD."""
    return {replica.get("tier") for replica in key.replicas} >= {"memory", "local_disk"}


def on_disk_only(key: KeyInfo) -> bool:
    """Whether the listing shows `key` on a holder's SSD only, under a name the master can be asked of."""
    tiers = {replica.get("tier", "memory") for replica in key.replicas}
    return tiers == {"local_disk"} and "," not in key.name


def _disk_endpoints(key: KeyInfo) -> list[str]:
    """The holders' offload RPC endpoints the listing shows the key's disk replicas at, in its order."""
    return list(dict.fromkeys(str(replica["endpoint"]) for replica in key.replicas
                              if replica.get("tier") == "local_disk" and replica.get("endpoint") is not None))


def _read_at(index: OffloadIndex, key: KeyInfo, copy: StoredValue) -> str | None:
    """The holder a copy read for `key` is named by: its directory's, where known, else the first the
    listing shows the key's disk replicas at."""
    return index.owner_of(copy) or next(iter(_disk_endpoints(key)), None)


OWNER_SAMPLE = 8  # keys asked of the master per directory to learn which holder's it is


def directory_owners(admin: AdminClient, index: OffloadIndex) -> dict[Path, DirectoryHolder]:
    """Each offload directory's holder: the one given with it (`HeldDirectory`), else as the master
    names it (the offload RPC endpoint it lists disk replicas at), asked lease-free
    (`/batch_query_keys`) of up to OWNER_SAMPLE default-tenant keys a directory alone holds, newest
    first; the endpoint most of them name, where more than half do. A key put again on another
    holder leaves a copy here that the master lists there, and the older a copy, the likelier that
    is: so the newest are asked. A split vote is in the holder's row (`DirectoryHolder`)."""
    asked = [directory for directory in index.directories if directory not in index.given]
    if not asked:
        return dict(index.given)
    sample: dict[str, Path] = {}
    taken: dict[Path, int] = {}
    prefix = stored_key(DEFAULT_TENANT, "")
    for stored, value in reversed(index.items()):  # the index holds its values oldest bucket first
        directory = index.directory_of(value)
        if not stored.startswith(prefix) or stored in index.superseded or directory in index.given \
                or taken.get(directory, 0) >= OWNER_SAMPLE:
            continue
        sample[tenant_and_key(stored)[1]] = directory
        taken[directory] = taken.get(directory, 0) + 1
        if len(taken) == len(asked) and min(taken.values()) >= OWNER_SAMPLE:
            break
    votes: dict[Path, Counter] = {}
    for name, answer in query_answers(admin, sample).items():
        for replica in (answer or {}).get("local_disk_values") or []:
            votes.setdefault(sample[name], Counter())[str(replica.get("transport_endpoint"))] += 1
    learnt = {directory: DirectoryHolder(endpoint, "learnt", count, taken[directory])
              for directory, counts in votes.items()
              for endpoint, count in counts.most_common(1) if 2 * count > taken[directory]}
    return {**learnt, **index.given}


def holder_of(admin: AdminClient, index: OffloadIndex, copy: StoredValue) -> str | None:
    """The holder of the directory `copy` lies in (`directory_owners`, learnt once an index is
    asked); None where not known."""
    if index.owners is None:
        index.owners = directory_owners(admin, index)
    return index.owner_of(copy)


def listed_copy(admin: AdminClient, index: OffloadIndex, key: bytes, endpoints: Sequence[str]) -> StoredValue | None:
    """The copy of `key` the master lists at one of `endpoints` (its disk replicas' holders): the
    one in the directory of one of those holders (`directory_owners`, learnt once an index meets a
    key listed on disk), else the newest in a directory whose holder is not known, else none here.
    A copy in the directory of another holder is never the listed one, even where it is the only
    copy here: the key was put again on a holder elsewhere (another host's, or one whose directory
    was not given), and that copy holds its first value. With no endpoint (listed in memory only),
    the newest."""
    copies = index.copies(key)
    if not copies or not endpoints:
        return copies[0] if copies else None
    owners = [holder_of(admin, index, copy) for copy in copies]
    owned = [copy for copy, owner in zip(copies, owners) if owner in endpoints]
    unknown = [copy for copy, owner in zip(copies, owners) if owner is None]
    return (owned or unknown or [None])[0]


def _disk_rows(record: KeyRecord) -> list[dict]:
    """The disk replica a record was read from, as it was listed: read again at the same holder's copy."""
    return [{"tier": "local_disk", "endpoint": row["endpoint"]} for row in record.evidence.get("replicas", [])
            if row.get("tier") == "local_disk" and row.get("endpoint")]


def _disk_sizes(answer: dict | None) -> set[int] | None:
    """The sizes of the disk replicas the master lists for a key; None when it no longer knows the key."""
    if answer is None or (not answer.get("ok") and answer.get("error") == "OBJECT_NOT_FOUND"):
        return None
    return {replica.get("object_size") for replica in answer.get("local_disk_values") or []}


class DiskReader:
    """Same interface as `audit.readers.PeekReader`, for the default tenant's disk-only keys whose
    holder's offload directory (`MOONCAKE_OFFLOAD_FILE_STORAGE_PATH`, either backend) is on this host.
    The values to read are asked of the device ahead of the batch being mapped (`read_ahead`,
    `audit.readers.readahead`), unless the reading is paced (`--max-bandwidth`)."""

    mode = "disk"

    def __init__(self, admin: AdminClient, directories: Iterable[Path], buffer_bytes: int, read_ahead: bool = True):
        self.admin = admin
        self.directories = list(directories)
        self.index = index_directories(self.directories)
        self.capacity = max(buffer_bytes // 2, ALIGNMENT)
        standing = window_bytes([self.capacity]) + MAX_KEYS_PER_BATCH * 2 * PAGE
        self.windows = [MappedWindow(standing), MappedWindow(standing)]  # address space only: no page touched
        self.read_ahead = read_ahead
        self._ahead: ReadAhead | None = None
        self._planned: dict[str, int] = {}  # key -> bytes of the read-ahead plan before its value

    def holds(self, key: KeyInfo) -> bool:
        """Whether `key` is disk-only and one of the directories stores it: this reader's to read."""
        return (self._stored(key) is not None
                and not any(replica.get("tier", "memory") == "memory" for replica in key.replicas))

    def split(self, keys: Sequence[KeyInfo]) -> tuple[list[KeyInfo], list[KeyInfo]]:
        """`keys` as (those this reader holds, the rest), each in its order."""
        held = [self.holds(key) for key in keys]
        return ([key for key, mine in zip(keys, held) if mine], [key for key, mine in zip(keys, held) if not mine])

    def _stored(self, key: KeyInfo) -> StoredValue | None:
        return listed_copy(self.admin, self.index, stored_key(DEFAULT_TENANT, key.name), _disk_endpoints(key))

    def order(self, keys: Sequence[KeyInfo]) -> list[KeyInfo]:
        """Keys by file and offset: a directory read front to back (keys not found first), their
        values asked of the device in that order from now on (`read_ahead`)."""
        stored = {key.name: self._stored(key) for key in keys}

        def place(key: KeyInfo) -> tuple[str, int]:
            value = stored[key.name]
            return ("", 0) if value is None else (str(value.path), value.offset)
        ordered = sorted(keys, key=place)
        if self.read_ahead:
            self._plan([(key.name, value) for key in ordered
                        if (value := stored[key.name]) is not None and value.size == key.size])
        return ordered

    def _plan(self, values: list[tuple[str, StoredValue]]) -> None:
        """The values (each a record: its stored key, then its bytes) asked for in this order."""
        if self._ahead is not None:
            self._ahead.close()
        self._planned, position = {}, 0
        for name, value in values:
            self._planned[name] = position
            position += len(value.head) + value.size
        self._ahead = ReadAhead([(value.path, value.offset, len(value.head) + value.size) for _, value in values],
                                read_ahead_window())

    def fetch(self, slots: list[Slot], turn: int) -> FetchedBatch:
        """The batch's values mapped from their files (`audit.readers.mapped`), each slot's offset
        moved to where its value lies in the window; the replica rows take the checks' digest."""
        needed = window_bytes([slot.key.size or 0 for slot in slots])
        if needed > self.windows[0].nbytes:  # larger than a standing window: one of its own
            window, one_off = MappedWindow(needed), True
        else:
            window, one_off = self.windows[turn % 2], False
        window.clear()
        if self._ahead is not None and slots and (position := self._planned.get(slots[0].key.name)) is not None:
            self._ahead.reached(position)
        files: dict[Path, tuple[int, int]] = {}
        try:
            attempts = [self._map_one(slot, window, files) for slot in slots]
        finally:
            for descriptor, _ in files.values():
                os.close(descriptor)
        for slot, (_, _, at) in zip(slots, attempts):
            slot.offset = at  # the caller's slots, moved: whoever holds them views the batch right
        reads = self._settled(slots, [(value, code, None) for value, code, _ in attempts])
        return FetchedBatch(slots, [read.code for read in reads], window, one_off,
                            replicas=[read.rows for read in reads])

    def _map_one(self, slot: Slot, window: MappedWindow,
                 files: dict[Path, tuple[int, int]]) -> tuple[StoredValue | None, int, int]:
        """The stored value mapped into the window: where it was, 0 or a negative code, where it
        lies in the window (0 when not read)."""
        value = self._stored(slot.key)
        if value is None or "," in slot.key.name:  # no file here holds it, or the master cannot be asked of it
            return None, NOT_PEEKABLE, 0
        if value.size != slot.key.size:
            return value, MOVED, 0  # the file holds another value once stored under that name
        try:
            if value.path not in files:
                descriptor = os.open(value.path, os.O_RDONLY)
                files[value.path] = descriptor, os.fstat(descriptor).st_size
            descriptor, file_size = files[value.path]
            if value.value_offset + value.size > file_size:  # shorter than indexed: never mapped past its end
                return value, TRANSFER_FAIL, 0
            if os.pread(descriptor, len(value.head), value.offset) != value.head:
                return value, TRANSFER_FAIL, 0
            return value, 0, window.place(descriptor, value.value_offset, value.size)
        except FileNotFoundError:
            return value, MOVED, 0  # the file left the disk (evicted) since it was indexed
        except OSError:
            return value, TRANSFER_FAIL, 0

    def confirm(self, records: Sequence[KeyRecord]) -> dict[str, Confirmation]:
        """Index the directories afresh, read the keys of `records` again, and say per key whether
        the second read saw the bytes the first one judged."""
        self.index = self.index.afresh()
        by_name = {record.key: record for record in records if record.xxh3 is not None}
        keys = [KeyInfo(name=record.key, size=record.size, replicas=_disk_rows(record)) for record in by_name.values()]
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
        return self._settled(slots, attempts)

    def _settled(self, slots: list[Slot], attempts: list[tuple[StoredValue | None, int, int | None]]) -> list[KeyRead]:
        """Each attempt judged against the master's answer now (asked once for the batch)."""
        after = query_answers(self.admin, (slot.key.name for slot in slots))
        return [self._settle(slot, *attempt, after.get(slot.key.name)) for slot, attempt in zip(slots, attempts)]

    def _read_one(self, slot: Slot, buffer: HostBuffer,
                  files: dict[Path, int]) -> tuple[StoredValue | None, int, int | None]:
        """The stored value read into the slot: where it was, 0 or a negative code, its XXH3-64."""
        value = self._stored(slot.key)
        if value is None or "," in slot.key.name:  # no file here holds it, or the master cannot be asked of it
            return None, NOT_PEEKABLE, None
        if value.size != slot.key.size:
            return value, MOVED, None  # the file holds another value once stored under that name
        into = buffer.array[slot.offset:slot.offset + value.size]
        head = bytearray(len(value.head))
        try:
            if value.path not in files:
                files[value.path] = os.open(value.path, os.O_RDONLY)
            read = os.preadv(files[value.path], [head, into], value.offset)
        except FileNotFoundError:
            return value, MOVED, None  # the file left the disk (evicted) since it was indexed
        except OSError:
            return value, TRANSFER_FAIL, None
        if read != len(head) + value.size or bytes(head) != value.head:
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
        row = {"tier": "local_disk", "endpoint": _read_at(self.index, slot.key, value), "address": None, "file": str(value.path),
               "offset": value.value_offset, "size": value.size, "xxh3": None, "status": "ok"}
        if code != 0:
            row.update(status="moved" if code == MOVED else "failed",
                       error={"code": code, "name": ERROR_NAMES.get(code, "UNKNOWN")})
            return KeyRead(code, [row])
        if digest is not None:  # a mapped value's row is given the checks' digest (`judge_replicas`)
            row["xxh3"] = f"{digest:016x}"
        return KeyRead(value.size, [row], digest)

    def close(self) -> None:
        """The read-ahead ended, the windows let their files go; files are opened per batch."""
        if self._ahead is not None:
            self._ahead.close()
            self._ahead = None
        for window in self.windows:
            window.clear()


UNLISTED_NAMED = 100  # unlisted values named one by one in a report; the rest are counted


class DiskCopies:
    """The SSD tier beside memory, from the offload directories on this host: the disk copy of every
    key also held in memory, read and compared with the bytes the key was judged by
    (REPLICA_DIVERGENT when they differ, `judge_disk_copy`), and the values on disk that no master
    lists (a key removed through Mooncake keeps its bucket, and a restarted holder registers it again).

    Buckets are written once, so a copy that agrees needs no second look; one that differs is read
    again from a fresh index (the key may have been removed and put again into a newer bucket) and
    stands only while the master still lists the key with its memory replicas as listed and a disk
    replica of that size."""

    def __init__(self, admin: AdminClient, directories: Iterable[Path]):
        self.admin = admin
        self.directories = list(directories)
        self.index = index_directories(self.directories)
        self.compared = self.divergent = self.elsewhere = 0
        self.latent: list[dict] = []  # `unlisted_copy`'s rows

    def compare(self, record: KeyRecord, key: KeyInfo) -> None:
        """Read `key`'s disk copy and judge it against `record` (the key as read from memory)."""
        if record.xxh3 is None:
            return
        value = self.listed(key)
        if value is None:
            self.elsewhere += 1  # its holder's directory is not among ours (another host)
            return
        self._judged(record, value, lambda: self.listed(key), lambda row: self._still_listed(key, row),
                     _read_at(self.index, key, value))

    def _judged(self, record: KeyRecord, value: StoredValue, located: Callable[[], StoredValue | None],
                still_listed: Callable[[dict], bool], endpoint: str | None) -> None:
        """The copy at `value` read and judged against `record` (`judge_disk_copy`), counted; one
        unlike the bytes read is read again from a fresh index (`located`) and stands only while
        `still_listed` says the key is held as it was read."""
        row = self._read(value)
        if row["status"] == "ok" and row["xxh3"] != f"{record.xxh3:016x}":
            self.index = self.index.afresh()
            value = located()
            row = self._read(value) if value is not None else None
            if row is None or not still_listed(row):
                return
        before = Verdict.REPLICA_DIVERGENT in record.verdicts
        judge_disk_copy(record, {**row, "endpoint": endpoint})
        self.compared += row["status"] == "ok"
        self.divergent += not before and Verdict.REPLICA_DIVERGENT in record.verdicts

    def unlisted_copy(self, record: KeyRecord) -> dict | None:
        """A copy on disk of a key the master lists with no disk replica (`record`: the key as read
        from memory). A holder offloads a key once: one removed and put again keeps its first value's
        copy, which the master no longer lists and a restart of the holder registers again, in place
        of the bytes in memory (measured, docs/read-modes.md). Named, with whether it holds the bytes
        read; not a finding: a producer that computed the value again may differ in its last bits."""
        value = self.stored(record.key)
        if value is None or record.xxh3 is None:
            return None
        if _disk_sizes(query_answers(self.admin, [record.key]).get(record.key)):
            return None  # listed on disk by now: offloaded while it was read
        return self._named(record, value, {})

    def tenant_copy(self, record: KeyRecord, tiers_of: Callable[[str], set[str] | None]) -> None:
        """An audited tenant's key, read through its tenant's client: the admin listing does not
        show it, so `tiers_of` (that client's replica descriptors) says which tiers hold it, asked
        only for a key whose copy the directories hold (it grants the lease the read already took).
        Held in memory and on disk: the copy compared as `compare` does (REPLICA_DIVERGENT when it
        differs, asked again after a fresh index before it stands); in memory only: the copy named
        in `latent`, with its tenant, as `unlisted_copy` does; on disk only: the bytes read were its."""
        value = self.stored(record.key, record.tenant) if record.tenant is not None else None
        if value is None or record.xxh3 is None:
            return
        tiers = tiers_of(record.key)
        if not tiers or "memory" not in tiers:
            return
        if "local_disk" not in tiers:
            self._named(record, value, {"tenant": record.tenant})
            return
        self._judged(record, value, lambda: self.stored(record.key, record.tenant),
                     lambda row: {"memory", "local_disk"} <= (tiers_of(record.key) or set()), None)

    def superseded_copies(self, record: KeyRecord, key: KeyInfo | None = None) -> list[dict]:
        """The copies on disk of `record`'s key beside its current one (the one the master lists,
        `key` as listed on disk; else the newest: the one read, compared or named above): a key
        removed and put again on another holder is offloaded there, while the first holder's bucket
        keeps its first value, which no master lists and which comes back if that holder restarts
        once the key has left the store (measured, docs/read-modes.md). Each named, with the current
        copy's place: its file and offset, or, where its holder's directory is not among these (the
        key put again on another host), the holder's endpoint; and whether it holds the bytes read."""
        if record.xxh3 is None:
            return []
        stored = stored_key(record.tenant or DEFAULT_TENANT, record.key)
        copies = self.index.copies(stored)
        if not copies or (len(copies) == 1 and key is None):
            return []
        current = self.listed(key) if key is not None else copies[0]
        if current is None:
            place = {"current_copy": {"endpoint": next(iter(_disk_endpoints(key)), None)}}
        else:
            place = {"current_copy": {"file": str(current.path), "offset": current.value_offset}}
        tenant = {"tenant": record.tenant} if record.tenant is not None else {}
        return [row for value in copies if value != current and (row := self._named(record, value, {**tenant, **place}))]

    def listed(self, key: KeyInfo) -> StoredValue | None:
        """The copy of the default-tenant `key` the master lists on disk (`listed_copy`)."""
        return listed_copy(self.admin, self.index, stored_key(DEFAULT_TENANT, key.name), _disk_endpoints(key))

    def _named(self, record: KeyRecord, value: StoredValue, extra: dict) -> dict | None:
        row = self._read(value)
        if row["status"] != "ok":
            return None
        self.latent.append({"key": record.key, "file": row["file"], "offset": row["offset"], "size": row["size"],
                            "xxh3": row["xxh3"], "memory_xxh3": f"{record.xxh3:016x}", **extra})
        return self.latent[-1]

    def stored(self, name: str, tenant: str = DEFAULT_TENANT) -> StoredValue | None:
        """Where the directories, as last indexed, hold the key `name`'s value (the default tenant's)."""
        return self.index.get(stored_key(tenant, name))

    def values(self, superseded: bool = False) -> Iterator[tuple[str, str, StoredValue]]:
        """(tenant, key, value) of every key's newest value in the directories, as last indexed
        (`superseded`: and of each older copy of it)."""
        for stored, value in self.index.items():
            tenant, name = tenant_and_key(stored)
            yield tenant, name, value
            for older in self.index.superseded.get(stored, []) if superseded else []:
                yield tenant, name, older

    def _read(self, value: StoredValue) -> dict:
        row = {"tier": "local_disk", "file": str(value.path), "offset": value.value_offset, "size": value.size,
               "xxh3": None, "status": "ok"}
        try:
            with open(value.path, "rb") as stored:
                record = os.pread(stored.fileno(), len(value.head) + value.size, value.offset)
        except FileNotFoundError:  # the file left the disk (evicted) since it was indexed
            return {**row, "status": "moved", "error": {"code": MOVED, "name": ERROR_NAMES.get(MOVED, "MOVED")}}
        except OSError as error:
            return {**row, "status": "failed", "error": {"code": TRANSFER_FAIL, "name": "TRANSFER_FAIL",
                                                         "message": error.strerror}}
        if len(record) != len(value.head) + value.size or not record.startswith(value.head):
            return {**row, "status": "failed", "error": {"code": TRANSFER_FAIL, "name": "TRANSFER_FAIL",
                                                         "message": "the file does not hold the key's record there"}}
        return {**row, "xxh3": f"{xxhash.xxh3_64_intdigest(memoryview(record)[len(value.head):]):016x}"}

    def _still_listed(self, key: KeyInfo, row: dict) -> bool:
        """Whether the master lists the key now as it did when its memory copy was read."""
        answer = query_answers(self.admin, [key.name]).get(key.name)
        listed = [Replica(str(r["endpoint"]), int(r["address"]), int(r["size"]))
                  for r in key.replicas if r.get("tier") == "memory"]
        return (answer is not None and answer.get("ok") and replicas_of(answer) == listed
                and row["size"] in (_disk_sizes(answer) or set()))

    def unlisted(self, listed: Container[str], key_filter: Callable[[str], bool],
                 tenant_holds: Callable[[str, str], bool | None] = lambda tenant, name: None) -> dict:
        """The values of `key_filter`'s keys in the directories that the listing did not show and
        the master does not know (asked again). The admin API answers for the default tenant only,
        and another tenant's client grants a lease on every key it is asked about, even whether it
        exists: another tenant's value is named (with its tenant) where the run's own look-ups found
        that tenant does not hold its key (`tenant_holds` False), passed over where they found it
        does (True), and counted where the run did not look (None)."""
        self.index = self.index.afresh()
        candidates: dict[str, list[StoredValue]] = {}
        gone: list[tuple[str | None, str, StoredValue]] = []
        other_tenants = 0
        for tenant, name, value in self.values(superseded=True):
            if tenant == DEFAULT_TENANT:
                if name not in listed and key_filter(name):
                    candidates.setdefault(name, []).append(value)
            elif (holds := tenant_holds(tenant, name)) is None or not key_filter(name):
                other_tenants += 1
            elif not holds:
                gone.append((tenant, name, value))
        answers = query_answers(self.admin, candidates)
        gone += [(None, name, value) for name, values in candidates.items()
                 if _disk_sizes(answers.get(name, {"error": "OBJECT_NOT_FOUND"})) is None for value in values]
        gone.sort(key=lambda found: (found[0] or "", found[1], str(found[2].path), found[2].offset))
        return {"values": len(gone), "other_tenants_values": other_tenants,
                "named": [{"key": name, **({"tenant": tenant} if tenant else {}), "file": str(value.path),
                           "offset": value.value_offset, "size": value.size}
                          for tenant, name, value in gone[:UNLISTED_NAMED]]}

    def summary(self, unlisted: dict | None) -> dict:
        latent = {"copies": len(self.latent),
                  "unlike_memory": sum(row["xxh3"] != row["memory_xxh3"] for row in self.latent),
                  "superseded": sum("current_copy" in row for row in self.latent),
                  "named": sorted(self.latent, key=lambda row: (row["xxh3"] == row["memory_xxh3"], row["key"]))[:UNLISTED_NAMED]}
        owners = self.index.owners if self.index.owners is not None else self.index.given
        holders = {str(directory): {"endpoint": holder.endpoint, "known": holder.known,
                                    **({"naming": holder.naming, "asked": holder.asked} if holder.known == "learnt" else {})}
                   for directory, holder in owners.items()}
        return {"directories": [str(directory) for directory in self.directories], "holders": holders,
                "disk_copies_compared": self.compared, "disk_copies_divergent": self.divergent,
                "disk_copies_elsewhere": self.elsewhere, "latent": latent,
                **({"unlisted": unlisted} if unlisted is not None else {})}
