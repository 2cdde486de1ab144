"""Key sources: which keys to audit, with their sizes, taken without leasing anything.

The admin listing (`/get_all_keys`) splits a key that holds a newline into several lines; lines
that the lease-free query does not know are rejoined with their neighbours until they name a key.
A key the lease-free query cannot answer for (one holding a comma, which `/batch_query_keys` splits
on; one it refuses or describes with no replica) is sized by the store client instead (`size_of`),
and counted (`through_client`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from audit.connection import AdminClient
from audit.records import KeyInfo
from audit.sources.keytable import KeyTable

REJOIN_SPAN = 8                   # a key may hold up to this many newlines and still be found
REJOIN_LIMIT = 1_000              # unknown lines beyond this are reported as vanished, not rejoined
LISTING_BLOCK = 8_192             # listed lines sized per round of lease-free queries
TIERS = {"values": "memory", "disk_values": "disk", "local_disk_values": "local_disk", "nof_values": "nof"}


@dataclass(frozen=True)
class KeyFilter:
    prefix: str = ""
    pattern: re.Pattern | None = None

    def __call__(self, key: str) -> bool:
        return key.startswith(self.prefix) and (self.pattern is None or self.pattern.search(key) is not None)


@dataclass
class Listing:
    """The keys found (a compact KeyTable), plus the names that vanished between listing and sizing."""

    keys: KeyTable
    vanished: list[str]
    listed_lines: int
    outside_filter: int = 0   # listed lines --prefix/--match leaves out (a key with newlines: one per line)
    through_client: int = 0   # keys the admin API could not answer for, sized by the store client
    rows_by_name: dict[str, int] | None = None  # name -> table row (`list(index=True)`)
    sized: int = 0            # keys asked of the master (every key, unless `known` answered for some)


class KnownKeys:
    """What an earlier listing said of its keys (sizes, replicas), by name: `AdminListing.list(known=...)`
    takes it from there instead of asking the master again. Sizes and replicas may have changed since:
    a key to be read is sized again first (`watch` does), and a peek read checks its replicas with the
    master after reading (audit.readers.peek)."""

    def __init__(self, listing: Listing):
        if listing.rows_by_name is None:
            raise ValueError("KnownKeys needs a listing made with index=True")
        self.table = listing.keys
        self.rows = listing.rows_by_name

    def __contains__(self, name: str) -> bool:
        return name in self.rows


def _listed_row(answer: dict) -> tuple[int, str, int] | None:
    """(size, endpoint, address) of an answer that a KeyTable keeps in its columns: one memory
    replica, no other tier, its size the key's (what `_key_info` + `KeyTable.append` would keep
    there, without the KeyInfo and replica dicts); None for any other answer."""
    values = answer.get("values")
    if not answer.get("ok") or not values or len(values) != 1 or answer.get("disk_values") \
            or answer.get("local_disk_values") or answer.get("nof_values"):
        return None
    replica = values[0]
    raw_size, endpoint, address = replica.get("size_"), replica.get("transport_endpoint_"), replica.get("buffer_address_")
    size = int(raw_size or 0)
    if raw_size != size or not isinstance(address, int) or not isinstance(endpoint, str):
        return None
    return size, endpoint, address


def _key_info(name: str, answer: dict) -> KeyInfo | None:
    """Memory replicas first (readers and shards go by the first), then the other tiers'. Disk
    descriptors name their fields otherwise (`object_size`; a holder's offload RPC endpoint as
    `transport_endpoint`) and have no address: a disk-only key sized 0 was read into 0 bytes."""
    replicas = [{"tier": tier, "endpoint": r.get("transport_endpoint_", r.get("transport_endpoint")),
                 "address": r.get("buffer_address_"), "size": r.get("size_", r.get("object_size"))}
                for field, tier in TIERS.items() for r in answer.get(field) or []]
    if not answer.get("ok") or not replicas:
        return None
    return KeyInfo(name=name, size=int(replicas[0]["size"] or 0), replicas=replicas)


def admin_readable(key: KeyInfo) -> bool:
    """Whether a lease-free read can address the key: the admin API described a memory replica."""
    return any(replica.get("tier") == "memory" for replica in key.replicas)


class _Lines:
    """The listing body's lines, read out of the body on demand (a list of a million strings
    would cost more than the body itself)."""

    def __init__(self, body: bytes):
        self.body = body
        ends = np.flatnonzero(np.frombuffer(body, dtype=np.uint8) == 0x0A)
        if len(body) and (not len(ends) or ends[-1] != len(body) - 1):
            ends = np.r_[ends, len(body)]  # a last line without its newline
        self.ends = ends
        self.starts = np.r_[0, ends[:-1] + 1] if len(ends) else ends

    def __len__(self) -> int:
        return len(self.ends)

    def __getitem__(self, i: int) -> str:
        return self.body[self.starts[i]:self.ends[i]].decode("utf-8", errors="surrogateescape")

    def block(self, first: int, count: int) -> list[str]:
        """Lines first .. first + count - 1 (fewer at the end), decoded at once: a newline byte is
        never inside a UTF-8 sequence, so they are the lines `[i]` gives one by one."""
        last = min(first + count, len(self.ends)) - 1
        if last < first:
            return []
        return self.body[self.starts[first]:self.ends[last]].decode("utf-8", errors="surrogateescape").split("\n")

    def repeated(self) -> set[int]:
        """Lines whose text another line also has (a key's newline-split part may equal a key)."""
        if not len(self.ends):
            return set()
        digests = np.fromiter((hash(self.body[a:b]) for a, b in zip(self.starts.tolist(), self.ends.tolist())),
                              dtype=np.int64, count=len(self.ends))
        values, counts = np.unique(digests, return_counts=True)
        twice = values[counts > 1]
        return set(np.flatnonzero(np.isin(digests, twice)).tolist()) if len(twice) else set()


class AdminListing:
    """Every key of the cluster (default tenant), filtered, sized lease-free, into a KeyTable."""

    def __init__(self, admin: AdminClient, key_filter: KeyFilter = KeyFilter(),
                 size_of: Callable[[str], int] | None = None):
        self.admin = admin
        self.key_filter = key_filter
        self.size_of = size_of
        self._through_client = 0
        self._sized = 0

    def list(self, known: KnownKeys | None = None, index: bool = False) -> Listing:
        """The listing. `known` (an earlier listing's keys): names it holds are taken from it, and only
        the others are sized by the master (a line whose text another line repeats is always asked).
        `index`: the listing also maps each name to its table row (`rows_by_name`)."""
        self._through_client = 0
        self._sized = 0
        lines = _Lines(self.admin.all_keys_body())
        table = KeyTable()
        rows: dict[str, int] | None = {} if index else None
        repeated = lines.repeated()
        seen: set[str] = set()  # names of repeated lines already found
        unknown: list[int] = []
        outside = 0
        keep = None if self.key_filter == KeyFilter() else self.key_filter
        for first in range(0, len(lines), LISTING_BLOCK):
            block: list[tuple[int, str]] = []
            for i, line in enumerate(lines.block(first, LISTING_BLOCK), first):
                if not line:
                    continue
                if keep is not None and not keep(line):
                    outside += 1
                    continue
                block.append((i, line))
            self._size_block(block, table, unknown, repeated, seen, known, rows)
        vanished = self._rejoin(lines, unknown, table, rows)
        return Listing(keys=table, vanished=vanished, listed_lines=len(lines), outside_filter=outside,
                       through_client=self._through_client, rows_by_name=rows, sized=self._sized)

    def _size_block(self, block: list[tuple[int, str]], table: KeyTable, unknown: list[int],
                    repeated: set[int], seen: set[str], known: KnownKeys | None = None,
                    rows: dict[str, int] | None = None) -> None:
        taken: dict[int, int] = {}  # block position -> the known listing's row of that name
        if known is not None:
            known_rows = known.rows
            for j, (i, line) in enumerate(block):
                if i not in repeated and (row := known_rows.get(line)) is not None:
                    taken[j] = row
        answers = self._answers(line for j, (_, line) in enumerate(block) if j not in taken)
        copied_rows: list[int] = []   # a run of known keys the columns hold: copied column by column
        copied_names: list[str] = []

        def copy_run() -> None:
            added = table.extend_copied(known.table, copied_rows, copied_names)
            if rows is not None:
                rows.update(zip(copied_names, added))
            copied_rows.clear()
            copied_names.clear()

        for j, (i, line) in enumerate(block):
            if (row := taken.get(j)) is not None and known.table.in_columns(row):
                copied_rows.append(row)
                copied_names.append(line)
                continue
            if copied_rows:
                copy_run()
            found = known.table.info(row) if row is not None else answers.get(line)
            if found is None:
                unknown.append(i)
            elif i not in repeated or line not in seen:
                if type(found) is tuple:  # the common key: straight into the table's columns
                    added = table.append_listed(line, *found)
                else:
                    added = table.append(found)
                if rows is not None:
                    rows[line] = added
                if i in repeated:
                    seen.add(line)
        if copied_rows:
            copy_run()

    def size_names(self, names: Iterable[str]) -> dict[str, KeyInfo]:
        """The named keys the store holds, sized lease-free (the client sizes what the admin API
        cannot answer for), by name."""
        return {name: found if isinstance(found, KeyInfo) else KeyInfo(
                    name=name, size=found[0], replicas=[{"tier": "memory", "endpoint": found[1], "address": found[2],
                                                         "size": found[0]}])
                for name, found in self._answers(names).items()}

    def _answers(self, names: Iterable[str]) -> dict[str, KeyInfo | tuple[int, str, int]]:
        """`size_names`, with the common key (one memory replica of its own size) as a
        (size, endpoint, address) tuple instead of a KeyInfo."""
        plain, unanswered = [], []
        for name in names:
            (unanswered if "," in name else plain).append(name)
        self._sized += len(plain) + len(unanswered)
        infos: dict[str, KeyInfo | tuple[int, str, int]] = {}
        for name, answer in self.admin.query(plain):
            if (row := _listed_row(answer)) is not None:
                infos[name] = row
            elif (info := _key_info(name, answer)) is not None:
                infos[name] = info
            elif answer.get("error") != "OBJECT_NOT_FOUND":
                unanswered.append(name)  # refused, or known without a replica: the client may still read it
        for name in unanswered:
            size = self.size_of(name) if self.size_of else -1
            if size >= 0:
                infos[name] = KeyInfo(name=name, size=size)
                self._through_client += 1
        return infos

    def _rejoin(self, lines: _Lines, unknown: list[int], table: KeyTable,
                rows: dict[str, int] | None = None) -> list[str]:
        """Rejoin unknown lines with neighbours (keys holding newlines); the rest vanished."""
        if not unknown:
            return []
        candidates: dict[str, tuple[int, int]] = {}
        for i in unknown[:REJOIN_LIMIT]:
            for start in range(max(0, i - REJOIN_SPAN), i + 1):
                for stop in range(i + 1, min(len(lines), start + REJOIN_SPAN + 1) + 1):
                    if stop - start >= 2:
                        candidates.setdefault("\n".join(lines[j] for j in range(start, stop)), (start, stop))
        answers = self.size_names(name for name in candidates if self.key_filter(name))
        covered: set[int] = set()
        for name, info in answers.items():
            row = table.append(info)
            if rows is not None:
                rows[name] = row
            start, stop = candidates[name]
            covered.update(range(start, stop))
        return [lines[i] for i in unknown if i not in covered]
