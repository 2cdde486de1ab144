"""`mooncake-audit purge`: remove flagged keys so producers can publish correct states again (the
vLLM connector never overwrites an existing key), keeping evidence and refusing surprises.

For each target key: read it again without a lease (peek); a key whose bytes changed since the
report is never removed (it is listed as `changed`); otherwise its bytes and a sidecar are saved
as evidence *before* `remove()`; a key leased by a reader (-706) is retried until the lease ends,
or removed at once with `force`. Every outcome is printed and appended to a JSONL log.
Without `execute` (the default: a dry run) nothing is written anywhere.

`remove()` leaves a key's SSD copy on its holder, which a restart registers again. With the
holders' offload directories (`offload_dirs`, on this host), a disk-only key is read from its
bucket file, and every copy of a removed (or already gone) key is taken out of them
(`audit.forensics.disk_copies`); a key the master described with a disk replica that no given
directory holds is said to remain (`disk_copies: [{"how": "remains", ...}]`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from audit.connection import AdminClient, Settings, open_store
from audit.judge.crossref import read_report
from audit.errors import AuditError
from audit.errors import NOT_PEEKABLE
from audit.forensics.disk_copies import quarantine
from audit.readers.buffers import plan_batches
from audit.readers.descriptors import query_answers
from audit.forensics.evidence import EvidenceStore
from audit.records import FINDINGS, KeyInfo, KeyRecord

OBJECT_NOT_FOUND, OBJECT_HAS_LEASE = -704, -706
LEASE_RETRY_S = 1.0


@dataclass
class PurgeOutcome:
    key: str
    action: str      # would-remove | removed | changed | gone | leased | unreadable | error
    expected_xxh3: str | None
    current_xxh3: str | None = None
    code: int | None = None
    verdicts: list[str] = field(default_factory=list)
    disk_copies: list[dict] | None = None  # its SSD copies taken out, or one row saying a copy remains

    @property
    def disk_copy_remains(self) -> bool:
        return any(copy["how"] == "remains" for copy in self.disk_copies or ())

    def to_json(self) -> dict:
        return {"time": datetime.now(timezone.utc).isoformat(timespec="milliseconds"), "key": self.key,
                "action": self.action, "expected_xxh3": self.expected_xxh3, "current_xxh3": self.current_xxh3,
                "code": self.code, "verdicts": self.verdicts,
                **({"disk_copies": self.disk_copies} if self.disk_copies is not None else {})}


def targets_from_report(path: Path, verdicts: Iterable[str] = ()) -> list[KeyRecord]:
    """The report's flagged keys (with `verdicts`, only those carrying one of them)."""
    wanted = set(verdicts)
    unknown = wanted - {str(v) for v in FINDINGS}
    if unknown:
        raise AuditError(f"--verdict {sorted(unknown)[0]} is not a finding verdict")
    _, records, _ = read_report(path)
    return [r for r in records if r.is_finding and r.xxh3 is not None and (not wanted or wanted & set(r.verdicts))]


def _current_reads(settings: Settings, admin: AdminClient, targets: list[KeyRecord], evidence: EvidenceStore | None,
                   offload_dirs: tuple[Path, ...] = ()):
    """Lease-free reads of the targets: {key: (code, xxh3)}; evidence saved from the buffer. Keys
    with no memory replica are read from the offload directories, when given."""
    from audit.readers.disk import DiskReader
    from audit.readers.peek import PeekReader

    keys = [KeyInfo(name=t.key, size=t.size) for t in targets]
    buffer_bytes = 2 * max((k.size or 0 for k in keys), default=0) + (32 << 20)
    current = _read_with(PeekReader(settings, admin, buffer_bytes), keys, targets, evidence)
    on_disk_only = [key for key in keys if current[key.name][0] == NOT_PEEKABLE]
    if offload_dirs and on_disk_only:
        current.update(_read_with(DiskReader(admin, offload_dirs, buffer_bytes), on_disk_only, targets, evidence))
    return current


def _read_with(reader, keys: list[KeyInfo], targets: list[KeyRecord], evidence: EvidenceStore | None):
    by_key = {t.key: t for t in targets}
    current: dict[str, tuple[int, int | None]] = {}
    try:
        for turn, slots in enumerate(plan_batches(keys, reader.capacity)):
            batch = reader.fetch(slots, turn)
            codes = list(batch.results)
            views = {slot.key.name: batch.view(slot, slot.key.size) for slot, code in zip(slots, codes)
                     if code == slot.key.size}
            if evidence is not None:  # before anything else can happen to the keys
                for slot in slots:
                    record = by_key[slot.key.name]
                    if slot.key.name in views and record.xxh3 == _digest(views[slot.key.name]):
                        evidence.save(slot.key, record, views[slot.key.name], "purge")
            for slot, code in zip(slots, codes):
                current[slot.key.name] = (code, _digest(views[slot.key.name]) if slot.key.name in views else None)
            batch.release()
    finally:
        reader.close()
    return current


def _digest(view) -> int:
    import xxhash

    return xxhash.xxh3_64_intdigest(view)


def purge(settings: Settings, targets: list[KeyRecord], *, execute: bool, force: bool = False,
          evidence_dir: Path | None = None, lease_wait_s: float = 15.0, offload_dirs: tuple[Path, ...] = (),
          on_outcome: Callable[[PurgeOutcome], None] = lambda outcome: None) -> list[PurgeOutcome]:
    admin = AdminClient(settings.admin)
    admin.health()
    evidence = EvidenceStore(evidence_dir) if execute and evidence_dir is not None else None
    disk_endpoints = _disk_endpoints(admin, [target.key for target in targets])
    current = _current_reads(settings, admin, targets, evidence, offload_dirs)
    outcomes = []
    store = open_store(settings) if execute else None
    try:
        for target in targets:
            code, digest = current.get(target.key, (OBJECT_NOT_FOUND, None))
            outcome = PurgeOutcome(target.key, "would-remove", f"{target.xxh3:016x}",
                                   None if digest is None else f"{digest:016x}", None, list(target.verdicts))
            if code == OBJECT_NOT_FOUND:
                outcome.action, outcome.code = "gone", code
            elif code < 0 or digest is None:
                outcome.action, outcome.code = "unreadable", code
            elif digest != target.xxh3:
                outcome.action = "changed"
            elif store is not None:
                outcome.code = _remove(store, target.key, force, lease_wait_s)
                outcome.action = {0: "removed", OBJECT_NOT_FOUND: "gone", OBJECT_HAS_LEASE: "leased"}.get(
                    outcome.code, "error")
            if store is not None and outcome.action in ("removed", "gone"):
                outcome.disk_copies = _take_out_disk_copies(admin, target.key, offload_dirs, evidence_dir,
                                                            disk_endpoints.get(target.key))
            outcomes.append(outcome)
            on_outcome(outcome)
    finally:
        if store is not None:
            store.close()
    return outcomes


def _disk_endpoints(admin: AdminClient, names: list[str]) -> dict[str, str | None]:
    """The keys the master describes with an SSD copy, each with its holder's offload endpoint."""
    return {name: next((copy.get("transport_endpoint") for copy in answer["local_disk_values"]), None)
            for name, answer in query_answers(admin, names).items() if answer.get("local_disk_values")}


def _take_out_disk_copies(admin: AdminClient, key: str, offload_dirs: tuple[Path, ...], evidence_dir: Path | None,
                          endpoint: str | None) -> list[dict] | None:
    """The key's SSD copies taken out of `offload_dirs` once the master no longer lists it; a row
    saying one remains when the master had described one that no directory here holds."""
    taken = []
    if offload_dirs and evidence_dir is not None and _gone(admin, key):
        taken = quarantine(offload_dirs, [key], evidence_dir).get(key, [])
    if taken or endpoint is None:
        return taken or None
    return [{"how": "remains", "endpoint": endpoint}]


def _gone(admin: AdminClient, key: str) -> bool:
    """Whether the master no longer knows `key` (one put again meanwhile keeps its disk copy; one
    holding a comma cannot be asked for, and keeps it too)."""
    answer = query_answers(admin, [key]).get(key)
    return answer is not None and answer.get("error") == "OBJECT_NOT_FOUND"


def _remove(store, key: str, force: bool, lease_wait_s: float) -> int:
    """0 when removed; a reader's lease is waited out (up to `lease_wait_s`) unless `force`."""
    if force:
        return store.remove(key, True)
    deadline = time.monotonic() + lease_wait_s
    while True:
        code = store.remove(key, False)
        if code != OBJECT_HAS_LEASE or time.monotonic() >= deadline:
            return code
        time.sleep(LEASE_RETRY_S)


def write_log(path: Path, outcomes: Iterable[PurgeOutcome]) -> None:
    with open(path, "a", encoding="utf-8") as log:
        for outcome in outcomes:
            log.write(json.dumps(outcome.to_json()) + "\n")
