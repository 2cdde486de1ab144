"""Merging per-key records into one report: a function of its own, so that records produced by
several auditors (each scanning its share of the keys) merge into the same report one auditor
would write. Cross-key verdicts (SHARED_CONTENT, INCOMPLETE_CHUNK, IDENTITY_SUSPECT) are decided
here, never per shard."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable

from audit import __version__
from audit.judge.chunks import ChunkIndex, mark_chunks
from audit.records import KeyRecord, Report, Verdict

SCHEMA = "mooncake-audit/report"
SCHEMA_VERSION = 1
SHARED_EXAMPLES = 5  # other keys named in each SHARED_CONTENT record's evidence


def _shared_groups(records: list[KeyRecord]) -> list[dict]:
    """Groups of distinct keys whose non-zero bytes are identical (same size and XXH3-64)."""
    by_content: dict[tuple[int, int], list[KeyRecord]] = defaultdict(list)
    for record in records:
        if record.xxh3 is not None and record.size and not record.zero:
            by_content[(record.size, record.xxh3)].append(record)
    groups = []
    for (size, digest), members in by_content.items():
        if len(members) < 2:
            continue
        group_id = len(groups)
        names = [member.key for member in members]
        for member in members:
            if Verdict.SHARED_CONTENT not in member.verdicts:
                member.verdicts.append(Verdict.SHARED_CONTENT)
            others = [name for name in names if name != member.key]
            member.evidence["shared_content"] = {
                "group": group_id, "keys_in_group": len(members), "others": others[:SHARED_EXAMPLES]}
        groups.append({"group": group_id, "size": size, "xxh3": f"{digest:016x}", "keys": names})
    return groups


def mark_shared_content(records: list[KeyRecord]) -> list[dict]:
    """Set SHARED_CONTENT on `records` (idempotently: marking twice must not double it); the groups."""
    for record in records:
        if Verdict.SHARED_CONTENT in record.verdicts:
            record.verdicts.remove(Verdict.SHARED_CONTENT)
            record.evidence.pop("shared_content", None)
    return _shared_groups(records)


def exit_code_for(findings: int, incomplete: bool) -> int:
    if findings:
        return 1
    return 3 if incomplete else 0


def merge_records(records: Iterable[KeyRecord], *, context: dict, keys_listed: int,
                  keys_selected: int | None = None, interrupted: bool = False, duration_s: float = 0.0,
                  chunks: ChunkIndex | None = None) -> Report:
    """One report from per-key records; `context` (cluster, options, times) goes into the summary.

    `keys_selected`: how many of the listed keys this run meant to read (a sample); completeness is
    judged against it. `chunks`: every listed key, for the chunk checks (a sample reads only some
    members of a chunk, but the listing has them all); without it, the records' keys.
    """
    keys_selected = keys_listed if keys_selected is None else keys_selected
    records = list(records)
    groups = mark_shared_content(records)
    chunk_summary = mark_chunks(records, chunks)
    verdicts = Counter(v for record in records for v in record.verdicts)
    findings = sum(1 for record in records if record.is_finding)
    unread = sum(1 for record in records if record.is_incomplete)
    read = [record for record in records if record.xxh3 is not None]
    bytes_scanned = sum(record.size or 0 for record in read)
    incomplete = interrupted or unread > 0 or len(records) < keys_selected
    summary = {
        "tool": {"name": "mooncake-audit", "version": __version__},
        **context,
        "keys_listed": keys_listed,
        "keys_selected": keys_selected,
        "keys_scanned": len(read),
        "keys_unread": unread,
        "keys_not_reached": max(keys_selected - len(records), 0),
        "bytes_scanned": bytes_scanned,
        "duration_s": round(duration_s, 3),
        "bytes_per_s": round(bytes_scanned / duration_s) if duration_s > 0 else None,
        "findings": findings,
        "verdicts": dict(sorted(verdicts.items())),
        "shared_groups": len(groups),
        **({"chunks": chunk_summary} if chunk_summary is not None else {}),
        "interrupted": interrupted,
        "complete": not incomplete,
        "exit_code": exit_code_for(findings, incomplete),
    }
    return Report(summary=summary, records=records, shared_groups=groups)


def merge_reports(reports: Iterable[Report], *, context: dict) -> Report:
    """Several shards' reports as one: records concatenated, cross-key verdicts recomputed."""
    reports = list(reports)
    return merge_records(
        (record for report in reports for record in report.records),
        context=context,
        keys_listed=sum(report.summary["keys_listed"] for report in reports),
        keys_selected=sum(report.summary["keys_selected"] for report in reports),
        interrupted=any(report.summary["interrupted"] for report in reports),
        duration_s=max((report.summary["duration_s"] for report in reports), default=0.0),
    )

