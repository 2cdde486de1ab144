"""`watch`'s memory, in SQLite: per key when it was first seen and last verified, its digest and
verdicts. Every round commits, so a restart after SIGTERM, kill -9 or a reboot resumes from the last
round and re-reads nothing verified within the period. An exclusive lock (the cron check's) keeps two
watchers off one directory."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from audit.errors import AuditError
from audit.records import KeyRecord
from audit.run.statedir import StateDir

DATABASE = "watch.sqlite"
FINDINGS_FILE = "findings.jsonl"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS keys (
    name TEXT PRIMARY KEY,
    size INTEGER,
    first_seen REAL NOT NULL,
    last_verified REAL,          -- NULL: never read to a verdict (new, or unreachable so far)
    first_verified REAL,
    digest TEXT,
    verdicts TEXT NOT NULL DEFAULT '[]',
    finding INTEGER NOT NULL DEFAULT 0,
    severity TEXT                -- the worst finding's: error, warning, or NULL
);
CREATE INDEX IF NOT EXISTS keys_by_verification ON keys (last_verified);
"""


@dataclass(frozen=True)
class KeyCounts:
    known: int
    verified_within: int      # verified within the period
    never_verified: int
    oldest_verified: float | None   # the oldest last verification among verified keys
    verdicts: dict[str, int]
    findings: int
    severities: dict[str, int]


class WatchState:
    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self.lock = StateDir(self.directory)  # refuses a second watcher (or a check) on the same directory
        try:
            self.db = sqlite3.connect(self.directory / DATABASE)  # DML opens a transaction; `with self.db` commits it
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=NORMAL")
            self.db.executescript(_SCHEMA)
        except sqlite3.Error as error:
            self.lock.release()
            raise AuditError(f"cannot open watch state {self.directory / DATABASE}: {error}") from None

    def known(self) -> set[str]:
        return {name for (name,) in self.db.execute("SELECT name FROM keys")}

    def add_new(self, sizes: dict[str, int | None], now: float) -> None:
        with self.db:
            self.db.executemany("INSERT OR IGNORE INTO keys (name, size, first_seen) VALUES (?, ?, ?)",
                                [(name, size, now) for name, size in sizes.items()])

    def forget(self, names: Iterable[str]) -> None:
        """Keys the listing no longer shows: gone from the store, so nothing to re-verify."""
        with self.db:
            self.db.executemany("DELETE FROM keys WHERE name = ?", [(name,) for name in names])

    def unverify(self, names: set[str]) -> None:
        """Read these again at once (new evidence about them arrived), whatever their last stamp."""
        if names:
            with self.db:
                self.db.execute("UPDATE keys SET last_verified = NULL WHERE name IN (SELECT value FROM json_each(?))",
                                (json.dumps(sorted(names)),))

    def never_verified(self) -> list[str]:
        """New keys (and keys no read has reached yet), oldest first."""
        return [name for (name,) in self.db.execute(
            "SELECT name FROM keys WHERE last_verified IS NULL ORDER BY first_seen, name")]

    def due(self, before: float, budget_bytes: float | None) -> list[str]:
        """Keys last verified before `before`, oldest first, up to `budget_bytes` of values."""
        names, total = [], 0
        for name, size in self.db.execute("SELECT name, size FROM keys WHERE last_verified < ? "
                                          "ORDER BY last_verified, name", (before,)):
            total += size or 0
            if budget_bytes is not None and names and total > budget_bytes:
                break
            names.append(name)
        return names

    def bytes_before(self, before: float) -> int:
        """The bytes of the keys last verified before `before` (what re-reading them costs)."""
        (total,) = self.db.execute("SELECT SUM(COALESCE(size, 0)) FROM keys WHERE last_verified < ?",
                                   (before,)).fetchone()
        return total or 0

    def first_seen(self, names: Iterable[str]) -> dict[str, float]:
        """When each of `names` never verified before was first seen (the time-to-verdict of new keys)."""
        return dict(self.db.execute("SELECT name, first_seen FROM keys WHERE first_verified IS NULL AND name IN "
                                    "(SELECT value FROM json_each(?))", (json.dumps(list(names)),)))

    def same_content(self, records: list[KeyRecord]) -> list[KeyRecord]:
        """Known keys outside `records` whose digest and size match a non-zero value among them, as
        records with their stored verdicts: the round's merge then sees bytes shared across rounds."""
        wanted = {(f"{r.xxh3:016x}", r.size) for r in records if r.xxh3 is not None and r.zero is False}
        names = {r.key for r in records}
        found = []
        for name, size, digest, verdicts in self.db.execute(
                "SELECT name, size, digest, verdicts FROM keys WHERE digest IN (SELECT value FROM json_each(?))",
                (json.dumps(sorted({digest for digest, _ in wanted})),)):
            if name not in names and (digest, size) in wanted:
                found.append(_stored(name, size, digest, verdicts, zero=False))
        return found

    def stored(self, names: Iterable[str]) -> list[KeyRecord]:
        """The verified keys among `names` as records with their stored digest and verdicts (no read)."""
        return [_stored(*row) for row in self.db.execute(
            "SELECT name, size, digest, verdicts FROM keys WHERE last_verified IS NOT NULL AND name IN "
            "(SELECT value FROM json_each(?))", (json.dumps(sorted(names)),))]

    def verified(self, records: list[KeyRecord], now: float, on_new_findings: Callable[[list[KeyRecord]], None],
                 restamp: bool = True, read_at: dict[str, float] | None = None) -> None:
        """Store the verdicts of records read to a verdict, each stamped when it was read (`read_at`,
        else `now`; `restamp` False: verdicts revised without a read, the stamps stay). The records
        whose findings are new go to `on_new_findings` before the commit: a crash between the two
        repeats them next time rather than losing them."""
        previous = {name: set(json.loads(verdicts)) for name, verdicts in self.db.execute(
            "SELECT name, verdicts FROM keys WHERE name IN (SELECT value FROM json_each(?))",
            (json.dumps([record.key for record in records]),))}
        new_findings = []
        with self.db:
            for record in records:
                if record.is_finding and not set(record.verdicts) <= previous.get(record.key, set()):
                    new_findings.append(record)
                stamp = (read_at or {}).get(record.key, now) if restamp else None
                self.db.execute(
                    "UPDATE keys SET size = ?, last_verified = COALESCE(?, last_verified), "
                    "first_verified = COALESCE(first_verified, ?), digest = ?, verdicts = ?, finding = ?, severity = ? "
                    "WHERE name = ?",
                    (record.size, stamp, stamp,
                     None if record.xxh3 is None else f"{record.xxh3:016x}",
                     json.dumps(sorted(record.verdicts)), int(record.is_finding),
                     None if record.severity is None else str(record.severity), record.key))
            if new_findings:
                on_new_findings(new_findings)

    def counts(self, since: float) -> KeyCounts:
        known, within, never, oldest, findings = self.db.execute(
            "SELECT COUNT(*), SUM(last_verified >= ?), SUM(last_verified IS NULL), MIN(last_verified), SUM(finding) "
            "FROM keys", (since,)).fetchone()
        verdicts: dict[str, int] = {}
        for (text,) in self.db.execute("SELECT verdicts FROM keys WHERE verdicts != '[]'"):
            for verdict in json.loads(text):
                verdicts[verdict] = verdicts.get(verdict, 0) + 1
        severities = dict(self.db.execute("SELECT severity, COUNT(*) FROM keys WHERE severity IS NOT NULL "
                                          "GROUP BY severity"))
        return KeyCounts(known, within or 0, never or 0, oldest, verdicts, findings or 0, severities)

    def close(self) -> None:
        self.db.close()
        self.lock.release()


def _stored(name: str, size: int | None, digest: str | None, verdicts: str, zero: bool | None = None) -> KeyRecord:
    return KeyRecord(key=name, size=size, fields=None, xxh3=None if digest is None else int(digest, 16), zero=zero,
                     verdicts=json.loads(verdicts))
