"""The listed keys, held compactly: names in one byte arena and fixed-width columns for size and
replica, instead of one `KeyInfo` (and a dict per replica) per key. A million KeyInfo objects cost
the auditor about 500 B a key; the table costs the name's bytes plus about 40 (docs/scale-out.md).

A key with one memory replica of its own size (nearly every key) keeps that replica in the columns;
any other key (several replicas, other tiers, no replica) keeps its replica list aside.
`KeyInfo` objects are made on access, one at a time, each carrying its row (`ordinal`), so that
a record can be traced back to its listed key without holding names twice.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence

import numpy as np
import xxhash

from audit.records import KeyInfo

NAME_ENCODING = ("utf-8", "surrogateescape")  # a listing's bytes, kept as the master sent them
HASH_BLOCK = 65_536  # rows whose names are hashed at a time (`name_hashes`)


def name_digest(name: str) -> int:
    """XXH3-64 of a key name's bytes as a listing keeps them: what `KeyTable.name_hashes` gives its rows."""
    return xxhash.xxh3_64_intdigest(name.encode(*NAME_ENCODING))


class KeyTable(Sequence):
    """Listed keys in listing order; `subset(rows)` views some of them without copying names."""

    def __init__(self):
        self._arena = bytearray()
        self._ends = array("Q")
        self._sizes = array("q")          # -1: unknown
        self._endpoint = array("l")       # index into _endpoints; -1: the replicas are in _aside
        self._address = array("Q")
        self._endpoints: list[str] = []
        self._endpoint_ids: dict[str, int] = {}
        self._aside: dict[int, list[dict]] = {}
        self._rows: array | None = None   # a subset's rows of the table it views; None: every row

    # building ---------------------------------------------------------------------------------

    def append(self, key: KeyInfo) -> int:
        """Add a listed key; its row."""
        row = len(self._ends)
        self._arena += key.name.encode(*NAME_ENCODING)
        self._ends.append(len(self._arena))
        self._sizes.append(-1 if key.size is None else key.size)
        replicas = key.replicas
        if (len(replicas) == 1 and replicas[0].get("tier") == "memory" and replicas[0].get("size") == key.size
                and isinstance(replicas[0].get("address"), int) and isinstance(replicas[0].get("endpoint"), str)):
            self._endpoint.append(self._endpoint_id(replicas[0]["endpoint"]))
            self._address.append(replicas[0]["address"])
        else:
            self._endpoint.append(-1)
            self._address.append(0)
            if replicas:
                self._aside[row] = [dict(replica) for replica in replicas]
        return row

    def append_listed(self, name: str, size: int, endpoint: str, address: int) -> int:
        """Add a listed key with one memory replica of its own size (what `append` keeps in the
        columns), without making its KeyInfo; its row."""
        row = len(self._ends)
        self._arena += name.encode(*NAME_ENCODING)
        self._ends.append(len(self._arena))
        self._sizes.append(size)
        self._endpoint.append(self._endpoint_id(endpoint))
        self._address.append(address)
        return row

    def extend_copied(self, other: KeyTable, rows: Sequence[int], names: Sequence[str]) -> range:
        """Add rows of `other` whose replica its columns hold (`other.in_columns`), as `append_listed`
        would add each, column by column (a listing of a store that changed little copies nearly
        every key from the last one); `names`: those rows' names, which the caller has. Their rows."""
        start = len(self._ends)
        if not rows:
            return range(start, start)
        encoded = [name.encode(*NAME_ENCODING) for name in names]
        ends = len(self._arena) + np.cumsum(np.fromiter(map(len, encoded), dtype=np.uint64, count=len(encoded)))
        self._arena += b"".join(encoded)
        self._ends.frombytes(ends.astype(np.uint64).tobytes())
        taken = np.asarray(rows, dtype=np.int64)
        self._sizes.frombytes(np.frombuffer(other._sizes, dtype=np.int64)[taken].tobytes())
        ids = np.array([self._endpoint_id(endpoint) for endpoint in other._endpoints], dtype=np.int64)
        endpoint = np.frombuffer(other._endpoint, dtype=np.dtype(f"i{other._endpoint.itemsize}"))[taken]
        if (endpoint < 0).any():
            raise ValueError("extend_copied: a row whose replicas are kept aside")
        self._endpoint.frombytes(ids[endpoint].astype(np.dtype(f"i{self._endpoint.itemsize}")).tobytes())
        self._address.frombytes(np.frombuffer(other._address, dtype=np.uint64)[taken].tobytes())
        return range(start, start + len(rows))

    def _endpoint_id(self, endpoint: str) -> int:
        found = self._endpoint_ids.get(endpoint)
        if found is None:
            found = self._endpoint_ids[endpoint] = len(self._endpoints)
            self._endpoints.append(endpoint)
        return found

    @classmethod
    def of(cls, keys: Iterable[KeyInfo]) -> KeyTable:
        table = cls()
        for key in keys:
            table.append(key)
        return table

    # reading ----------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._ends) if self._rows is None else len(self._rows)

    def _row(self, index: int) -> int:
        return index if self._rows is None else self._rows[index]

    def name(self, row: int) -> str:
        """The name of table row `row` (an ordinal, whatever subset this is)."""
        start = self._ends[row - 1] if row else 0
        return self._arena[start:self._ends[row]].decode(*NAME_ENCODING)

    def size(self, row: int) -> int | None:
        size = self._sizes[row]
        return None if size < 0 else size

    def info(self, row: int) -> KeyInfo:
        """Table row `row` as a KeyInfo (a fresh object: changing it changes nothing here)."""
        size = self.size(row)
        endpoint = self._endpoint[row]
        if endpoint >= 0:
            replicas = [{"tier": "memory", "endpoint": self._endpoints[endpoint], "address": self._address[row],
                         "size": size}]
        else:
            replicas = [dict(replica) for replica in self._aside.get(row, ())]
        return KeyInfo(name=self.name(row), size=size, replicas=replicas, ordinal=row)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self.subset(self.rows()[index])
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(index)
        return self.info(self._row(index))

    def __iter__(self) -> Iterator[KeyInfo]:
        """Every row as `info(row)` gives it (the same objects, made with the lookups hoisted: a
        scan iterates a million of them)."""
        rows = range(len(self._ends)) if self._rows is None else self._rows
        arena, ends, sizes, endpoint_of, address, endpoints, aside = (
            self._arena, self._ends, self._sizes, self._endpoint, self._address, self._endpoints, self._aside)
        for row in rows:
            size = sizes[row]
            size = None if size < 0 else size
            endpoint = endpoint_of[row]
            if endpoint >= 0:
                replicas = [{"tier": "memory", "endpoint": endpoints[endpoint], "address": address[row], "size": size}]
            else:
                replicas = [dict(replica) for replica in aside.get(row, ())]
            name = arena[ends[row - 1] if row else 0:ends[row]].decode("utf-8", "surrogateescape")  # NAME_ENCODING
            yield KeyInfo(name, size, None, replicas, None, row)  # positional (name, size, fields, replicas,
            # tenant, ordinal): a quarter of the time keywords take, at a million keys 0.5 s

    def encoded_rows(self) -> Iterator[tuple[int, bytes, int]]:
        """(row, name, size) of every row of this view, the name as the listing's bytes and the size as
        the column holds it (-1: unknown), with the lookups hoisted: a chunk index reads a million, and
        decodes only one key of each vLLM key shape."""
        arena, ends, sizes = memoryview(self._arena), self._ends, self._sizes
        try:
            for row in (range(len(self._ends)) if self._rows is None else self._rows):
                yield row, arena[ends[row - 1] if row else 0:ends[row]].tobytes(), sizes[row]
        finally:
            arena.release()  # the arena may grow again

    def name_hashes(self, rows: np.ndarray) -> np.ndarray:
        """XXH3-64 of the names of table rows `rows` (ordinals), hashed from the listing's bytes as
        kept: `name_digest` of each, no name decoded."""
        digest, arena, ends = xxhash.xxh3_64_intdigest, memoryview(self._arena), self._ends
        hashes = np.empty(len(rows), dtype=np.uint64)
        try:
            for start in range(0, len(rows), HASH_BLOCK):  # a block of rows as Python ints at a time
                block = rows[start:start + HASH_BLOCK].tolist()
                hashes[start:start + len(block)] = np.fromiter(
                    (digest(arena[ends[row - 1] if row else 0:ends[row]]) for row in block),
                    dtype=np.uint64, count=len(block))
        finally:
            arena.release()  # the arena may grow again
        return hashes

    def rows(self) -> array:
        """The table rows this view holds, in order."""
        return array("Q", range(len(self._ends))) if self._rows is None else self._rows

    def names(self) -> Iterator[str]:
        """Every row's name of this view, as `name` gives it."""
        arena, ends = self._arena, self._ends
        for row in (range(len(self._ends)) if self._rows is None else self._rows):
            yield arena[ends[row - 1] if row else 0:ends[row]].decode(*NAME_ENCODING)

    def size_column(self) -> array:
        """Every table row's size (-1: unknown), for array operations over many rows."""
        return self._sizes

    def size_array(self) -> np.ndarray:
        """This view's sizes as an int64 array (-1: unknown)."""
        sizes = np.frombuffer(self._sizes, dtype=np.int64) if len(self._sizes) else np.zeros(0, dtype=np.int64)
        return sizes.copy() if self._rows is None else sizes[np.frombuffer(self._rows, dtype=np.uint64).astype(np.int64)]

    def total_size(self) -> int:
        return int(self.size_array().clip(0).sum())

    def in_columns(self, row: int) -> bool:
        """Whether the columns hold the row's replica (one memory replica of the key's own size)."""
        return self._endpoint[row] >= 0

    def listed_replica(self, row: int) -> tuple[str, int, int | None] | None:
        """(endpoint, address, size) of a row's one memory replica, where the columns hold it."""
        endpoint = self._endpoint[row]
        return None if endpoint < 0 else (self._endpoints[endpoint], self._address[row], self.size(row))

    def replica_columns(self) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray]:
        """The holders' endpoints, and this view's (holder, address, size) per row as arrays: a holder
        is an index into those endpoints, -1 where the columns do not hold the row's replica
        (`in_columns`)."""
        endpoint = np.frombuffer(self._endpoint, dtype=np.dtype(f"i{self._endpoint.itemsize}")).astype(np.int64)
        address = np.frombuffer(self._address, dtype=np.uint64)
        if self._rows is None:
            return list(self._endpoints), endpoint, address.copy(), self.size_array()
        rows = np.frombuffer(self._rows, dtype=np.uint64).astype(np.int64)
        return list(self._endpoints), endpoint[rows], address[rows], self.size_array()

    def split(self, keep: Callable[[KeyInfo], bool]) -> tuple[KeyTable, list[KeyInfo]]:
        """(the keys for which `keep` holds, as a view; the others), asking `keep` only of keys
        kept aside: a key with one memory replica in the columns is taken as kept."""
        kept, others = array("Q"), []
        for row in self.rows():
            if self._endpoint[row] >= 0:
                kept.append(row)
            elif keep(info := self.info(row)):
                kept.append(row)
            else:
                others.append(info)
        return self.subset(kept), others

    def unusual(self) -> tuple[int, Iterator[KeyInfo]]:
        """How many keys hold one memory replica of their own size (most), and the others."""
        rows = self.rows()
        endpoints = self._endpoint
        usual = sum(1 for row in rows if endpoints[row] >= 0)
        return usual, (self.info(row) for row in rows if endpoints[row] < 0)

    # views ------------------------------------------------------------------------------------

    def subset(self, rows: Iterable[int]) -> KeyTable:
        """A view of some table rows (in the order given), sharing this table's columns."""
        view = object.__new__(KeyTable)
        for name in ("_arena", "_ends", "_sizes", "_endpoint", "_address", "_endpoints", "_endpoint_ids", "_aside"):
            setattr(view, name, getattr(self, name))
        if isinstance(rows, np.ndarray):
            view._rows = array("Q")
            view._rows.frombytes(rows.astype(np.uint64).tobytes())
        else:
            view._rows = rows if isinstance(rows, array) else array("Q", rows)
        return view


def as_table(keys: Sequence[KeyInfo]) -> KeyTable:
    """`keys` as a table (itself, when it already is one)."""
    return keys if isinstance(keys, KeyTable) else KeyTable.of(keys)
