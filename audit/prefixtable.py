"""A store's worth of prefix records, as `scan`, `check` and `watch` read them (`--block-tables DIR`):
every record of a hex chunk hash in sorted arrays, looked up a batch of keys at a time.

A million keys' records held in a dict cost 157 bytes a hash and a dict lookup a key whose memory
misses the caches (the table is the store's size, the listing's order is not the records'); here a
32-byte hash costs 44 bytes (the hash, its digest, its window) and a batch's lookups are one
`searchsorted`. Records that no table holds (a text hash, a digest not of 16 hex digits) stay in a
`PrefixRecords`, and every answer is the one a `PrefixRecords` of the same lines would give:
duplicates kept once, a hash recorded with two digests in `conflicts` and claimed by neither.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from audit.prefixrecords import (
    CONV,
    KV,
    PrefixDigest,
    PrefixRecords,
    hash_key,
    parse_prefix_record,
    prefix_record_paths,
    recorder_line,
    unpacked,
)
from audit.recordfiles import numbered_lines, parsed_lines


@dataclass(frozen=True)
class HashTable:
    """One region's records of hex hashes of one length, sorted by hash, each hash once."""

    hashes: np.ndarray   # (n,) S{length}: compared and searched over the whole width
    digests: np.ndarray  # (n,) uint64
    windows: np.ndarray  # (n,) uint32

    def rows(self, queries: np.ndarray) -> np.ndarray:
        """Each query hash's row, or -1."""
        if not len(self.hashes):
            return np.full(len(queries), -1)
        at = np.minimum(np.searchsorted(self.hashes, queries), len(self.hashes) - 1)
        return np.where(self.hashes[at] == queries, at, -1)


class _Collected:
    """One region's records of hex hashes of one length, as read: appended, then sealed into arrays a
    part at a time (a part's Python buffers are a few MiB at most), and sorted at the end (`table`)."""

    PART = 1 << 16  # records a part

    def __init__(self, length: int):
        self.length = length
        self.parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self._start()

    def _start(self) -> None:
        self.hashes, self.digests, self.windows = bytearray(), array("Q"), array("I")

    def add(self, hashed: bytes, packed: int) -> None:
        self.hashes += hashed
        self.digests.append(packed >> 32)
        self.windows.append(packed & 0xFFFFFFFF)
        if len(self.digests) == self.PART:
            self._seal()

    def _seal(self) -> None:
        self.parts.append((np.frombuffer(self.hashes, f"S{self.length}"), np.frombuffer(self.digests, np.uint64),
                           np.frombuffer(self.windows, f"u{self.windows.itemsize}")))
        self._start()

    def table(self) -> tuple[HashTable, set[bytes]]:
        """The records sorted, each hash once; and the hashes recorded with two digests (still in it)."""
        self._seal()
        parts, self.parts = self.parts, []
        hashes, digests, windows = (np.concatenate(column) for column in zip(*parts))
        del parts
        order = np.argsort(hashes, kind="stable")
        hashes = hashes[order]  # (a column at a time: the peak is the columns and one sorted copy)
        digests = digests[order]
        windows = windows[order]
        del order
        repeated = hashes[1:] == hashes[:-1]
        if not repeated.any():
            return HashTable(hashes, digests, windows), set()
        differs = repeated & ((digests[1:] != digests[:-1]) | (windows[1:] != windows[:-1]))
        conflicting = {row.tobytes() for row in _as_bytes(hashes[1:][differs])}
        first = np.concatenate(([True], ~repeated))
        return HashTable(hashes[first], digests[first], windows[first]), conflicting


def _as_bytes(hashes: np.ndarray) -> np.ndarray:
    """(n, length) uint8 of S{length} hashes (an item of S drops its trailing zero bytes; these keep them)."""
    return hashes.view(np.uint8).reshape(len(hashes), hashes.dtype.itemsize)


class PrefixTable:
    """The records of `read_prefix_records`: `HashTable`s by (region, hash length), and a
    `PrefixRecords` of the rest; `PrefixRecords`' reading interface (`get`, `packed`, `packed_many`,
    `conflicts`, `records`, `skipped`, `len`)."""

    def __init__(self, collected: dict[tuple[str, int], _Collected], rest: PrefixRecords):
        for region, table in ((CONV, rest.digests), (KV, rest.blocks)):  # a JSON line's: every packed one in a table
            for key in [key for key, value in table.items() if isinstance(key, bytes) and isinstance(value, int)]:
                collected.setdefault((region, len(key)), _Collected(len(key))).add(key, table.pop(key))
        tables = {}
        conflicting = {key for key in map(hash_key, rest.conflicts) if isinstance(key, bytes)}
        for ident, records in collected.items():
            tables[ident], found = records.table()
            conflicting |= found
        for region, table in ((CONV, rest.digests), (KV, rest.blocks)):  # a record no table holds, of a hash one does
            for key in [key for key in table if isinstance(key, bytes) and (region, len(key)) in tables]:
                if tables[region, len(key)].rows(np.frombuffer(key, f"S{len(key)}"))[0] >= 0:
                    conflicting.add(key)
        for key in conflicting:
            rest.digests.pop(key, None)
            rest.blocks.pop(key, None)
            rest.conflicts.add(key.hex())
        if conflicting:
            tables = {ident: _without(table, conflicting, ident[1]) for ident, table in tables.items()}
        self.tables, self.rest = tables, rest
        self._hashes = _distinct(tables, rest)

    @property
    def conflicts(self) -> set[str]:
        return self.rest.conflicts

    @property
    def records(self) -> int:
        return self.rest.records

    @property
    def skipped(self) -> int:
        return self.rest.skipped

    def __len__(self) -> int:
        return self._hashes

    def get(self, chunk_hash: str, region: str = CONV) -> PrefixDigest | None:
        return unpacked(self.packed(chunk_hash, region))

    def packed(self, chunk_hash: str, region: str = CONV) -> int | PrefixDigest | None:
        key = hash_key(chunk_hash)
        return self.packed_many([key], region)[0] if isinstance(key, bytes) else self.rest.packed(chunk_hash, region)

    def packed_many(self, keys: list[bytes | None], region: str = CONV) -> list:
        """`packed` of each hex hash given as its bytes (None: no record)."""
        found = self.rest.packed_many(keys, region)
        for (its_region, length), table in self.tables.items():
            if its_region != region:
                continue
            chosen = [j for j, key in enumerate(keys) if key is not None and len(key) == length]
            if not chosen or not len(table.hashes):
                continue
            rows = table.rows(np.frombuffer(b"".join([keys[j] for j in chosen]), f"S{length}"))
            for j, row, digest, window in zip(chosen, rows.tolist(), table.digests[rows].tolist(),
                                              table.windows[rows].tolist()):
                if row >= 0:
                    found[j] = digest << 32 | window
        return found


def _without(table: HashTable, hashes: set[bytes], length: int) -> HashTable:
    dropped = np.isin(table.hashes, np.frombuffer(b"".join(h for h in hashes if len(h) == length) or b"", f"S{length}"))
    return HashTable(table.hashes[~dropped], table.digests[~dropped], table.windows[~dropped])


def _distinct(tables: dict[tuple[str, int], HashTable], rest: PrefixRecords) -> int:
    """How many hashes have a record of either region."""
    by_length: dict[int, np.ndarray] = {}
    for (_, length), table in tables.items():
        by_length[length] = np.union1d(by_length.get(length, table.hashes[:0]), table.hashes)
    others = rest.digests.keys() | rest.blocks.keys()
    held = sum(1 for key in others if isinstance(key, bytes) and len(key) in by_length
               and np.isin(np.frombuffer(key, f"S{len(key)}"), by_length[len(key)])[0])
    return sum(map(len, by_length.values())) + len(others) - held


def read_prefix_records(paths: Iterable[Path]) -> PrefixTable:
    """Every prefix record under `paths`; a malformed line is counted and passed over, never fatal.
    The recorder's own lines (`recorder_line`) go straight into the tables."""
    rest = PrefixRecords()
    collected: dict[tuple[str, int], _Collected] = {}

    def skipped() -> None:
        rest.skipped += 1

    for path in prefix_record_paths(paths):
        others: list[tuple[int, str]] = []
        for number, line in numbered_lines(path, "prefix record"):
            if (found := recorder_line(line)) is None:
                others.append((number, line))
                continue
            hashed, _, conv, block = found
            rest.records += 1
            for region, packed in ((CONV, conv), (KV, block)):
                if packed is not None:
                    if (its := collected.get((region, len(hashed)))) is None:
                        its = collected[region, len(hashed)] = _Collected(len(hashed))
                    its.add(hashed, packed)
        for _, parsed in parsed_lines(others, path, "prefix record", parse_prefix_record,
                                      lenient=True, skipped=skipped):
            rest.add(*parsed)
    return PrefixTable(collected, rest)
