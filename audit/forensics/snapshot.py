"""`snapshot --output FILE`: every key's and region's digests, verdicts and parsed fields, written
to an SQLite file as the scan checks them, so that later scans can be compared with this one
(`diff`). Why SQLite, and the schema: docs/snapshots.md.

Memory stays bounded: each record is inserted as it arrives and committed every COMMIT_EVERY keys;
the sink keeps no records. The file is built under a temporary name beside FILE and renamed over
it by `finish`, so FILE is either the previous snapshot or a complete new one.
"""

from __future__ import annotations

import json
import os
import sqlite3
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from audit import __version__
from audit.errors import AuditError
from audit.records import KeyRecord, Report, Verdict
from audit.report.output import check_writable

SCHEMA = "mooncake-audit/snapshot"
SCHEMA_VERSION = 1
COMMIT_EVERY = 2000  # keys per transaction: few commits, and little lost work if the scan dies

_TABLES = """
CREATE TABLE meta (name TEXT PRIMARY KEY, value TEXT NOT NULL) WITHOUT ROWID;
CREATE TABLE keys (
    id INTEGER PRIMARY KEY,
    key BLOB NOT NULL UNIQUE,   -- the exact name as UTF-8 (surrogateescape: undecodable bytes kept)
    size INTEGER,
    xxh3 TEXT,                  -- XXH3-64 of the whole value, 16 hex digits as in the JSON report
    zero INTEGER,
    verdicts TEXT NOT NULL,     -- JSON list, sorted
    fields TEXT NOT NULL,       -- JSON: the parsed key
    layout TEXT,
    error TEXT,                 -- JSON, for keys that could not be read
    evidence TEXT NOT NULL,     -- JSON, without the replica rows (column replicas)
    replicas TEXT,              -- JSON list of replica rows (endpoint, ...), when the scan had them
    shape INTEGER,              -- shapes.shape of the key's regions; NULL: no regions
    shared_group INTEGER,       -- shared_groups.grp, for SHARED_CONTENT keys
    scanned_at INTEGER NOT NULL -- unix seconds
);
CREATE TABLE shapes (
    shape INTEGER, idx INTEGER, segment TEXT, layer INTEGER, region TEXT, kind TEXT,
    offset INTEGER, length INTEGER, dtype TEXT,
    PRIMARY KEY (shape, idx)
) WITHOUT ROWID;
CREATE TABLE region_results (
    key_id INTEGER, idx INTEGER,
    xxh3_i64 INTEGER NOT NULL,  -- XXH3-64 as a signed 64-bit integer (SQLite has no unsigned)
    zero INTEGER, nan INTEGER, inf INTEGER,
    PRIMARY KEY (key_id, idx)
) WITHOUT ROWID;
CREATE TABLE shared_groups (grp INTEGER PRIMARY KEY, size INTEGER, xxh3 TEXT, keys INTEGER);
CREATE VIEW regions AS
    SELECT k.key, r.idx, s.segment, s.layer, s.region, s.kind, s.offset, s.length, s.dtype,
           printf('%016x', r.xxh3_i64) AS xxh3, r.zero, r.nan, r.inf
    FROM region_results AS r
    JOIN keys AS k ON k.id = r.key_id
    JOIN shapes AS s ON s.shape = k.shape AND s.idx = r.idx;
"""

_GEOMETRY = ("segment", "layer", "region", "kind", "offset", "length", "dtype")


def key_bytes(key: str) -> bytes:
    """Keys are stored as BLOBs: listing decodes undecodable bytes as surrogates, which TEXT refuses."""
    return key.encode("utf-8", "surrogateescape")


def key_text(stored: bytes) -> str:
    return stored.decode("utf-8", "surrogateescape")


def signed64(digest: int) -> int:
    return digest - (1 << 64) if digest >= 1 << 63 else digest


CROSS_KEY = frozenset({Verdict.SHARED_CONTENT, Verdict.INCOMPLETE_CHUNK, Verdict.IDENTITY_SUSPECT})  # known at merge


def _json(value) -> str:
    return json.dumps(value, separators=(",", ":"))


def _now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


class SnapshotSink:
    """The Sink of `snapshot`. Use it as a context manager: leaving the block without `finish`
    (the scan failed) removes the temporary file and leaves FILE as it was."""

    def __init__(self, path: Path):
        self.path = Path(path)
        if self.path.exists() and not self.path.is_file():
            raise AuditError(f"cannot write snapshot {self.path}: not a regular file")
        check_writable(self.path)
        fd, temp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".partial",
                                    dir=self.path.parent)
        os.close(fd)
        self._temp: Path | None = Path(temp)
        # No journal, no syncs: the temporary file is thrown away if anything fails; one fsync
        # before the rename makes the finished file durable.
        self._db = sqlite3.connect(temp)
        self._db.execute("PRAGMA journal_mode = OFF")
        self._db.execute("PRAGMA synchronous = OFF")
        self._db.executescript(_TABLES)
        self._set_meta(schema=SCHEMA, version=SCHEMA_VERSION, created_at=_now_iso(),
                       tool={"name": "mooncake-audit", "version": __version__})
        self._shapes: dict[tuple, int] = {}   # region geometry -> shape id: one per layout in use
        self._uncommitted = 0

    def __enter__(self) -> SnapshotSink:
        return self

    def __exit__(self, *exc_info) -> None:
        self.discard()

    def record(self, record: KeyRecord) -> None:
        self._insert(record, int(time.time()))
        self._uncommitted += 1
        if self._uncommitted >= COMMIT_EVERY:
            self._db.commit()
            self._uncommitted = 0

    def finish(self, report: Report) -> None:
        """Add what only the merged report knows (cross-key verdicts, the summary) and publish FILE."""
        stored = self._db.execute("SELECT count(*) FROM keys").fetchone()[0]
        if stored < len(report.records):  # records the scan never streamed: resumed, or gone before sizing
            finished_at = int(time.time())
            for record in report.records:
                self._insert(record, finished_at)
        self._db.executemany("INSERT INTO shared_groups VALUES (?, ?, ?, ?)",
                             [(g["group"], g["size"], g["xxh3"], len(g["keys"])) for g in report.shared_groups])
        self._db.executemany(
            "UPDATE keys SET verdicts = ?, evidence = ?, shared_group = ? WHERE key = ?",
            ((_json(sorted(r.verdicts)), _json(_evidence(r)), (r.evidence.get("shared_content") or {}).get("group"),
              key_bytes(r.key))
             for r in report.records if CROSS_KEY.intersection(r.verdicts)))
        self._set_meta(cluster=report.summary.get("cluster"), summary=report.summary)
        self._db.commit()
        self._db.close()
        with open(self._temp, "rb+") as written:
            os.fsync(written.fileno())
        os.replace(self._temp, self.path)
        self._temp = None

    def discard(self) -> None:
        """Drop an unfinished snapshot (no-op after `finish`)."""
        if self._temp is None:
            return
        self._db.close()
        self._temp.unlink(missing_ok=True)
        self._temp = None

    def _set_meta(self, **values) -> None:
        self._db.executemany("INSERT OR REPLACE INTO meta VALUES (?, ?)",
                             [(name, _json(value)) for name, value in values.items()])

    def _insert(self, record: KeyRecord, scanned_at: int) -> None:
        """One key's row and its region rows; a key already stored keeps its first record."""
        regions = record.regions or []
        shape = self._shape_of(regions) if regions else None
        cursor = self._db.execute(
            "INSERT INTO keys (key, size, xxh3, zero, verdicts, fields, layout, error, evidence, replicas, shape, "
            "scanned_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (key) DO NOTHING",
            (key_bytes(record.key), record.size, None if record.xxh3 is None else f"{record.xxh3:016x}",
             record.zero, _json(sorted(record.verdicts)), _json(record.parsed_fields()), record.layout,
             None if record.error is None else _json(record.error), _json(_evidence(record)),
             _replicas(record), shape, scanned_at))
        if cursor.rowcount and regions:
            self._db.executemany(
                "INSERT INTO region_results VALUES (?, ?, ?, ?, ?, ?)",
                [(cursor.lastrowid, idx, signed64(int(r["xxh3"], 16)), r["zero"], r["nan"], r["inf"])
                 for idx, r in enumerate(regions)])

    def _shape_of(self, regions: list[dict]) -> int:
        geometry = tuple(tuple(region[name] for name in _GEOMETRY) for region in regions)
        shape = self._shapes.get(geometry)
        if shape is None:
            shape = self._shapes[geometry] = len(self._shapes)
            self._db.executemany("INSERT INTO shapes VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                                 [(shape, idx, *row) for idx, row in enumerate(geometry)])
        return shape


def _replicas(record: KeyRecord) -> str | None:
    """The record's replica rows: a `replicas` field if records carry one, else the replica reader's
    evidence; NULL when the scan did not look at replicas."""
    rows = getattr(record, "replicas", None) or record.evidence.get("replicas")
    return _json(rows) if rows else None


def _evidence(record: KeyRecord) -> dict:
    return {name: value for name, value in record.evidence.items() if name != "replicas"}


class Snapshot:
    """A snapshot opened read-only, its schema checked: `meta` decoded, `keys` counted."""

    def __init__(self, path: Path, db: sqlite3.Connection, meta: dict, keys: int):
        self.path = path
        self.db = db
        self.meta = meta
        self.keys = keys

    def __enter__(self) -> Snapshot:
        return self

    def __exit__(self, *exc_info) -> None:
        self.db.close()


def read_only_uri(path: Path) -> str:
    return Path(path).resolve().as_uri() + "?mode=ro"


def open_snapshot(path: Path) -> Snapshot:
    """Open a snapshot file, or raise a one-line AuditError saying why it is not one."""
    path = Path(path)
    if not path.is_file():
        raise AuditError(f"cannot read snapshot {path}: {'not a regular file' if path.exists() else 'no such file'}")
    db = sqlite3.connect(read_only_uri(path), uri=True)
    try:
        meta = {name: json.loads(value) for name, value in db.execute("SELECT name, value FROM meta")}
        problem = _meta_problem(meta)
        keys = None if problem else db.execute("SELECT count(*) FROM keys").fetchone()[0]
    except (sqlite3.Error, ValueError, TypeError) as error:
        problem = f"is not a readable mooncake-audit snapshot ({error})"
    if problem:
        db.close()
        raise AuditError(f"{path} {problem}")
    return Snapshot(path, db, meta, keys)


def _meta_problem(meta: dict) -> str | None:
    if meta.get("schema") != SCHEMA:
        return "is not a mooncake-audit snapshot"
    if meta.get("version") != SCHEMA_VERSION:
        return f"is a snapshot of version {meta.get('version')!r}; this mooncake-audit reads version {SCHEMA_VERSION}"
    if not isinstance(meta.get("summary"), dict):
        return "is an unfinished snapshot (no summary)"
    return None
