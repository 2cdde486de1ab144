"""Every record of a run, held so that memory follows the findings, not the store.

A record with a verdict, evidence or an error is kept whole. A plain one (read, no verdict: nearly
every key of a healthy store) is kept as a row of fixed-width columns, its key's row in a KeyTable,
its digest, layout and tenant, about 36 B, and its full form (per-region results, parsed fields)
goes to a spool file on disk when it has more than the columns hold. Cross-key verdicts
(`audit.judge.merge`) promote the few plain records they name back to whole ones; iterating the
ledger gives every record, in the order added, as a report's `keys` needs them.
"""

from __future__ import annotations

import pickle
import tempfile
from array import array
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np

from audit.records import KeyInfo, KeyRecord, Verdict
from audit.sources.keytable import KeyTable, name_digest


@dataclass
class Tally:
    """What a report's summary counts, over every record."""

    verdicts: Counter = field(default_factory=Counter)
    severities: Counter = field(default_factory=Counter)
    findings: int = 0
    unread: int = 0
    unjudged: int = 0
    vanished: int = 0
    read: int = 0
    bytes_scanned: int = 0
    read_by_tenant: Counter = field(default_factory=Counter)

    def count(self, record: KeyRecord) -> None:
        self.verdicts.update(record.verdicts)
        if record.is_finding:
            self.findings += 1
        if (severity := record.severity) is not None:
            self.severities[str(severity)] += 1
        self.unread += record.is_incomplete
        self.unjudged += record.is_unjudged
        self.vanished += Verdict.VANISHED in record.verdicts
        if record.xxh3 is not None:
            self.read += 1
            self.bytes_scanned += record.size or 0
            self.read_by_tenant[record.tenant] += 1


_READ_FINE_ROW = frozenset(("endpoint", "address", "size", "xxh3", "status"))  # a replica row with no error


def _plain(record: KeyRecord) -> bool:
    return (not record.verdicts and record.error is None and record.xxh3 is not None
            and (not record.evidence or record.evidence.keys() == {"replicas"}))


def _columns_hold(record: KeyRecord) -> bool:
    """Whether the columns give the record back as it was (else its full form is spooled)."""
    return record.regions is None and record.fields is None and record.zero is False


class RecordLedger:
    """Records in the order added; `table`: the listing's KeyTable, whose rows records' `ordinal`s
    name. A record without one (another tenant's key, a named one) is numbered in a table of the
    ledger's own, with a negative ordinal, so it never passes for a listed key. Without a table, the
    ledger numbers every record in a table of its own."""

    def __init__(self, table: KeyTable | None = None, *, compact: bool = True):
        self.own_table = table is None
        self.compact = compact  # False: every record kept whole (records the caller holds anyway)
        self.table = KeyTable() if table is None else table
        self._others = KeyTable()       # keys of records without a listed row: ordinal -1 - row
        self._kept: list[KeyRecord] = []
        self._order = array("q")        # per record: >= 0 a plain row, < 0 -1 - its index in _kept
        self._ordinal = array("q")      # plain row -> its key's table row
        self._xxh3 = array("Q")
        self._layout = array("H")
        self._tenant = array("H")
        self._spooled = array("q")      # plain row -> offset of its full form in the spool; -1: none
        self._peeked = bytearray()      # plain row -> 1: its one replica read fine where the listing had it
        self._layouts: list[str | None] = [None]
        self._tenants: list[str | None] = [None]
        self._ids: dict[tuple, int] = {}
        self._spool = None

    @classmethod
    def of(cls, records: Iterable[KeyRecord]) -> RecordLedger:
        """Records the caller already holds: kept whole, so the verdicts merging sets are set on
        the caller's own objects."""
        ledger = cls(compact=False)
        for record in records:
            ledger.add(record)
        return ledger

    def _id(self, values: list, value) -> int:
        key = (id(values), value)
        if (found := self._ids.get(key)) is None:
            found = self._ids[key] = len(values)
            values.append(value)
        return found

    def add(self, record: KeyRecord) -> None:
        if self.own_table:
            record.ordinal = self.table.append(KeyInfo(name=record.key, size=record.size))
        elif record.ordinal is None:
            record.ordinal = -1 - self._others.append(KeyInfo(name=record.key, size=record.size))
        peeked = bool(record.evidence) and self._as_listed(record)
        if not self.compact or not _plain(record) or (record.evidence and not peeked):
            self._order.append(-1 - len(self._kept))
            self._kept.append(record)
            return
        self._order.append(len(self._ordinal))
        self._ordinal.append(record.ordinal)
        self._xxh3.append(record.xxh3)
        self._layout.append(0 if record.layout is None else self._id(self._layouts, record.layout))
        self._tenant.append(0 if record.tenant is None else self._id(self._tenants, record.tenant))
        self._spooled.append(-1 if _columns_hold(record) else self._spool_record(record))
        self._peeked.append(peeked)

    def _as_listed(self, record: KeyRecord) -> bool:
        """Whether the record's replica evidence (a peek read's) is one replica, read fine, at the
        place the listing had it: the columns give it back."""
        rows = record.evidence.get("replicas")
        if record.ordinal is None or record.ordinal < 0 or not isinstance(rows, list) or len(rows) != 1:
            return False
        row = rows[0]
        listed = self.table.listed_replica(record.ordinal)
        return (listed is not None and row.keys() == _READ_FINE_ROW
                and row["status"] == "ok" and record.xxh3 is not None and row["xxh3"] == f"{record.xxh3:016x}"
                and listed == (row["endpoint"], row["address"], row["size"]))

    def _spool_record(self, record: KeyRecord) -> int:
        if self._spool is None:
            self._spool = tempfile.TemporaryFile(prefix="mooncake-audit-records-")
        self._spool.seek(0, 2)
        offset = self._spool.tell()
        pickle.dump(record, self._spool, protocol=pickle.HIGHEST_PROTOCOL)
        return offset

    def _plain_record(self, row: int) -> KeyRecord:
        offset = self._spooled[row]
        if offset >= 0:
            self._spool.seek(offset)
            return pickle.load(self._spool)
        ordinal = self._ordinal[row]
        table, at = (self.table, ordinal) if ordinal >= 0 else (self._others, -1 - ordinal)
        record = KeyRecord(key=table.name(at), size=table.size(at), fields=None,
                           xxh3=self._xxh3[row], zero=False, layout=self._layouts[self._layout[row]],
                           tenant=self._tenants[self._tenant[row]], ordinal=ordinal)
        if self._peeked[row]:
            endpoint, address, size = table.listed_replica(at)
            record.evidence["replicas"] = [{"endpoint": endpoint, "address": address, "size": size,
                                            "xxh3": f"{record.xxh3:016x}", "status": "ok"}]
        return record

    def __len__(self) -> int:
        return len(self._order)

    def __iter__(self) -> Iterator[KeyRecord]:
        for slot in self._order:
            yield self._kept[-1 - slot] if slot < 0 else self._plain_record(slot)

    def __getitem__(self, index: int) -> KeyRecord:
        slot = self._order[index]
        return self._kept[-1 - slot] if slot < 0 else self._plain_record(slot)

    def name_hashes(self) -> np.ndarray:
        """XXH3-64 of every record's key name (`name_digest`), in order, without
        making the records: a listed key's from the listing's bytes (`KeyTable.name_hashes`)."""
        order = np.frombuffer(self._order, dtype=np.int64)
        hashes = np.empty(len(order), dtype=np.uint64)
        plain = order >= 0
        ordinals = np.frombuffer(self._ordinal, dtype=np.int64)[order[plain]]
        listed = ordinals >= 0
        found = np.empty(len(ordinals), dtype=np.uint64)
        found[listed] = self.table.name_hashes(ordinals[listed])
        found[~listed] = self._others.name_hashes(-1 - ordinals[~listed])
        hashes[plain] = found
        hashes[~plain] = [name_digest(self._kept[-1 - slot].key) for slot in order[~plain].tolist()]
        return hashes

    def _name(self, ordinal: int) -> str:
        return self.table.name(ordinal) if ordinal >= 0 else self._others.name(-1 - ordinal)

    def _sizes(self, ordinals: np.ndarray) -> np.ndarray:
        """The sizes of the keys at these ordinals (-1: unknown)."""
        sizes = np.full(len(ordinals), -1, dtype=np.int64)
        listed = ordinals >= 0
        if listed.any():
            sizes[listed] = np.frombuffer(self.table.size_column(), dtype=np.int64)[ordinals[listed]]
        if (~listed).any():
            sizes[~listed] = np.frombuffer(self._others.size_column(), dtype=np.int64)[-1 - ordinals[~listed]]
        return sizes

    def sort_from(self, first: int) -> None:
        """Records added from position `first` on, put in their keys' table order (records arriving
        out of order, from Ray tasks or a peek reader's holder order, as a scan in listing order
        adds them); records without an ordinal last, in the order added."""
        tail = np.frombuffer(self._order, dtype=np.int64)[first:]
        if not len(tail):
            return
        ordinals = np.full(len(tail), np.iinfo(np.int64).max, dtype=np.int64)
        plain = tail >= 0
        ordinals[plain] = np.frombuffer(self._ordinal, dtype=np.int64)[tail[plain]]
        for i in np.flatnonzero(~plain):
            if (ordinal := self._kept[-1 - int(tail[i])].ordinal) is not None:
                ordinals[i] = ordinal
        self._order[first:] = array("q", tail[np.argsort(ordinals, kind="stable")].tobytes())

    def kept(self) -> list[KeyRecord]:
        """The records held whole: every one with a verdict, evidence or error."""
        return self._kept

    def findings(self) -> list[KeyRecord]:
        return [self._kept[-1 - slot] for slot in self._order if slot < 0 and self._kept[-1 - slot].is_finding]

    def promote(self, positions: Iterable[int]) -> list[KeyRecord]:
        """The records at these positions (in the order added), held whole from now on, so that
        verdicts set on them stay."""
        promoted = []
        for position in positions:
            slot = self._order[position]
            if slot >= 0:
                self._kept.append(self._plain_record(slot))
                self._order[position] = slot = -1 - (len(self._kept) - 1)
            promoted.append(self._kept[-1 - slot])
        return promoted

    # what the cross-key judges ask --------------------------------------------------------------

    def digest_groups(self) -> list[KeyRecord]:
        """The records (promoted) that share their size and digest with another record: the
        candidates for SHARED_CONTENT and EXPECTED_DUPLICATE, in the order added. Zero values and
        empty ones share nothing. Plain rows are screened by digest alone, on one sorted copy of
        the digest column (8 B a record), before any record is made."""
        kept = {}
        for position, slot in enumerate(self._order):
            if slot < 0:
                record = self._kept[-1 - slot]
                if record.xxh3 is not None and record.size and not record.zero:
                    kept[position] = record.xxh3
        digests = np.frombuffer(self._xxh3, dtype=np.uint64) if len(self._xxh3) else np.zeros(0, dtype=np.uint64)
        every = np.sort(np.concatenate([digests, np.fromiter(kept.values(), dtype=np.uint64, count=len(kept))]))
        repeated = np.unique(every[1:][every[1:] == every[:-1]])
        del every
        if not len(repeated):
            return []
        rows = np.flatnonzero(np.isin(digests, repeated))
        order = np.frombuffer(self._order, dtype=np.int64)
        positions = set(np.flatnonzero(np.isin(order, rows) & (order >= 0)).tolist())
        del order
        positions.update(position for position, digest in kept.items() if np.isin(digest, repeated))
        candidates = [record for record in self.promote(sorted(positions)) if record.size]
        same = Counter((record.size, record.xxh3) for record in candidates)
        return [record for record in candidates if same[(record.size, record.xxh3)] > 1]

    def at_ordinals(self, ordinals: Iterable[int]) -> list[KeyRecord]:
        """The records (promoted) of the keys at these table rows."""
        wanted = np.array(sorted(set(ordinals)), dtype=np.int64)
        if not len(wanted):
            return []
        wanted_set = set(wanted.tolist())
        positions = [position for position, slot in enumerate(self._order)
                     if slot < 0 and self._kept[-1 - slot].ordinal in wanted_set]
        order = np.frombuffer(self._order, dtype=np.int64)
        plain_positions = np.flatnonzero(order >= 0)
        if len(plain_positions):
            plain_ordinals = np.frombuffer(self._ordinal, dtype=np.int64)[order[plain_positions]]
            positions += [int(p) for p in plain_positions[np.isin(plain_ordinals, wanted)]]
        return self.promote(sorted(positions))

    def with_names(self, names: set[str]) -> list[KeyRecord]:
        """The records (promoted) of the keys with these names (each plain row's name is read
        back from the table: for the few keys a verdict names)."""
        if not names:
            return []
        positions = []
        for position, slot in enumerate(self._order):
            name = self._kept[-1 - slot].key if slot < 0 else self._name(self._ordinal[slot])
            if name in names:
                positions.append(position)
        return self.promote(positions)

    def tally(self) -> Tally:
        tally = Tally()
        for record in self._kept:
            tally.count(record)
        order = np.frombuffer(self._order, dtype=np.int64)
        rows = order[order >= 0]  # plain rows not promoted since
        if len(rows):
            ordinals = np.frombuffer(self._ordinal, dtype=np.int64)[rows]
            tally.read += len(rows)
            tally.bytes_scanned += int(self._sizes(ordinals).clip(0).sum())
            tenants = np.bincount(np.frombuffer(self._tenant, dtype=np.uint16)[rows], minlength=len(self._tenants))
            for tenant_id, count in enumerate(tenants):
                if count:
                    tally.read_by_tenant[self._tenants[tenant_id]] += int(count)
        return tally
