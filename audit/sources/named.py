"""Key sources that name keys the listing cannot show: other tenants' keys, which no admin route lists.

`--keys FILE` takes a key list (one key per line, exactly), an earlier report (`--format json`
or `jsonl`: its records, `--all` for every key) or a snapshot. The recorder's records (given as
`--block-tables`) name keys too, each with the tenant its client joined. A name comes with its
tenant where the source says it (reports and records: absent means the default tenant), or None
where it cannot (a key list, a snapshot): such names are looked for in every tenant audited.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from audit.blocktables import DEFAULT_TENANT, BlockTables
from audit.errors import AuditError

SQLITE_MAGIC = b"SQLite format 3\x00"
REPORT_SCHEMA = "mooncake-audit/report"
SNAPSHOT_SCHEMA = "mooncake-audit/snapshot"


@dataclass(frozen=True, slots=True)
class NamedKey:
    name: str
    tenant: str | None  # None: the source does not say


def _report_keys(records: Iterable[dict]) -> Iterator[NamedKey]:
    for record in records:
        if isinstance(record, dict) and isinstance(record.get("key"), str):
            yield NamedKey(record["key"], str(record.get("tenant") or DEFAULT_TENANT))


def _snapshot_keys(path: Path) -> Iterator[NamedKey]:
    import sqlite3  # only where a snapshot names keys: a scan without --keys never loads it

    try:
        db = sqlite3.connect(path.resolve().as_uri() + "?mode=ro", uri=True)
        try:
            schema = db.execute("SELECT value FROM meta WHERE name = 'schema'").fetchone()
            if schema is None or json.loads(schema[0]) != SNAPSHOT_SCHEMA:
                raise AuditError(f"--keys {path} is an SQLite file but not a mooncake-audit snapshot")
            names = [row[0] for row in db.execute("SELECT key FROM keys")]
        finally:
            db.close()
    except (sqlite3.Error, ValueError) as error:
        raise AuditError(f"--keys {path}: cannot read the snapshot ({error})") from None
    for stored in names:
        yield NamedKey(bytes(stored).decode("utf-8", "surrogateescape"), None)


def _text_keys(path: Path, text: str) -> Iterator[NamedKey]:
    lines = text.split("\n")
    try:
        first = json.loads(next(line for line in lines if line.strip()))
    except (StopIteration, json.JSONDecodeError):
        first = None
    if isinstance(first, dict) and first.get("schema") == REPORT_SCHEMA:  # a --format json report
        yield from _report_keys(first.get("keys", first.get("findings")) or [])
    elif isinstance(first, dict) and first.get("schema") == REPORT_SCHEMA + "-jsonl":
        try:
            documents = [json.loads(line) for line in lines if line.strip()]
        except json.JSONDecodeError as error:
            raise AuditError(f"--keys {path}: a JSON Lines report line is broken ({error.msg})") from None
        yield from _report_keys(d for d in documents if isinstance(d, dict) and d.get("type") == "key")
    elif isinstance(first, dict):
        raise AuditError(f"--keys {path} holds JSON but is not a mooncake-audit report "
                         f"(the recorder's records go to --block-tables)")
    else:
        yield from (NamedKey(line, None) for line in lines if line)


def read_named_keys(paths: Iterable[Path]) -> list[NamedKey]:
    """Every key the files name, once each, in the order first named."""
    named: dict[NamedKey, None] = {}
    for path in map(Path, paths):
        try:
            with path.open("rb") as file:
                snapshot = file.read(len(SQLITE_MAGIC)) == SQLITE_MAGIC
            keys = (_snapshot_keys(path) if snapshot else
                    _text_keys(path, path.read_bytes().decode("utf-8", "surrogateescape")))
            named.update(dict.fromkeys(keys))
        except OSError as error:
            raise AuditError(f"cannot read --keys {path}: {error.strerror}") from None
    return list(named)


def recorded_keys(tables: BlockTables | None) -> list[NamedKey]:
    """The keys the recorder saw stored (failed and withheld puts are not entries), with their tenant."""
    return [] if tables is None else [NamedKey(entry.key, entry.tenant) for entry in tables.entries.values()]
