"""`watch` on a tiered store: the disk copy of a key held in memory and on its holder's SSD compared
with its memory copy, as `check` compares it (`audit.readers.disk.DiskCopies`): REPLICA_DIVERGENT
when they differ, whichever is right, reported once like every watch finding.

A key listed with no disk copy whose copy a directory still holds (the bucket backend offloads a
key once: a key removed and put again keeps its first value's copy, which a restart of the holder
registers in place of memory's) is read again when it becomes such a key, or its copy or memory
replicas change, and its copy named (`latent`): a line in the log when it is unlike the bytes in
memory, and two gauges. Not a finding, as in `check` (docs/read-modes.md). So is a key's copy beside
its current one (the key put again on another holder of this host): read again when such a copy
appears, named once.

A watcher runs forever, so the copies are not compared every round. A both-tier key's disk copy is
read and compared whenever the key itself is read (new, re-verified once a period, named by a
record), and a key whose copies changed since they were last compared is read again at once. To
tell, each round indexes the offload directories afresh (their `.meta` files, as the disk-only
reader does) and stats each file holding a both-tier key once: a key's copies changed when its
memory replicas (as listed), its disk record (file, offset, size) or that file's mtime differ from
those at its last comparison. A round so costs one index and a stat per file, plus the reads of
the keys that changed. A watcher that starts takes the copies of the keys its state verified
before as they are, unread: a change made while no watcher ran is found at the key's next re-read.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

from audit.connection import AdminClient
from audit.readers.buckets import stored_key, tenant_and_key
from audit.readers.disk import DEFAULT_TENANT, DiskCopies, in_both_tiers, listed_on_disk
from audit.records import KeyInfo, KeyRecord
from audit.run.watch_state import WatchState
from audit.sources.keytable import KeyTable


class DiskCopyWatch:
    """Which both-tier keys a round reads again because their copies changed, and the comparison
    of the copies of those a round read."""

    def __init__(self, admin: AdminClient, directories: Iterable[Path]):
        self.admin = admin
        self.directories = tuple(directories)
        self.copies: DiskCopies | None = None  # the directories as this round indexed them
        self._compared: dict[str, tuple] = {}  # name: its copies' fingerprint when they were last compared
        self._listed_before = False            # whether a round's listing came here before
        self.latent: dict[str, dict] = {}      # name: its copy no master lists (`DiskCopies.unlisted_copy`'s row)
        self._looked: dict[str, tuple] = {}    # name: its fingerprint when a copy no master lists was last looked at
        self.older: dict[str, list[dict]] = {}  # name: its copies beside its current one (`DiskCopies.superseded_copies`' rows)
        self._older_looked: dict[str, tuple] = {}  # name: the places of those copies when they were last read

    def changed(self, table: KeyTable, rows_by_name: Mapping[str, int], state: WatchState) -> set[str]:
        """The directories indexed afresh; the both-tier keys of the listing whose copies changed
        since they were last compared (at a watcher's first round: those its state never verified),
        and the keys listed with no disk copy whose copy a directory holds, new or changed."""
        self.copies = DiskCopies(self.admin, self.directories)
        mtimes: dict[Path, int | None] = {}
        on_disk = [key for key in table.unusual()[1] if listed_on_disk(key)]
        now = {key.name: self._fingerprint(key, mtimes) for key in on_disk if in_both_tiers(key)}
        now = {name: copies for name, copies in now.items() if copies is not None}
        if not self._listed_before:
            self._compared.update({record.key: now[record.key] for record in state.stored(now)})
            self._listed_before = True
        self._compared = {name: copies for name, copies in self._compared.items() if name in now}
        disk_listed = {key.name for key in on_disk}
        unlisted_copies = {name: self._fingerprint(table.info(rows_by_name[name]), mtimes)
                           for tenant, name, _ in self.copies.values()
                           if tenant == DEFAULT_TENANT and name in rows_by_name and name not in disk_listed}
        self._looked = {name: copies for name, copies in self._looked.items() if name in unlisted_copies}
        self.latent = {name: row for name, row in self.latent.items() if name in unlisted_copies}
        older = {name: self._older_places(name) for tenant, name in map(tenant_and_key, self.copies.index.superseded)
                 if tenant == DEFAULT_TENANT and name in rows_by_name}
        self._older_looked = {name: places for name, places in self._older_looked.items() if older.get(name) == places}
        self.older = {name: rows for name, rows in self.older.items() if name in self._older_looked}
        return ({name for name, copies in now.items() if self._compared.get(name) != copies}
                | {name for name, copies in unlisted_copies.items() if self._looked.get(name) != copies}
                | {name for name in older if name not in self._older_looked})

    def compare(self, records: Iterable[KeyRecord], keys: dict[str, KeyInfo]) -> list[dict]:
        """The disk copies of the both-tier keys among `records` (read from memory this round),
        judged against the bytes read; and the copies of the keys listed with none, named. The
        copies named now that are unlike the bytes in memory and were not so before."""
        named = []
        for record in records:
            key = keys.get(record.key)
            if key is None or record.xxh3 is None:
                continue
            if self.copies is None:  # a record round before the first listing
                self.copies = DiskCopies(self.admin, self.directories)
            before = {(row["xxh3"], row["file"], row["offset"]) for row in self.older.pop(record.key, [])}
            if rows := self.copies.superseded_copies(record, key if listed_on_disk(key) else None):
                self.older[record.key] = rows
                named += [row for row in rows if row["xxh3"] != row["memory_xxh3"]
                          and (row["xxh3"], row["file"], row["offset"]) not in before]
            if places := self._older_places(record.key):  # (looked at, whether or not a copy could be read)
                self._older_looked[record.key] = places
            if in_both_tiers(key):
                self.copies.compare(record, key)
                if (copies := self._fingerprint(key, {})) is not None:
                    self._compared[record.key] = copies
            elif not listed_on_disk(key) and (copies := self._fingerprint(key, {})) is not None:
                self._looked[record.key] = copies
                before, row = self.latent.pop(record.key, None), self.copies.unlisted_copy(record)
                if row is not None:
                    self.latent[record.key] = row
                    digests = row["xxh3"], row["memory_xxh3"]
                    if digests[0] != digests[1] and (before is None or (before["xxh3"], before["memory_xxh3"]) != digests):
                        named.append(row)
        return named

    def rows(self) -> list[dict]:
        """Every copy named now: those no master lists for their key, and those beside their key's current copy."""
        return [*self.latent.values(), *(row for rows in self.older.values() for row in rows)]

    def _older_places(self, name: str) -> tuple:
        return tuple((str(value.path), value.value_offset)
                     for value in self.copies.index.superseded.get(stored_key(DEFAULT_TENANT, name), []))

    def _fingerprint(self, key: KeyInfo, mtimes: dict[Path, int | None]) -> tuple | None:
        """What changes when either copy does; None when no directory here holds the disk copy."""
        value = self.copies.listed(key)
        if value is None:
            return None
        if value.path not in mtimes:
            try:
                mtimes[value.path] = value.path.stat().st_mtime_ns
            except FileNotFoundError:  # evicted from the disk since the index
                mtimes[value.path] = None
        memory = tuple((replica.get("endpoint"), replica.get("address"), replica.get("size"))
                       for replica in key.replicas if replica.get("tier", "memory") == "memory")
        return memory, str(value.path), value.value_offset, value.size, mtimes[value.path]
