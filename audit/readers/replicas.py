"""Replica comparison, as a Ceph deep scrub does it: every replica of a key must hold the same bytes.

Only replicas read fine and still listed afterwards ("ok") are compared: one that moved during
the read may hold another value's bytes, one that failed has no digest.
"""

from __future__ import annotations

from audit.records import KeyRecord, Verdict


def judge_replicas(record: KeyRecord, rows: list[dict]) -> None:
    """Add the per-replica rows as evidence; REPLICA_DIVERGENT when two read digests differ and the
    key itself was read (a key MOVED or VANISHED as a whole is not compared)."""
    if not rows:
        return
    record.evidence["replicas"] = rows
    if len(rows) == 1:  # nearly every key: nothing to compare
        return
    digests = {row["xxh3"] for row in rows if row["status"] == "ok"}
    if record.xxh3 is not None and len(digests) > 1:
        record.verdicts.append(Verdict.REPLICA_DIVERGENT)
        record.evidence["replica_divergent"] = {"digests": sorted(digests),
                                                "replicas_compared": sum(row["status"] == "ok" for row in rows)}
