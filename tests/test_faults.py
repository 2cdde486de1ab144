"""Faults on a real cluster: an unreachable master, a master or holder dying mid-scan.

Each test gets clusters of its own, since it kills parts of them.
"""

from __future__ import annotations

import json
import os
import signal

import jsonschema

from audit.cluster import LocalCluster, free_port
from audit.run.orchestrator import ScanOptions, run_scan
from audit.report.json_report import JsonSink
from audit.workload import Publisher
from tests.conftest import settings_for
from tests.helpers import report_schema, run_cli


class _KillAfter(JsonSink):
    """The JSON sink, plus fault injection once `after` records have been checked."""

    def __init__(self, output, after, kill):
        super().__init__(output, include_all=True)
        self.after, self.kill, self.seen = after, kill, 0

    def record(self, record):
        self.seen += 1
        if self.seen == self.after:
            self.kill()


def _publish(settings, count, size=100_000):
    publisher = Publisher(settings)
    try:
        for i in range(count):
            publisher.put(f"key-{i:04d}", os.urandom(size))
    finally:
        publisher.close()


def test_unreachable_master_exits_2_with_one_line():
    dead = f"127.0.0.1:{free_port()}"
    result = run_cli("scan", "--master", dead, "--admin", f"http://{dead}", "--no-progress")
    assert result.exit_code == 2
    assert result.stderr.count("\n") == 1 and "unreachable" in result.stderr
    assert result.stdout == ""


def test_master_killed_mid_scan_gives_exit_3_and_a_written_report(tmp_path):
    report_path = tmp_path / "report.json"
    with LocalCluster(holders=1, segment_mb=128) as cluster:
        settings = settings_for(cluster)
        _publish(settings, 120)
        sink = _KillAfter(report_path, 10, lambda: os.kill(cluster.master.pid, signal.SIGKILL))
        report = run_scan(settings, ScanOptions(buffer_mb=1), sink)
    assert report.exit_code == 3
    document = json.loads(report_path.read_text())
    jsonschema.validate(document, report_schema())
    summary = document["summary"]
    assert summary["complete"] is False and "master lost" in summary["aborted"]
    assert summary["keys_scanned"] >= 10 and summary["keys_listed"] == 120
    assert summary["keys_scanned"] + summary["keys_unread"] + summary["keys_not_reached"] == 120


def test_holder_killed_mid_scan_gives_unreachable_and_exit_3(tmp_path):
    with LocalCluster(holders=2, segment_mb=128) as cluster:
        settings = settings_for(cluster)
        _publish(settings, 200)
        victim = cluster.running_holders[0]
        sink = _KillAfter(tmp_path / "r.json", 5, lambda: cluster.kill_holder(victim))
        report = run_scan(settings, ScanOptions(buffer_mb=1), sink)
    verdicts = report.summary["verdicts"]
    assert report.exit_code == 3 and verdicts.get("UNREACHABLE", 0) > 0
    assert set(verdicts) <= {"UNREACHABLE", "VANISHED"}
    assert report.summary["findings"] == 0
    # Every key held by the surviving holder was read.
    assert report.summary["keys_scanned"] + sum(verdicts.values()) == 200


def test_wrong_master_port_with_a_live_admin_is_a_clean_error(cluster):
    wrong = f"127.0.0.1:{free_port()}"
    result = run_cli("scan", "--master", wrong, "--admin", cluster.admin_url, "--metadata", cluster.metadata_url,
                     "--no-progress")
    assert result.exit_code == 2
    assert result.stderr.strip() == f"mooncake-audit: error: master {wrong} unreachable: Connection refused"
