"""The shipped Prometheus rules: valid for promtool, and firing on the metrics `check` and `watch`
export (promtool's unit tests; skipped where Debian's prometheus package is not installed)."""

from __future__ import annotations

import copy
import shutil
import subprocess

import pytest
import yaml

from audit.rules import path

promtool = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(promtool is None, reason="promtool not installed (apt-get install prometheus)")

UNIT_TESTS = {
    "evaluation_interval": "1m",
    "tests": [
        {   # a check that found one error, one warning, then went stale and incomplete
            "interval": "1m",
            "input_series": [
                {"series": 'mooncake_audit_severity_keys{severity="error"}', "values": "1x90"},
                {"series": 'mooncake_audit_severity_keys{severity="warning"}', "values": "1x90"},
                {"series": 'mooncake_audit_verdict_keys{verdict="NULL_BACKED",severity="error"}', "values": "1x90"},
                {"series": "mooncake_audit_last_success_timestamp_seconds", "values": "0x90"},
                {"series": "mooncake_audit_complete", "values": "0x90"},
            ],
            "alert_rule_test": [
                {"eval_time": "5m", "alertname": "MooncakeStoreBadKeys",
                 "exp_alerts": [{"exp_labels": {"severity": "critical"}}]},
                {"eval_time": "5m", "alertname": "MooncakeStoreNullBackedKeys",
                 "exp_alerts": [{"exp_labels": {"severity": "critical", "verdict": "NULL_BACKED"}}]},
                {"eval_time": "30m", "alertname": "MooncakeStoreSuspectKeys", "exp_alerts": []},
                {"eval_time": "61m", "alertname": "MooncakeStoreSuspectKeys",
                 "exp_alerts": [{"exp_labels": {"severity": "warning"}}]},
                {"eval_time": "61m", "alertname": "MooncakeAuditCheckStale",
                 "exp_alerts": [{"exp_labels": {"severity": "warning"}}]},
                {"eval_time": "31m", "alertname": "MooncakeAuditCheckIncomplete",
                 "exp_alerts": [{"exp_labels": {"severity": "warning"}}]},
            ],
        },
        {   # a watcher that stopped completing rounds, fell behind its period and left new keys unread
            "interval": "1m",
            "input_series": [
                {"series": "mooncake_audit_watch_last_round_timestamp_seconds", "values": "0x90"},
                {"series": "mooncake_audit_watch_keys_known", "values": "10x90"},
                {"series": "mooncake_audit_watch_keys_not_yet_verified", "values": "2x90"},
                {"series": "mooncake_audit_watch_keys_verified_within_period", "values": "5x90"},
                {"series": "mooncake_audit_watch_disk_copies_not_listed_unlike_memory", "values": "1x90"},
            ],
            "alert_rule_test": [
                {"eval_time": "6m", "alertname": "MooncakeAuditWatchStalled",
                 "exp_alerts": [{"exp_labels": {"severity": "warning"}}]},
                {"eval_time": "11m", "alertname": "MooncakeAuditWatchNewKeysUnverified",
                 "exp_alerts": [{"exp_labels": {"severity": "warning"}}]},
                {"eval_time": "61m", "alertname": "MooncakeAuditWatchBehindPeriod",
                 "exp_alerts": [{"exp_labels": {"severity": "warning"}}]},
                {"eval_time": "30m", "alertname": "MooncakeStoreDiskCopiesNotListed", "exp_alerts": []},
                {"eval_time": "61m", "alertname": "MooncakeStoreDiskCopiesNotListed",
                 "exp_alerts": [{"exp_labels": {"severity": "warning"}}]},
            ],
        },
    ],
}


def _with_annotations(unit_tests: dict) -> dict:
    """promtool compares annotations too: each expected alert gets its rule's, `{{ $value }}` rendered
    from the series its test feeds (the alerts here fire on one value each: 1, or 2 unverified keys)."""
    unit_tests = copy.deepcopy(unit_tests)
    rules = {rule["alert"]: rule for group in yaml.safe_load(path().read_text())["groups"] for rule in group["rules"]}
    value = {"MooncakeAuditWatchNewKeysUnverified": "2"}
    for test in unit_tests["tests"]:
        for case in test["alert_rule_test"]:
            for alert in case["exp_alerts"]:
                alert["exp_annotations"] = {
                    name: text.replace("{{ $value }}", value.get(case["alertname"], "1"))
                    for name, text in rules[case["alertname"]].get("annotations", {}).items()}
    return unit_tests


def test_the_rules_file_ships_and_parses():
    groups = yaml.safe_load(path().read_text())["groups"]
    assert {rule["alert"] for group in groups for rule in group["rules"]} >= {
        "MooncakeStoreBadKeys", "MooncakeAuditCheckStale", "MooncakeAuditWatchStalled"}


@needs_promtool
def test_promtool_checks_and_tests_the_rules(tmp_path):
    checked = subprocess.run([promtool, "check", "rules", str(path())], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tests = tmp_path / "rules_test.yml"
    tests.write_text(yaml.safe_dump({"rule_files": [str(path())], **_with_annotations(UNIT_TESTS)}, sort_keys=False))
    tested = subprocess.run([promtool, "test", "rules", str(tests)], capture_output=True, text=True)
    assert tested.returncode == 0, tested.stdout + tested.stderr
