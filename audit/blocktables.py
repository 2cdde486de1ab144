"""Producer block tables: which physical block each published key was read from.

JSONL, one record per line, in one of two shapes (docs/block-tables.md):

- per key:     {"key": "...", "block_id": N}  or  {"key": "...", "block_ids": [N, ...]} (one per
               segment, as the recorder plugin writes them), with "tenant" where the publishing
               client joined a Mooncake tenant other than the default; other fields are context.
- per request: {"req_id", "model", "tp_rank", "pp_rank", "pcp", "dcp", "cache_prefix", "group",
               "block_size", "block_ids": [...], "chunk_hashes": [...]}: block_ids[i] backs the
               chunk whose hash is chunk_hashes[i]; expanded to vLLM keys.

A key is NULL-backed when any block of the put its bytes came from is vLLM's NULL_BLOCK_ID (0).
Mooncake keeps the first copy of a key (a later put returns 0 and changes nothing), so when records
carry the put's outcome (`rc`, and `withheld` from the guard, as the recorder writes them), the
source is the earliest successful put; failed and withheld puts are attempts, counted, never the
source. Records without an outcome are all evidence: any of them naming the null block counts.
The recorder's manifests (``manifest-*.json``) in the same directories are layouts, read by
`audit.layouts.manifest`, never as block tables.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from audit.recordfiles import AppendedLines, Malformed, numbered_lines, parsed_lines
from audit.errors import AuditError
from audit.keys import vllm_key
from audit.layouts.manifest import is_manifest_path

NULL_BLOCK_ID = 0
DEFAULT_TENANT = "default"  # Mooncake's, for a client whose setup() names none; records name only others


STORED, FAILED = "stored", "failed"  # a put's outcome, where a record says it


@dataclass
class BlockTableEntry:
    key: str
    block_ids: tuple[int, ...]
    sources: list[str] = field(default_factory=list)  # "file:line" of every record naming the key
    req_ids: list[str] = field(default_factory=list)
    boundary: int | None = None  # tokens up to the end of this chunk (per-request records with block_size)
    stored_at: float | None = None  # when the put that `block_ids` come from succeeded, if records say
    stored: bool = False            # `block_ids` are those of a successful put (the key's first copy)
    tenant: str = DEFAULT_TENANT    # the Mooncake tenant the publishing client joined, where records say
    origin: str | None = None       # "file:line" of the record `block_ids` come from: who put the bytes

    @property
    def null_backed(self) -> bool:
        return NULL_BLOCK_ID in self.block_ids


@dataclass
class BlockTables:
    entries: dict[str, BlockTableEntry] = field(default_factory=dict)
    records: int = 0
    skipped_lines: int = 0
    unresolved: int = 0  # recorder lines whose blocks could not be derived ("block_ids": null)
    failed_puts: int = 0  # records of puts that stored nothing (an error code, or withheld by the guard)
    files: list[str] = field(default_factory=list)

    def get(self, key: str) -> BlockTableEntry | None:
        return self.entries.get(key)

    def add(self, key: str, block_ids: tuple[int, ...], source: str, req_id: str | None,
            boundary: int | None = None, outcome: str | None = None, at: float | None = None,
            tenant: str = DEFAULT_TENANT) -> None:
        if outcome == FAILED:
            self.failed_puts += 1
            return
        stored = outcome == STORED
        entry = self.entries.get(key)
        if entry is None:
            entry = self.entries[key] = BlockTableEntry(key, block_ids, boundary=boundary, stored=stored,
                                                        stored_at=at if stored else None, tenant=tenant,
                                                        origin=source)
        elif stored and (not entry.stored or _earlier(at, entry.stored_at)):
            entry.block_ids, entry.stored, entry.stored_at = block_ids, True, at  # the first copy is the one kept
            entry.tenant, entry.origin = tenant, source
        elif not stored and not entry.stored and NULL_BLOCK_ID in block_ids and not entry.null_backed:
            entry.block_ids = block_ids  # without outcomes, any record mapping the key to the null block is evidence
            entry.origin = source
        entry.sources.append(source)
        if req_id is not None and req_id not in entry.req_ids:
            entry.req_ids.append(req_id)

    def summary(self, keys_in_store: set[str] | None) -> dict:
        """For the report: what was read, and how many recorded keys the store no longer holds
        (counted, never an error: keys are evicted; None when the store's keys are unknown)."""
        return {
            "files": self.files, "records": self.records, "keys": len(self.entries),
            "null_backed_keys": sum(1 for entry in self.entries.values() if entry.null_backed),
            "keys_not_in_store": None if keys_in_store is None else
            sum(1 for key in self.entries if key not in keys_in_store),
            "skipped_lines": self.skipped_lines,
            "unresolved_records": self.unresolved,
            "failed_puts": self.failed_puts,
            "tenants": dict(Counter(entry.tenant for entry in self.entries.values())),
        }


def _earlier(at: float | None, than: float | None) -> bool:
    return at is not None and than is not None and at < than


def _int(record: dict, name: str, default: int | None = None) -> int:
    value = record.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise Malformed(f"'{name}' must be a non-negative integer")
    return value


def _block_ids(record: dict) -> tuple[int, ...]:
    if "block_ids" in record:
        ids = record["block_ids"]
        if not isinstance(ids, list) or not ids:
            raise Malformed("'block_ids' must be a non-empty list of integers")
        return tuple(_int({"block_ids[]": i}, "block_ids[]") for i in ids)
    return (_int(record, "block_id"),)


def _outcome(record: dict) -> str | None:
    """STORED or FAILED where the record says how its put ended (recorder lines), else None."""
    if "rc" not in record:
        return None
    rc = record["rc"]
    if rc is not None and (isinstance(rc, bool) or not isinstance(rc, int)):
        raise Malformed("'rc' must be an integer or null")
    return FAILED if record.get("withheld") or rc is None or rc < 0 else STORED


def _time(record: dict) -> float | None:
    value = record.get("time")
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _unresolved(record: dict) -> bool:
    """A recorder line for a key whose physical blocks it could not derive (it says why in `note`)."""
    return "key" in record and "block_ids" in record and record["block_ids"] is None


def _expand(record: dict) -> Iterator[tuple[str, tuple[int, ...], int | None]]:
    """(key, block ids, token boundary if known) for every entry of one record, either shape."""
    if "key" in record:
        if not isinstance(record["key"], str):
            raise Malformed("'key' must be a string")
        yield record["key"], _block_ids(record), None
        return
    if "chunk_hashes" not in record:
        raise Malformed("a record needs 'key' (per key) or 'chunk_hashes' (per request)")
    hashes, ids = record["chunk_hashes"], record.get("block_ids")
    if not isinstance(hashes, list) or not isinstance(ids, list) or len(hashes) != len(ids):
        raise Malformed("'chunk_hashes' and 'block_ids' must be lists of equal length")
    model = record.get("model")
    if not isinstance(model, str) or not model:
        raise Malformed("'model' must be a non-empty string")
    group = record.get("group", 0)
    parts = dict(tp_rank=_int(record, "tp_rank", 0), pcp=_int(record, "pcp", 0), dcp=_int(record, "dcp", 0),
                 pp_rank=_int(record, "pp_rank", 0), group=None if group is None else _int(record, "group"),
                 cache_prefix=str(record.get("cache_prefix") or ""))
    block_size = _int(record, "block_size") if record.get("block_size") is not None else None
    for index, (chunk_hash, block_id) in enumerate(zip(hashes, ids)):
        if not isinstance(chunk_hash, str):
            raise Malformed("'chunk_hashes' must hold strings")
        boundary = None if block_size is None else (index + 1) * block_size
        yield (vllm_key(Path(model).name, chunk_hash, **parts), (_int({"block_ids[]": block_id}, "block_ids[]"),),
               boundary)


# The recorder's other files in the same directories: consumers' load records (audit.loadrecords)
# and the load guard's refusals. Neither names a put.
NOT_PUT_RECORDS = ("loads-", "denied-", "prefixes-")


def _files(paths: Iterable[Path]) -> Iterator[Path]:
    """Block-table files; the recorder's manifests beside them are layouts (audit.layouts.manifest),
    its load and refusal records are not puts."""
    for path in paths:
        path = Path(path)
        if path.is_dir():
            yield from sorted(p for p in path.rglob("*.jsonl*") if p.is_file() and not p.name.startswith(NOT_PUT_RECORDS))
        elif not is_manifest_path(path):
            yield path


def read_block_tables(paths: Iterable[Path], *, lenient: bool = False) -> BlockTables:
    """All records of the given files (directories: every *.jsonl in them).

    A malformed line is an AuditError naming file and line, or with `lenient` skipped and counted.
    """
    tables = BlockTables()
    for path in _files(paths):
        tables.files.append(str(path))
        _read_lines(tables, path, numbered_lines(path, "block table"), lenient)
    return tables


def _parsed(record: dict) -> tuple[dict, list | None, str | None]:
    """A line's record, its entries (None: unresolved) and how its put ended."""
    return record, None if _unresolved(record) else list(_expand(record)), _outcome(record)


def _read_lines(tables: BlockTables, path: Path, lines: Iterable[tuple[int, str]], lenient: bool) -> set[str]:
    """Add the records of numbered lines of one file to `tables`; the keys their stored puts name."""
    named: set[str] = set()

    def skipped() -> None:
        tables.skipped_lines += 1

    for number, (record, entries, outcome) in parsed_lines(lines, path, "block table", _parsed, lenient=lenient,
                                                           skipped=skipped):
        if entries is None:
            tables.unresolved += 1
            continue
        tables.records += 1
        source = f"{path}:{number}"
        req_id = record.get("req_id")
        for key, block_ids, boundary in entries:
            tables.add(key, block_ids, source, None if req_id is None else str(req_id), boundary,
                       outcome, _time(record), str(record.get("tenant") or DEFAULT_TENANT))
            if outcome != FAILED:  # a put that stored nothing names no key in the store
                named.add(key)
    return named


class BlockTableTail:
    """The records of `paths` read as they are written (`watch`): each `poll` reads only the whole
    lines appended to each file since the last one (`audit.recordfiles`); `tables` accumulates every
    record read, as `read_block_tables` would have built it from the same lines."""

    def __init__(self, paths: Iterable[Path], *, lenient: bool = False):
        self.paths = tuple(Path(path) for path in paths)
        self.lenient = lenient
        self.tables = BlockTables()
        self._appended = AppendedLines()

    @property
    def bytes_read(self) -> int:
        return self._appended.bytes_read

    def poll(self) -> set[str]:
        """Read what was appended since the last poll; the keys the new records name."""
        named: set[str] = set()
        paths = list(_files(self.paths))
        try:
            appended = self._appended.read(paths)
        except OSError as error:
            raise AuditError(f"cannot read block table {error.filename}: {error.strerror}") from None
        for new in appended:
            try:
                lines = new.data.decode("utf-8", errors="strict").split("\n")[:-1]
            except UnicodeDecodeError:
                raise AuditError(f"block table {new.path}: not UTF-8 text") from None
            named |= _read_lines(self.tables, new.path, enumerate(lines, new.lines_before + 1), self.lenient)
        for path in paths:
            if str(path) not in self.tables.files:
                self.tables.files.append(str(path))
        return named
