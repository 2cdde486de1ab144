"""Cron metrics: a node_exporter textfile (written atomically) and/or a Pushgateway push.

`mooncake_audit_last_success_timestamp_seconds` moves only when a run completes (every selected
key read, findings or not); a failed or incomplete run keeps the previous value, so an alert on a
stale last success catches a check that keeps failing.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

from prometheus_client import CollectorRegistry, Gauge, pushadd_to_gateway, write_to_textfile

from audit.errors import AuditError
from audit.judge.coverage import REASONS
from audit.records import FINDINGS, SEVERITY, Report

LAST_SUCCESS = "mooncake_audit_last_success_timestamp_seconds"


def severity_label(verdict: str) -> str:
    """A verdict's severity as a label (IDENTITY_SUSPECT: its worst; the per-key severity is exact)."""
    return str(SEVERITY.get(verdict, "none"))


def _previous_success(prom_file: Path | None) -> float | None:
    if prom_file is None or not prom_file.exists():
        return None
    match = re.search(rf"^{LAST_SUCCESS}\s+(\S+)$", prom_file.read_text(errors="replace"), re.MULTILINE)
    return float(match.group(1)) if match else None


def report_registry(report: Report, previous_success: float | None) -> CollectorRegistry:
    registry = CollectorRegistry()
    summary = report.summary

    def gauge(name: str, help_text: str, value: float) -> None:
        Gauge(f"mooncake_audit_{name}", help_text, registry=registry).set(value)

    gauge("keys_listed", "Keys listed by the last run.", summary["keys_listed"])
    gauge("keys_scanned", "Keys read and checked by the last run.", summary["keys_scanned"])
    gauge("keys_unread", "Keys the last run could not read.", summary["keys_unread"])
    gauge("keys_not_fully_judged", "Keys read whose layout reading was ambiguous and whose verdicts "
          "depended on it (AMBIGUOUS_LAYOUT), last run.", summary.get("keys_not_fully_judged", 0))
    gauge("bytes_scanned", "Bytes read and checked by the last run.", summary["bytes_scanned"])
    gauge("duration_seconds", "Duration of the last run.", summary["duration_s"])
    gauge("findings", "Keys with at least one finding in the last run.", summary["findings"])
    gauge("complete", "1 if the last run read every selected key and audited every key the master holds "
          "(outside a filter or sample).", 1 if summary["complete"] else 0)
    gauge("exit_code", "Exit code of the last run.", summary["exit_code"])
    if "chunks" in summary:
        chunks = Gauge("mooncake_audit_chunks", "Chunks (keys a producer publishes together) by state, last run.",
                       ["state"], registry=registry)
        chunks.labels(state="complete").set(summary["chunks"]["complete"])
        chunks.labels(state="incomplete").set(summary["chunks"]["incomplete"])
        gauge("chunk_members_missing", "Members missing from incomplete chunks in the last run.",
              summary["chunks"]["members_missing"])
    if "coverage" in summary:
        _coverage_gauges(registry, summary["coverage"])
    by_verdict = Gauge("mooncake_audit_verdict_keys", "Keys per verdict in the last run (severity: the verdict's; "
                       "none for what is not a finding).", ["verdict", "severity"], registry=registry)
    for verdict in sorted(FINDINGS):
        by_verdict.labels(verdict=verdict, severity=severity_label(verdict)).set(summary["verdicts"].get(verdict, 0))
    for verdict, count in summary["verdicts"].items():
        by_verdict.labels(verdict=verdict, severity=severity_label(verdict)).set(count)
    by_severity = Gauge("mooncake_audit_severity_keys", "Keys whose worst finding has this severity, last run.",
                        ["severity"], registry=registry)
    for severity, count in summary["severities"].items():
        by_severity.labels(severity=severity).set(count)
    success = time.time() if summary["complete"] else previous_success
    if success is not None:
        Gauge(LAST_SUCCESS, "When a run last read every selected key.", registry=registry).set(success)
    return registry


def _coverage_gauges(registry: CollectorRegistry, coverage: dict) -> None:
    """The coverage account (docs/coverage.md): counts, gaps by reason, tenants, unread replicas."""
    keys = Gauge("mooncake_audit_coverage_keys", "Keys the master held, the listing showed, key sources named in "
                 "other tenants, and the last run read.", ["count"], registry=registry)
    for count in ("held", "listed", "named", "read"):
        value = coverage[f"keys_{count}"]
        if value is not None:
            keys.labels(count=count).set(value)
    gaps = Gauge("mooncake_audit_keys_not_audited", "Keys known to exist that the last run did not audit, by reason "
                 "(blocking: they keep the run from being complete).", ["reason", "blocking"], registry=registry)
    found = {gap["reason"]: gap for gap in coverage["not_audited"]}
    for reason, blocking in REASONS.items():
        if reason == "replicas_not_read":
            continue  # replicas, not keys: mooncake_audit_replicas_not_read
        gaps.labels(reason=reason, blocking=str(blocking).lower()).set(found.get(reason, {}).get("keys") or 0)
    if coverage["tenants"] is not None:
        tenants = Gauge("mooncake_audit_tenant_keys_read", "Keys the last run read, per Mooncake tenant.", ["tenant"],
                        registry=registry)
        charged = Gauge("mooncake_audit_tenant_charged_bytes", "Bytes the master charged each tenant at the start "
                        "of the last run.", ["tenant"], registry=registry)
        for tenant in coverage["tenants"]:
            tenants.labels(tenant=tenant["name"]).set(tenant["keys_read"])
            charged.labels(tenant=tenant["name"]).set(tenant["charged_bytes"])
    replicas = Gauge("mooncake_audit_replicas_not_read", "Replicas of the keys the last run selected that no read "
                     "reached, per tier.", ["tier"], registry=registry)
    for tier, row in (coverage["replica_tiers"] or {}).items():
        replicas.labels(tier=tier).set(row["not_read"])


def failure_registry(previous_success: float | None) -> CollectorRegistry:
    """A run that could not start (exit 2): say so, and keep the last success where it was."""
    registry = CollectorRegistry()
    Gauge("mooncake_audit_complete", "1 if the last run read every selected key.", registry=registry).set(0)
    Gauge("mooncake_audit_exit_code", "Exit code of the last run.", registry=registry).set(2)
    if previous_success is not None:
        Gauge(LAST_SUCCESS, "When a run last read every selected key.", registry=registry).set(previous_success)
    return registry


def export_metrics(report: Report | None, prom_file: Path | None, pushgateway: str | None,
                   job: str = "mooncake_audit") -> None:
    """The run's metrics; `report` None: the run could not start."""
    previous = _previous_success(prom_file)
    registry = failure_registry(previous) if report is None else report_registry(report, previous)
    try:
        if prom_file is not None:
            write_to_textfile(str(prom_file), registry)
        if pushgateway is not None:
            pushadd_to_gateway(pushgateway, job=job, registry=registry)  # keeps an older last success
    except OSError as error:
        raise AuditError(f"cannot export metrics: {error}") from None
