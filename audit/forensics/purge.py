"""`mooncake-audit purge`: remove flagged keys so producers can publish correct states again (the
vLLM connector never overwrites an existing key), keeping evidence and refusing surprises.

For each target key: read it again without a lease (peek); a key whose bytes changed since the
report is never removed (it is listed as `changed`); otherwise its bytes and a sidecar are saved
as evidence *before* `remove()`; a key leased by a reader (-706) is retried until the lease ends,
or removed at once with `force`. Every outcome is printed and appended to a JSONL log.
Without `execute` (the default: a dry run) nothing is written anywhere.
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
from audit.readers.buffers import plan_batches
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

    def to_json(self) -> dict:
        return {"time": datetime.now(timezone.utc).isoformat(timespec="milliseconds"), "key": self.key,
                "action": self.action, "expected_xxh3": self.expected_xxh3, "current_xxh3": self.current_xxh3,
                "code": self.code, "verdicts": self.verdicts}


def targets_from_report(path: Path, verdicts: Iterable[str] = ()) -> list[KeyRecord]:
    """The report's flagged keys (with `verdicts`, only those carrying one of them)."""
    wanted = set(verdicts)
    unknown = wanted - {str(v) for v in FINDINGS}
    if unknown:
        raise AuditError(f"--verdict {sorted(unknown)[0]} is not a finding verdict")
    _, records, _ = read_report(path)
    return [r for r in records if r.is_finding and r.xxh3 is not None and (not wanted or wanted & set(r.verdicts))]


def _current_reads(settings: Settings, admin: AdminClient, targets: list[KeyRecord], evidence: EvidenceStore | None):
    """Lease-free reads of the targets: {key: (code, xxh3)}; evidence saved from the buffer."""
    from audit.readers.peek import PeekReader

    keys = [KeyInfo(name=t.key, size=t.size) for t in targets]
    by_key = {t.key: t for t in targets}
    current: dict[str, tuple[int, int | None]] = {}
    reader = PeekReader(settings, admin, 2 * max((k.size or 0 for k in keys), default=0) + (32 << 20))
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
          evidence_dir: Path | None = None, lease_wait_s: float = 15.0,
          on_outcome: Callable[[PurgeOutcome], None] = lambda outcome: None) -> list[PurgeOutcome]:
    admin = AdminClient(settings.admin)
    admin.health()
    evidence = EvidenceStore(evidence_dir) if execute and evidence_dir is not None else None
    current = _current_reads(settings, admin, targets, evidence)
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
            outcomes.append(outcome)
            on_outcome(outcome)
    finally:
        if store is not None:
            store.close()
    return outcomes


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
