"""A store's worth of prefix records, as `scan`, `check` and `watch` read them (`--block-tables DIR`):
every record of a hex chunk hash in sorted arrays, looked up a batch of keys at a time.

A million keys' records held in a dict cost 157 bytes a hash and a dict lookup a key whose memory
misses the caches (the table is the store's size, the listing's order is not the records'); here a
32-byte hash costs 52 bytes (the hash, its digest, its window, its first 8 bytes as a number) and a
batch's lookups are a few array operations (`HashTable.rows`). Records that no table holds (a text
hash, a digest not of 16 hex digits) stay in a `PrefixRecords`, and every answer is the one a `PrefixRecords` of the same lines would give:
duplicates kept once, a hash recorded with two digests in `conflicts` and claimed by neither.
"""

from __future__ import annotations

import io
from array import array
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from audit.errors import AuditError
from audit.prefixrecords import (
    CONV,
    KV,
    RECORDER_LINE,
    PrefixDigest,
    PrefixRecords,
    hash_key,
    packed_record,
    parse_prefix_record,
    prefix_record_paths,
    recorder_line,
    unpacked,
    window_and_digest,
)
from audit.recordfiles import numbered_lines, parsed_lines


class HashTable:
    """One region's records of hex hashes of one length, sorted by hash, each hash once; searched by
    each hash's first 8 bytes (`leads`, a number) through every `SPARSE`-th of them, which a cache
    holds: a million hashes' table is 32 MB, and a plain binary search of it misses the caches at
    almost every step (2.8 us a query here against 0.45)."""

    SPARSE = 16

    def __init__(self, hashes: np.ndarray, digests: np.ndarray, windows: np.ndarray, starts: np.ndarray | None = None):
        self.hashes = hashes    # (n,) S{length}
        self.digests = digests  # (n,) uint64
        self.windows = windows  # (n,) uint32
        self.starts = starts    # (n,) uint32: a KV block's start + 1 (0: not recorded); None: none recorded
        self.leads = _leads(hashes)
        self.sparse = self.leads[::self.SPARSE].copy()

    def rows(self, queries: np.ndarray) -> np.ndarray:
        """Each query hash's row, or -1."""
        if not len(self.hashes):
            return np.full(len(queries), -1)
        last = len(self.hashes) - 1
        leads = _leads(queries)
        base = np.maximum(np.searchsorted(self.sparse, leads, "right") - 1, 0) * self.SPARSE
        block = self.leads[np.minimum(base[:, None] + np.arange(self.SPARSE), last)]
        at = np.minimum(base + (block < leads[:, None]).sum(axis=1), last)  # the first row of a lead not below
        found = self.hashes[at] == queries
        shared = ~found & (self.leads[at] == leads)  # a lead other hashes have too: searched whole
        if shared.any():
            at[shared] = _rows(self.hashes, queries[shared])
            found[shared] = at[shared] >= 0
        return np.where(found, at, -1)

    def packed(self, row: int) -> int:
        """Row `row`'s record as `packed_record` keeps it."""
        start = int(self.starts[row]) - 1 if self.starts is not None and self.starts[row] else None
        return packed_record(int(self.digests[row]), int(self.windows[row]), start)

    def row(self, key: bytes) -> int:
        """`rows` of one hash, by one binary search (a key at a time: an attention page's block, a
        key the batch did not settle; `rows`' array operations cost more than they save for one)."""
        at = int(np.searchsorted(self.hashes, key))
        return at if at < len(self.hashes) and self.hashes[at:at + 1].tobytes() == key else -1


def _leads(hashes: np.ndarray) -> np.ndarray:
    """Each S{length} hash's first 8 bytes (zeros after a shorter one's) as a number: in the hashes' order."""
    first = np.zeros((len(hashes), 8), np.uint8)
    width = min(hashes.dtype.itemsize, 8)
    first[:, :width] = hashes.view(np.uint8).reshape(len(hashes), hashes.dtype.itemsize)[:, :width]
    return first.view(">u8")[:, 0].astype(np.uint64)


def _rows(hashes: np.ndarray, queries: np.ndarray) -> np.ndarray:
    """Each query's row in the sorted `hashes`, or -1 (a binary search of the whole hashes)."""
    if not len(hashes):
        return np.full(len(queries), -1)
    at = np.minimum(np.searchsorted(hashes, queries), len(hashes) - 1)
    return np.where(hashes[at] == queries, at, -1)


class _Collected:
    """One region's records of hex hashes of one length, as read: appended, then sealed into arrays a
    part at a time (a part's Python buffers are a few MiB at most), and sorted at the end (`table`)."""

    PART = 1 << 16  # records a part

    def __init__(self, length: int):
        self.length = length
        self.parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self._start()

    def _start(self) -> None:
        self.hashes, self.digests, self.windows, self.starts = bytearray(), array("Q"), array("I"), array("I")

    def add(self, hashed: bytes, packed: int) -> None:
        self.hashes += hashed
        self.digests.append(window_and_digest(packed)[1])
        self.windows.append(packed & 0xFFFFFFFF)
        self.starts.append(packed >> 96)  # the start + 1, 0 where none was recorded
        if len(self.digests) == self.PART:
            self._seal()

    def extend(self, hashes: np.ndarray, digests: np.ndarray, windows: np.ndarray,
               starts: np.ndarray | None = None) -> None:
        """Many records at once: hashes S{length}, digests, windows, starts + 1 (a part of their own)."""
        self._seal()
        self.parts.append((hashes, digests.astype(np.uint64, copy=False),
                           windows.astype(f"u{self.windows.itemsize}", copy=False),
                           np.zeros(len(hashes), np.uint32) if starts is None else starts.astype(np.uint32)))

    def _seal(self) -> None:
        if not self.digests:
            return
        self.parts.append((np.frombuffer(self.hashes, f"S{self.length}"), np.frombuffer(self.digests, np.uint64),
                           np.frombuffer(self.windows, f"u{self.windows.itemsize}"), np.frombuffer(self.starts, np.uint32)))
        self._start()

    def table(self) -> tuple[HashTable, set[bytes]]:
        """The records sorted, each hash once; and the hashes recorded with two digests (still in it)."""
        self._seal()
        parts, self.parts = self.parts, []
        hashes, digests, windows, starts = (np.concatenate(column) for column in zip(*parts))
        del parts
        order = np.argsort(hashes, kind="stable")
        hashes = hashes[order]  # (a column at a time: the peak is the columns and one sorted copy)
        digests = digests[order]
        windows = windows[order]
        starts = starts[order] if starts.any() else None  # (a conv window's table: no column)
        del order
        repeated = hashes[1:] == hashes[:-1]
        if not repeated.any():
            return HashTable(hashes, digests, windows, starts), set()
        differs = repeated & ((digests[1:] != digests[:-1]) | (windows[1:] != windows[:-1]))
        if starts is not None:
            differs |= repeated & (starts[1:] != starts[:-1])
        conflicting = {row.tobytes() for row in _as_bytes(hashes[1:][differs])}
        first = np.concatenate(([True], ~repeated))
        return HashTable(hashes[first], digests[first], windows[first],
                         None if starts is None else starts[first]), conflicting


def _as_bytes(hashes: np.ndarray) -> np.ndarray:
    """(n, length) uint8 of S{length} hashes (an item of S drops its trailing zero bytes; these keep them)."""
    return hashes.view(np.uint8).reshape(len(hashes), hashes.dtype.itemsize)


class PrefixTable:
    """The records of `read_prefix_records`: `HashTable`s by (region, hash length), and a
    `PrefixRecords` of the rest; `PrefixRecords`' reading interface (`get`, `packed`, `packed_many`,
    `conflicts`, `supplied`, `is_supplied`, `records`, `skipped`, `len`)."""

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
    def supplied(self) -> dict:
        return self.rest.supplied

    def is_supplied(self, chunk_hash: str) -> bool:
        return self.rest.is_supplied(chunk_hash)

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
        table = self.tables.get((region, len(key))) if isinstance(key, bytes) else None
        if table is not None and (row := table.row(key)) >= 0:
            return table.packed(row)
        return self.rest.packed(chunk_hash, region)  # (a hash is in a table or here, never both)

    def tabled(self, hashes: np.ndarray, region: str = CONV) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The table records of hex hashes given as one S{length} array of their bytes: whether each
        has one, and its digest, window and start (0 where it has none: a hash with no table record
        may still have one in `rest`; the start + 1 as the table keeps it, 0 where none was recorded)."""
        table = self.tables.get((region, hashes.dtype.itemsize))
        if table is None:
            nothing = np.zeros(len(hashes), np.uint32)
            return np.zeros(len(hashes), bool), np.zeros(len(hashes), np.uint64), nothing, nothing
        rows = table.rows(hashes)
        found = rows >= 0
        starts = np.zeros(len(hashes), np.uint32) if table.starts is None else np.where(found, table.starts[rows], 0)
        return found, np.where(found, table.digests[rows], 0), np.where(found, table.windows[rows], 0), starts

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
            for j, row in zip(chosen, rows.tolist()):
                if row >= 0:
                    found[j] = table.packed(row)
        return found


def _without(table: HashTable, hashes: set[bytes], length: int) -> HashTable:
    dropped = np.isin(table.hashes, np.frombuffer(b"".join(h for h in hashes if len(h) == length) or b"", f"S{length}"))
    return HashTable(table.hashes[~dropped], table.digests[~dropped], table.windows[~dropped],
                     None if table.starts is None else table.starts[~dropped])


def _distinct(tables: dict[tuple[str, int], HashTable], rest: PrefixRecords) -> int:
    """How many hashes have a record of either region."""
    by_length: dict[int, np.ndarray] = {}
    for (_, length), table in tables.items():  # (each table's hashes are sorted and distinct)
        if length in by_length:
            both = np.sort(np.concatenate((by_length[length], table.hashes)))
            by_length[length] = both[np.concatenate(([True], both[1:] != both[:-1]))]
        else:
            by_length[length] = table.hashes
    others = rest.digests.keys() | rest.blocks.keys()
    held = sum(1 for key in others if isinstance(key, bytes) and len(key) in by_length
               and _rows(by_length[len(key)], np.frombuffer(key, f"S{len(key)}"))[0] >= 0)
    return sum(map(len, by_length.values())) + len(others) - held


def read_prefix_records(paths: Iterable[Path]) -> PrefixTable:
    """Every prefix record under `paths`; a malformed line is counted and passed over, never fatal.
    The recorder's own lines go straight into the tables (`_recorder_lines`), the others through
    the JSON parser."""
    rest = PrefixRecords()
    collected: dict[tuple[str, int], _Collected] = {}

    def skipped() -> None:
        rest.skipped += 1

    for path in prefix_record_paths(paths):
        others = _recorder_lines(path, collected, rest)
        for _, parsed in parsed_lines(others, path, "prefix record", parse_prefix_record,
                                      lenient=True, skipped=skipped):
            rest.add(*parsed)
    return PrefixTable(collected, rest)


def _recorder_lines(path: Path, collected: dict[tuple[str, int], _Collected], rest: PrefixRecords) -> list:
    """Add the recorder's lines of `path` to `collected` (counted in `rest.records`), read a few MiB
    at a time; the other lines, (number, text). A piece not in ASCII, or with a carriage return, is
    read a line at a time, as `numbered_lines` would."""
    try:
        handle = open(path, "rb")
    except OSError:
        return list(numbered_lines(path, "prefix record"))  # (which says why, as an error)
    others: list[tuple[int, str]] = []
    number = 1
    with handle:
        for piece in _pieces(handle):
            if piece.isascii() and b"\r" not in piece:
                others += _shapes(piece, number, collected, rest)
                number += piece.count(b"\n") + (not piece.endswith(b"\n"))
                continue
            try:
                text = piece.decode("utf-8")
            except UnicodeDecodeError:
                raise AuditError(f"prefix record {path}: not UTF-8 text") from None
            for line in io.StringIO(text, newline=None):
                if (found := recorder_line(line)) is None:
                    others.append((number, line))
                else:
                    _add(collected, rest, *found)
                number += 1
    return others


def _add(collected: dict[tuple[str, int], _Collected], rest: PrefixRecords, hashed: bytes, _, conv, block) -> None:
    """A `recorder_line`'s record."""
    rest.records += 1
    for region, packed in ((CONV, conv), (KV, block)):
        if packed is not None:
            _collected(collected, region, len(hashed)).add(hashed, packed)


def _collected(collected: dict[tuple[str, int], _Collected], region: str, length: int) -> _Collected:
    if (its := collected.get((region, length))) is None:
        its = collected[region, length] = _Collected(length)
    return its


PIECE_BYTES = 1 << 22  # read at once (whole lines: a line longer waits for the next read)


def _pieces(handle) -> Iterator[bytes]:
    """The file's bytes a few MiB of whole lines at a time (a last line without a newline last)."""
    carry = b""
    while chunk := handle.read(PIECE_BYTES):
        data = carry + chunk
        cut = data.rfind(b"\n") + 1
        if cut:
            yield data[:cut]
        carry = data[cut:]
    if carry:
        yield carry


_HEX_VALUE = np.full(256, 255, np.uint8)  # a byte's value as a lowercase hex digit (255: not one)
_HEX_VALUE[np.frombuffer(b"0123456789abcdef", np.uint8)] = np.arange(16)


def _shapes(piece: bytes, first: int, collected: dict[tuple[str, int], _Collected], rest: PrefixRecords) -> list:
    """The recorder's lines of `piece` (ASCII, lines from number `first`), a shape at a time: lines of
    one length whose bytes are those of the first such line (one `recorder_line` reads) but for its
    hash, digits and digests, and those of their kind, read as `recorder_line` reads each, one array
    operation a column; the other lines, (number, text)."""
    buf = np.frombuffer(piece, np.uint8)
    ends = np.flatnonzero(buf == ord("\n"))
    if buf[-1] != ord("\n"):
        ends = np.append(ends, len(buf))
    starts = np.concatenate(([0], ends[:-1] + 1))
    lengths = ends - starts
    others: list[tuple[int, str]] = []
    for length in np.flatnonzero(np.bincount(lengths)).tolist():
        lines = np.flatnonzero(lengths == length)
        if len(lines) == len(lengths) and len(buf) == len(lines) * (length + 1):  # every line, each ended: a view
            rows = buf[:len(lines) * (length + 1)].reshape(len(lines), length + 1)[:, :length]
        else:
            rows = buf[starts[lines][:, None] + np.arange(length)]  # (lines, length)
        found = RECORDER_LINE.fullmatch(template := piece[starts[lines[0]]:ends[lines[0]]].decode())
        if found is None or recorder_line(template) is None:  # each line of this shape is looked at alone
            others += _texts(piece, starts, ends, lines, first)
            continue
        spans = [found.span(group) for group in range(1, 7)]  # hash, window, digest, KV window, KV digest, KV start
        variable = np.zeros(length, bool)
        for start, end in spans:
            variable[max(start, 0):max(end, 0)] = True
        same = (rows[:, ~variable] == rows[0, ~variable]).all(axis=1)
        values = [None if start < 0 else _HEX_VALUE[rows[:, start:end]] for start, end in spans]
        for group, ((start, _), digits) in enumerate(zip(spans, values)):
            if start >= 0 and group in (1, 3):  # a window: decimal digits, the first not 0
                same &= (digits < 10).all(axis=1) & (rows[:, start] != ord("0"))
            elif start >= 0 and group == 5:  # a start: decimal digits, the first not 0 but in "0" itself
                same &= (digits < 10).all(axis=1) & ((rows[:, start] != ord("0")) | (digits.shape[1] == 1))
            elif start >= 0:
                same &= (digits < 16).all(axis=1)
        if not same.all():
            others += _texts(piece, starts, ends, lines[~same], first)
            values = [None if digits is None else digits[same] for digits in values]
        rest.records += int(same.sum())
        nibbles, conv, conv_digest, kv, kv_digest, kv_start = values
        hashes = (nibbles[:, 0::2] << 4 | nibbles[:, 1::2]).view(f"S{nibbles.shape[1] // 2}")[:, 0]
        positions = None if kv_start is None else _number(kv_start, 10) + np.uint64(1)
        for region, window, digest, start in ((CONV, conv, conv_digest, None), (KV, kv, kv_digest, positions)):
            if window is not None:
                _collected(collected, region, hashes.dtype.itemsize).extend(hashes, _number(digest, 16),
                                                                             _number(window, 10), start)
    return others


def _number(digits: np.ndarray, base: int) -> np.ndarray:
    """Each row's digits (values, most significant first) as one uint64."""
    value = np.zeros(len(digits), np.uint64)
    for column in digits.T:
        value = value * np.uint64(base) + column
    return value


def _texts(piece: bytes, starts: np.ndarray, ends: np.ndarray, lines: np.ndarray, first: int) -> list:
    return [(first + i, piece[starts[i]:ends[i]].decode()) for i in lines.tolist()]
