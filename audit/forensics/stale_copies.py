"""`purge --stale-disk-copies`: take out of the holders' offload directories the SSD copies that a
report names as listed for no key (`offload.latent`) and unlike the bytes in memory, keeping the key.

Mooncake's bucket backend offloads a key once: a key removed and put again keeps its first value's
copy in its bucket, which the master does not list and a restart of the holder registers again in
place of the bytes in memory (docs/read-modes.md). A copy is taken out only while the master still
lists its key with no disk copy and the copy still holds the bytes the report named; its bytes
are saved first (`audit.forensics.disk_copies.quarantine`). A copy holding the bytes in memory is
left: after a restart it serves the same value.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

import xxhash

from audit.connection import AdminClient, Settings
from audit.errors import AuditError
from audit.forensics.disk_copies import DEFAULT_TENANT, quarantine, value_bytes
from audit.forensics.purge import PurgeOutcome
from audit.judge.crossref import read_report
from audit.readers.buckets import stored_key
from audit.readers.descriptors import query_answers
from audit.readers.offload_index import copies_holding


def stale_copies_of_report(path: Path) -> list[dict]:
    """The report's copies listed for no key that are unlike the bytes in memory."""
    summary, _, _ = read_report(path)
    latent = (summary.get("offload") or {}).get("latent")
    if latent is None:
        raise AuditError(f"{path} reports no offload directory: scan with --offload-dir first")
    if latent["copies"] > len(latent["named"]):
        raise AuditError(f"{path} names {len(latent['named'])} of its {latent['copies']} copies: scan again after "
                         f"taking these out")
    return [row for row in latent["named"] if row["xxh3"] != row["memory_xxh3"]]


def take_out_stale_copies(settings: Settings, rows: Iterable[dict], offload_dirs: tuple[Path, ...], *,
                          execute: bool, evidence_dir: Path | None,
                          on_outcome: Callable[[PurgeOutcome], None]) -> list[PurgeOutcome]:
    """Each named copy: `would-take-out` (a dry run), `taken-out` (with its `disk_copies` rows),
    `listed` (the master lists a disk copy of the key now), `gone` (no directory here holds a copy
    of it), or `changed` (the copy holds other bytes than the report named)."""
    if not offload_dirs:
        raise AuditError("--stale-disk-copies needs --offload-dir (the holder's MOONCAKE_OFFLOAD_FILE_STORAGE_PATH)")
    admin = AdminClient(settings.admin)
    outcomes = []
    for row in rows:
        key = row["key"]
        outcome = PurgeOutcome(key, _action(admin, key, row["xxh3"], offload_dirs), row["xxh3"])
        if outcome.action == "take-out":
            outcome.action = "would-take-out"
            if execute:
                outcome.disk_copies = quarantine(offload_dirs, [key], evidence_dir).get(key, [])
                outcome.action = "taken-out" if outcome.disk_copies else "gone"
        outcomes.append(outcome)
        on_outcome(outcome)
    return outcomes


def _action(admin: AdminClient, key: str, named_xxh3: str, offload_dirs: tuple[Path, ...]) -> str:
    answer = query_answers(admin, [key]).get(key) or {}
    if answer.get("local_disk_values"):
        return "listed"
    copies = [value for values in copies_holding(offload_dirs, {stored_key(DEFAULT_TENANT, key)}).values()
              for value in values]
    if not copies:
        return "gone"
    if any(xxhash.xxh3_64_hexdigest(value_bytes(value)) != named_xxh3 for value in copies):
        return "changed"
    return "take-out"
