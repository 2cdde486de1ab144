"""Merging per-key records into one report: a function of its own, so that records produced by
several auditors (each scanning its share of the keys) merge into the same report one auditor
would write. Cross-key verdicts (SHARED_CONTENT, INCOMPLETE_CHUNK, IDENTITY_SUSPECT) are decided
here, never per shard."""

from __future__ import annotations

from collections.abc import Iterable

from audit import __version__
from audit.judge.chunks import ChunkIndex, mark_chunks
from audit.judge.coverage import account
from audit.judge.duplicates import Replication, clear_duplicate_verdicts, mark_duplicates
from audit.judge.ledger import RecordLedger
from audit.records import KeyRecord, Report
from audit.sources.census import Census

SCHEMA = "mooncake-audit/report"
SCHEMA_VERSION = 1


FAIL_ON = ("error", "warning")


def exit_code_for(severities: dict[str, int], incomplete: bool, fail_on: str = "error") -> int:
    """1 on errors, or on warnings too with `fail_on="warning"`; else 3 if incomplete, 0 if not."""
    if severities.get("error") or (fail_on == "warning" and severities.get("warning")):
        return 1
    return 3 if incomplete else 0


def merge_records(records: Iterable[KeyRecord] | RecordLedger, *, context: dict, keys_listed: int,
                  keys_selected: int | None = None, interrupted: bool = False, duration_s: float = 0.0,
                  chunks: ChunkIndex | None = None, census: Census | None = None,
                  replication: Replication | None = None, fail_on: str = "error") -> Report:
    """One report from per-key records (a RecordLedger, or any records); `context` (cluster,
    options, times) goes into the summary.

    `keys_selected`: how many of the listed keys this run meant to read (a sample); completeness is
    judged against it. `chunks`: every listed key, for the chunk checks (a sample reads only some
    members of a chunk, but the listing has them all); without it, the records' keys. `census`:
    what the master holds, for the coverage account (a complete report also needs a complete account).
    `replication`: a model config's KV-head replication, for the duplicates its producer writes.
    `fail_on`: the least severity that makes the exit code 1.
    """
    keys_selected = keys_listed if keys_selected is None else keys_selected
    ledger = records if isinstance(records, RecordLedger) else RecordLedger.of(records)
    clear_duplicate_verdicts(ledger.kept())
    candidates = ledger.digest_groups()
    groups, expected = mark_duplicates(candidates, replication, everyone=lambda: iter(ledger))
    chunk_summary = mark_chunks(ledger, candidates, chunks)
    tally = ledger.tally()
    severities = {name: tally.severities.get(name, 0) for name in FAIL_ON}
    not_reached = max(keys_selected - len(ledger), 0)
    coverage = None if census is None else account(census, tally, not_reached=not_reached)
    incomplete = (interrupted or tally.unread > 0 or tally.unjudged > 0 or len(ledger) < keys_selected
                  or (coverage is not None and not coverage["complete"]))
    summary = {
        "tool": {"name": "mooncake-audit", "version": __version__},
        **context,
        "keys_listed": keys_listed,
        "keys_selected": keys_selected,
        "keys_scanned": tally.read,
        "keys_unread": tally.unread,
        "keys_not_fully_judged": tally.unjudged,
        "keys_not_reached": not_reached,
        "bytes_scanned": tally.bytes_scanned,
        "duration_s": round(duration_s, 3),
        "bytes_per_s": round(tally.bytes_scanned / duration_s) if duration_s > 0 else None,
        "findings": tally.findings,
        "severities": severities,
        "fail_on": fail_on,
        "verdicts": dict(sorted(tally.verdicts.items())),
        "shared_groups": len(groups),
        "expected_duplicate_groups": len(expected),
        **({"chunks": chunk_summary} if chunk_summary is not None else {}),
        **({"coverage": coverage} if coverage is not None else {}),
        "interrupted": interrupted,
        "complete": not incomplete,
        "exit_code": exit_code_for(severities, incomplete, fail_on),
    }
    return Report(summary=summary, records=ledger, shared_groups=groups, expected_duplicates=expected)


def merge_reports(reports: Iterable[Report], *, context: dict, fail_on: str = "error") -> Report:
    """Several shards' reports as one: records concatenated, cross-key verdicts recomputed."""
    reports = list(reports)
    return merge_records(
        (record for report in reports for record in report.records),
        context=context,
        keys_listed=sum(report.summary["keys_listed"] for report in reports),
        keys_selected=sum(report.summary["keys_selected"] for report in reports),
        interrupted=any(report.summary["interrupted"] for report in reports),
        duration_s=max((report.summary["duration_s"] for report in reports), default=0.0),
        fail_on=fail_on,
    )

