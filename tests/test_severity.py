"""Each finding's severity (docs/verdicts.md#severity) and the exit code it gives."""

from __future__ import annotations

from audit.judge.merge import exit_code_for
from audit.records import FINDINGS, SEVERITY, KeyRecord, Severity, Verdict


def _record(*verdicts, **evidence) -> KeyRecord:
    return KeyRecord(key="k", size=8, fields={}, verdicts=list(verdicts), evidence=evidence)


def test_every_finding_has_a_severity_and_nothing_else_has_one():
    assert set(SEVERITY) == FINDINGS
    for verdict in set(Verdict) - FINDINGS:
        assert _record(verdict).severity is None


def test_a_record_takes_its_worst_findings_severity():
    assert _record(Verdict.INCOMPLETE_CHUNK).severity is Severity.WARNING
    assert _record(Verdict.SHARED_CONTENT, Verdict.ZERO_VALUE).severity is Severity.ERROR
    assert _record(Verdict.NULL_BACKED).to_json()["severity"] == "error"
    assert "severity" not in _record().to_json()


def test_identity_suspects_are_errors_only_when_the_bytes_show_it():
    assert _record(Verdict.IDENTITY_SUSPECT, identity={"size_outlier": {}}).severity is Severity.WARNING
    assert _record(Verdict.IDENTITY_SUSPECT, identity={"rank_mixup": {}}).severity is Severity.ERROR
    assert _record(Verdict.IDENTITY_SUSPECT, value_identity={}).severity is Severity.ERROR


def test_warnings_fail_the_run_only_when_asked():
    warnings_only = {"error": 0, "warning": 2}
    assert exit_code_for(warnings_only, incomplete=False) == 0
    assert exit_code_for(warnings_only, incomplete=True) == 3
    assert exit_code_for(warnings_only, incomplete=False, fail_on="warning") == 1
    assert exit_code_for({"error": 1, "warning": 0}, incomplete=True) == 1


def test_the_human_headline_follows_the_exit_code(publisher, cli_args, namespace):
    """Identical non-zero bytes under two keys are a warning: the run exits 0 and says so, and
    --fail-on warning makes the same store a failing one."""
    import numpy as np

    from tests.helpers import run_cli

    shared = np.random.default_rng(11).integers(1, 256, 4096, dtype=np.uint8).tobytes()
    publisher.put(namespace + "a", shared)
    publisher.put(namespace + "b", shared)
    warned = run_cli("scan", *cli_args, "--prefix", namespace, "--no-progress")
    assert warned.exit_code == 0, warned.output
    assert warned.stdout.splitlines()[0] == ("NO ERRORS: every key read; 2 key(s) with warnings only "
                                             "(they fail the run with --fail-on warning)")
    failing = run_cli("scan", *cli_args, "--prefix", namespace, "--no-progress", "--fail-on", "warning")
    assert failing.exit_code == 1 and failing.stdout.splitlines()[0] == "FINDINGS: 2 key(s) flagged"
