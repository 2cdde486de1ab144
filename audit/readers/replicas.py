"""Replica comparison, as a Ceph deep scrub does it: every replica of a key must hold the same bytes.

Only replicas read fine and still listed afterwards ("ok") are compared: one that moved during
the read may hold another value's bytes, one that failed has no digest.
"""

from __future__ import annotations

from audit.records import KeyRecord, Verdict


def judge_replicas(record: KeyRecord, rows: list[dict]) -> None:
    """Add the per-replica rows as evidence; REPLICA_DIVERGENT when two read digests differ and the
    key itself was read (a key MOVED or VANISHED as a whole is not compared). A row read fine
    without a digest of its own holds the very bytes the checks read (the disk reader maps them):
    it takes the record's digest, so those bytes are digested once."""
    if not rows:
        return
    if record.xxh3 is not None:
        for row in rows:
            if row["status"] == "ok" and row["xxh3"] is None:
                row["xxh3"] = f"{record.xxh3:016x}"
    record.evidence["replicas"] = rows
    if len(rows) == 1:  # nearly every key: nothing to compare
        return
    digests = {row["xxh3"] for row in rows if row["status"] == "ok"}
    if record.xxh3 is not None and len(digests) > 1:
        record.verdicts.append(Verdict.REPLICA_DIVERGENT)
        record.evidence["replica_divergent"] = {"digests": sorted(digests),
                                                "replicas_compared": sum(row["status"] == "ok" for row in rows)}


def judge_disk_copy(record: KeyRecord, disk_row: dict) -> None:
    """A key's disk copy (read from its holder's offload files) beside the bytes the key was judged
    by, which came from memory: REPLICA_DIVERGENT when the disk copy was read fine and differs,
    whichever is right. A lease read leaves no replica rows: the bytes judged stand in for memory."""
    rows = record.evidence.setdefault("replicas", [])
    if not rows:
        rows.append({"tier": "memory", "xxh3": f"{record.xxh3:016x}", "status": "ok"})
    rows.append(disk_row)
    if disk_row["status"] != "ok" or disk_row["xxh3"] == f"{record.xxh3:016x}":
        return
    by_tier: dict[str, set[str]] = {}
    for row in rows:
        if row["status"] == "ok":
            by_tier.setdefault(row.get("tier", "memory"), set()).add(row["xxh3"])
    if Verdict.REPLICA_DIVERGENT not in record.verdicts:
        record.verdicts.append(Verdict.REPLICA_DIVERGENT)
    record.evidence["replica_divergent"] = {
        "digests": sorted(set().union(*by_tier.values())),
        "replicas_compared": sum(row["status"] == "ok" for row in rows),
        "tiers": {tier: sorted(digests) for tier, digests in sorted(by_tier.items())}}
