"""A finding is reported only after a second read saw the same bytes.

A lease-free read can race a removal and re-put at the same address, which no descriptor check
sees: the bytes judged may belong to no one. Verdicts are a function of the bytes (and of the
layout and block tables, which do not change), so equal digests on a second read confirm them;
different digests, or a key moved or gone, turn the finding into MOVED or VANISHED.
"""

from __future__ import annotations

from dataclasses import dataclass

from audit.errors import ERROR_NAMES, MOVED
from audit.records import KeyRecord, Verdict

OBJECT_NOT_FOUND = -704


@dataclass(slots=True)
class KeyRead:
    """One key's outcome: `code` is what `batch_get_into` would say (bytes read, or a negative
    code); `rows` one entry per replica; `xxh3` the digest of the bytes left in the buffer."""

    code: int
    rows: list[dict]
    xxh3: int | None = None


@dataclass(frozen=True, slots=True)
class Confirmation:
    """`status`: confirmed (same bytes), changed (other bytes), moved, vanished, or unreadable
    (the second read failed: the finding stands, unconfirmed)."""

    key: str
    status: str
    second_read: dict

    @property
    def confirmed(self) -> bool:
        return self.status == "confirmed"


def _ok_digests(rows: list[dict]) -> dict[tuple[str, int], str]:
    return {(row["endpoint"], row["address"]): row["xxh3"] for row in rows if row["status"] == "ok"}


def confirmation_of(record: KeyRecord, second: KeyRead) -> Confirmation:
    """Compare a judged record with a second read of its key: the digest of the bytes checked,
    and every replica read fine both times (first read's rows in `evidence["replicas"]`)."""
    summary = {"code": second.code, "xxh3": None if second.xxh3 is None else f"{second.xxh3:016x}",
               "replicas": second.rows}
    if second.code == OBJECT_NOT_FOUND:
        status = "vanished"
    elif second.code == MOVED:
        status = "moved"
    elif second.code < 0:
        status = "unreadable"
    else:
        first_rows = _ok_digests(record.evidence.get("replicas", []))
        second_rows = _ok_digests(second.rows)
        same_replicas = all(second_rows[place] == digest for place, digest in first_rows.items()
                            if place in second_rows)
        status = "confirmed" if second.xxh3 == record.xxh3 and same_replicas else "changed"
    return Confirmation(record.key, status, summary)


def apply_confirmation(record: KeyRecord, confirmation: Confirmation) -> None:
    """Keep a confirmed or unreadable finding (saying which); record any other as MOVED or
    VANISHED, with the first read's verdicts kept as evidence, never as findings."""
    record.evidence["confirmation"] = {"status": confirmation.status, **confirmation.second_read}
    if confirmation.status in ("confirmed", "unreadable"):
        return
    vanished = confirmation.status == "vanished"
    verdict, code = (Verdict.VANISHED, OBJECT_NOT_FOUND) if vanished else (Verdict.MOVED, MOVED)
    record.evidence["unconfirmed_verdicts"] = list(record.verdicts)
    record.verdicts = [verdict]
    record.error = {"code": code, "name": ERROR_NAMES[code],
                    "message": f"a second lease-free read found the key {confirmation.status}"}
    record.xxh3, record.zero, record.regions = None, None, None
