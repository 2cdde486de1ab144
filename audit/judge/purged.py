"""PURGED_RETURNED: a key that `purge --yes` removed, listed again with the bytes it was removed for.

Mooncake's `remove` leaves a key's SSD copy on its holder, and a restarted holder registers it
again (FACTS §11): the purged value comes back under its old name. A purge's log
(`purge-log.jsonl`, one outcome per line) names each key it removed and the digest it held; a
scan given that log (`--purged LOG`) flags every listed key whose bytes are those again. A key
published afresh by its producer holds other bytes and is not flagged.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from audit.errors import AuditError
from audit.records import KeyRecord, Verdict


class PurgedKeys:
    """The keys purge logs say were removed: name -> what the log said (digest, time, log)."""

    def __init__(self, paths: Iterable[Path]):
        self.removed: dict[str, dict] = {}
        for path in map(Path, paths):
            try:
                lines = path.read_text(encoding="utf-8").splitlines()
            except OSError as error:
                raise AuditError(f"cannot read purge log {path}: {error.strerror}") from None
            for number, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                try:
                    outcome = json.loads(line)
                    if outcome["action"] == "removed":
                        self.removed[outcome["key"]] = {"purged_at": outcome["time"], "log": str(path),
                                                        "xxh3": outcome["expected_xxh3"]}
                except (ValueError, KeyError, TypeError):
                    raise AuditError(f"purge log {path}, line {number}: not a purge outcome") from None

    def judge(self, record: KeyRecord) -> None:
        """PURGED_RETURNED when `record` (a default-tenant key read whole) holds the purged bytes."""
        purged = self.removed.get(record.key)
        if purged is None or record.tenant is not None or record.xxh3 is None or purged["xxh3"] != f"{record.xxh3:016x}":
            return
        record.verdicts.append(Verdict.PURGED_RETURNED)
        record.evidence["purged"] = purged
