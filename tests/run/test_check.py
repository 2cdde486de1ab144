"""`check`, the cron health check, on a real cluster: sampling, new keys, deadline, throttle,
lock, metrics, and resumable scans interrupted by a real SIGINT or SIGTERM."""

from __future__ import annotations

import http.server
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from audit.run.statedir import StateDir
from tests.helpers import run_cli


def _put_many(publisher, namespace, count, size=1000, start=0):
    for i in range(start, start + count):
        publisher.put(f"{namespace}k{i:04d}", bytes([i % 251 + 1]) * size)


def _check(cli_args, namespace, *extra):
    result = run_cli("check", *cli_args, "--prefix", namespace, "--format", "json", "--all", "--no-progress", *extra)
    assert result.exit_code in (0, 1, 3), result.output
    return result.exit_code, json.loads(result.stdout)


def _keys(document):
    return sorted(record["key"] for record in document["keys"])


def test_sampling_is_deterministic_for_a_seed(publisher, cli_args, namespace):
    _put_many(publisher, namespace, 60)
    _, first = _check(cli_args, namespace, "--sample", "10", "--seed", "7")
    _, again = _check(cli_args, namespace, "--sample", "10", "--seed", "7")
    _, other = _check(cli_args, namespace, "--sample", "10", "--seed", "8")
    _, fraction = _check(cli_args, namespace, "--sample", "0.25", "--seed", "7")
    assert len(_keys(first)) == 10 and _keys(first) == _keys(again) and _keys(first) != _keys(other)
    assert len(_keys(fraction)) == 15
    assert first["summary"]["keys_listed"] == 60 and first["summary"]["keys_selected"] == 10
    assert first["summary"]["complete"] is True


def test_state_dir_adds_every_new_key_to_the_sample(publisher, cli_args, namespace, tmp_path):
    _put_many(publisher, namespace, 30)
    state = ["--state-dir", str(tmp_path / "state"), "--sample", "5", "--seed", "1"]
    _, first = _check(cli_args, namespace, *state)
    assert len(first["keys"]) == 30  # the first run has seen nothing: every key is new
    _, second = _check(cli_args, namespace, *state)
    assert len(second["keys"]) == 5
    _put_many(publisher, namespace, 3, start=100)
    _, third = _check(cli_args, namespace, *state)
    new = {f"{namespace}k{i:04d}" for i in range(100, 103)}
    assert new <= set(_keys(third)) and len(third["keys"]) <= 5 + 3
    assert third["summary"]["sample"]["new_keys"] == 3


def test_throttle_holds_the_byte_rate_and_the_deadline_stops_cleanly(publisher, cli_args, namespace):
    _put_many(publisher, namespace, 40, size=100_000)  # 4 MB
    limit = 2_000_000
    code, paced = _check(cli_args, namespace, "--max-bandwidth", str(limit))
    rate = paced["summary"]["bytes_scanned"] / paced["summary"]["duration_s"]
    assert code == 0 and paced["summary"]["keys_scanned"] == 40
    assert 0.8 * limit <= rate <= 1.2 * limit, rate

    started = time.monotonic()
    code, cut = _check(cli_args, namespace, "--max-bandwidth", "1000000", "--deadline", "1")
    elapsed = time.monotonic() - started
    assert code == 3 and cut["summary"]["complete"] is False and "deadline" in cut["summary"]["aborted"]
    assert 0 < cut["summary"]["keys_scanned"] < 40 and elapsed < 4


def test_an_overlapping_run_exits_2(cli_args, namespace, tmp_path):
    holder = StateDir(tmp_path / "state")
    try:
        result = run_cli("check", *cli_args, "--prefix", namespace, "--state-dir", str(tmp_path / "state"))
    finally:
        holder.release()
    assert result.exit_code == 2 and "another check is running" in result.stderr and str(os.getpid()) in result.stderr


def _metrics(path):
    return {sample.name + (str(sorted(sample.labels.items())) if sample.labels else ""): sample.value
            for family in text_string_to_metric_families(path.read_text()) for sample in family.samples}


def test_prom_file_carries_the_numbers_and_keeps_the_last_success(publisher, cli_args, namespace, tmp_path):
    _put_many(publisher, namespace, 8, size=2000)
    publisher.put(namespace + "zero", bytes(2000))
    prom = tmp_path / "mooncake_audit.prom"
    code, report = _check(cli_args, namespace, "--prom-file", str(prom))
    metrics = _metrics(prom)
    assert code == 1
    assert metrics["mooncake_audit_keys_scanned"] == 9 and metrics["mooncake_audit_bytes_scanned"] == 18000
    assert metrics["mooncake_audit_findings"] == 1
    assert metrics["mooncake_audit_verdict_keys[('severity', 'error'), ('verdict', 'ZERO_VALUE')]"] == 1
    assert metrics["mooncake_audit_verdict_keys[('severity', 'error'), ('verdict', 'NULL_BACKED')]"] == 0
    assert metrics["mooncake_audit_severity_keys[('severity', 'error')]"] == 1
    success = metrics["mooncake_audit_last_success_timestamp_seconds"]
    assert abs(success - time.time()) < 60
    # An incomplete run (deadline) rewrites the file but keeps the last success.
    _put_many(publisher, namespace, 20, size=100_000, start=50)
    code, _ = _check(cli_args, namespace, "--prom-file", str(prom), "--max-bandwidth", "500000", "--deadline", "0.5")
    after = _metrics(prom)
    assert after["mooncake_audit_complete"] == 0 and after["mooncake_audit_last_success_timestamp_seconds"] == success
    assert [p.name for p in tmp_path.iterdir()] == [prom.name]  # written atomically: no temporary left


def test_pushgateway_receives_the_metrics(publisher, cli_args, namespace):
    received = []

    class Gateway(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # pushadd_to_gateway: keeps metrics this push does not carry
            received.append((self.path, self.rfile.read(int(self.headers["Content-Length"])).decode()))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            """Quiet: the test reads what was received, not the server's log."""

    server = http.server.HTTPServer(("127.0.0.1", 0), Gateway)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        _put_many(publisher, namespace, 3)
        code, _ = _check(cli_args, namespace, "--pushgateway", f"http://127.0.0.1:{server.server_port}")
    finally:
        server.shutdown()
    assert code == 0 and received[0][0] == "/metrics/job/mooncake_audit"
    assert "mooncake_audit_keys_scanned 3.0" in received[0][1]


def _cli_process(*args):
    code = "from cli import main; import sys; sys.argv = ['mooncake-audit', *sys.argv[1:]]; main()"
    return subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            cwd=os.path.dirname(os.path.dirname(__file__)))


def _interrupted_check(cli_args, namespace, tmp_path):
    """A throttled check (3 MB at 1 MB/s), once a few batches are checkpointed."""
    checkpoint = tmp_path / "scan.ckpt"
    process = _cli_process("check", *cli_args, "--prefix", namespace, "--max-bandwidth", "1000000",
                           "--checkpoint", str(checkpoint), "--format", "jsonl", "--output",
                           str(tmp_path / "first.jsonl"), "--prom-file", str(tmp_path / "audit.prom"),
                           "--no-progress")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (not checkpoint.exists() or checkpoint.read_text().count("\n") < 5):
        time.sleep(0.05)
    return process, checkpoint


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_resume_after_a_signal_reads_each_key_once(publisher, cli_args, namespace, tmp_path, signum):
    _put_many(publisher, namespace, 60, size=50_000)
    interrupted, checkpoint = _interrupted_check(cli_args, namespace, tmp_path)
    interrupted.send_signal(signum)
    assert interrupted.wait(timeout=30) == 3
    first = [json.loads(line) for line in (tmp_path / "first.jsonl").read_text().splitlines()]
    first_keys = {line["key"] for line in first if line["type"] == "key"}
    assert first[-1]["type"] == "summary" and first[-1]["interrupted"] is True and 0 < len(first_keys) < 60
    assert first[-1]["aborted"] == f"{signum.name} received"
    metrics = (tmp_path / "audit.prom").read_text()
    assert f"mooncake_audit_keys_scanned {float(len(first_keys))}" in metrics
    assert "mooncake_audit_exit_code 3.0" in metrics

    result = run_cli("check", *cli_args, "--prefix", namespace, "--checkpoint", str(checkpoint), "--resume",
                     "--format", "jsonl", "--no-progress")
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    second_keys = {line["key"] for line in lines if line["type"] == "key"}
    assert first_keys.isdisjoint(second_keys) and len(first_keys) + len(second_keys) == 60
    summary = lines[-1]
    assert summary["resumed_keys"] == len(first_keys) and summary["keys_scanned"] == 60 and summary["complete"]


def test_a_second_sigterm_ends_the_process_at_once(publisher, cli_args, namespace):
    """After the first SIGTERM a scan stops between batches and writes its report; a process stuck
    meanwhile (here writing records to a pipe nobody reads, as to a full disk) ends at the second."""
    _put_many(publisher, namespace, 1500, size=64)
    process = _cli_process("check", *cli_args, "--prefix", namespace, "--format", "jsonl", "--all", "--no-progress")
    first = process.stdout.read(1000)  # it writes; more than a pipe holds is to come (about 300 B a key)
    time.sleep(0.5)
    process.send_signal(signal.SIGTERM)
    time.sleep(0.2)  # two signals at once would be delivered as one
    assert process.poll() is None and first.startswith(b"{")  # still stuck after the first
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=10) == -signal.SIGTERM


def test_resume_needs_a_checkpoint_and_refuses_another_scans(cli_args, namespace, tmp_path):
    result = run_cli("scan", *cli_args, "--resume")
    assert result.exit_code == 2 and "--checkpoint" in result.stderr
    foreign = tmp_path / "other.ckpt"
    foreign.write_text(json.dumps({"type": "header", "schema": "mooncake-audit/checkpoint", "version": 1,
                                   "scope": {"prefix": "elsewhere"}}) + "\n")
    result = run_cli("scan", *cli_args, "--prefix", namespace, "--checkpoint", str(foreign), "--resume")
    assert result.exit_code == 2 and "belongs to another scan" in result.stderr


@pytest.mark.parametrize("bad", ["0", "-3", "1.5", "lots"])
def test_bad_sample_is_a_clean_error(cli_args, bad):
    result = run_cli("check", *cli_args, "--sample", bad)
    assert result.exit_code == 2 and "--sample" in result.stderr


def test_a_peek_check_leaves_keys_removable_a_lease_scan_does_not(publisher, cli_args, namespace):
    for name in ("peeked", "leased"):
        publisher.put(namespace + name, b"\x05" * 10_000)
    code, peeked = _check(cli_args, namespace + "peeked")
    assert code == 0 and peeked["summary"]["read_mode"] == "peek"
    assert publisher.store.remove(namespace + "peeked", False) == 0  # no lease was taken
    result = run_cli("scan", *cli_args, "--prefix", namespace + "leased", "--format", "json", "--no-progress")
    assert result.exit_code == 0 and json.loads(result.stdout)["summary"]["read_mode"] == "lease"
    assert publisher.store.remove(namespace + "leased", False) == -706  # OBJECT_HAS_LEASE for the TTL


def test_a_peek_scan_reads_by_holder_and_reports_as_a_lease_scan_does(publisher, cli_args, namespace):
    """Peek reads go in holder and address order (audit.readers.order), not the listing's; the
    report is the same as a lease scan's, key for key in listing order, shared groups numbered alike."""
    for i in range(240):
        value = bytes(4096) if i % 17 == 0 else bytes([i % 5 + 1]) * 4096 if i % 3 == 0 else bytes([i % 251 + 1, 9]) * 2048
        publisher.put(f"{namespace}k{i:04d}", value)

    def scan(mode):
        result = run_cli("scan", *cli_args, "--prefix", namespace, "--read-mode", mode, "--format", "json", "--all",
                         "--no-progress")
        assert result.exit_code == 1, result.output
        return json.loads(result.stdout)

    def judged(report):
        return [(r["key"], r["xxh3"], r["verdicts"]) for r in report["keys"]]

    peeked, leased = scan("peek"), scan("lease")
    assert judged(peeked) == judged(leased) and len(judged(peeked)) == 240
    assert [r["key"] for r in peeked["keys"]] != sorted(r["key"] for r in peeked["keys"])  # listing order: a hash's
    assert peeked["shared_groups"] == leased["shared_groups"] and len(peeked["shared_groups"]) >= 5
    assert peeked["summary"]["verdicts"] == leased["summary"]["verdicts"]


def test_peek_reads_confirm_findings_and_report_replica_digests(publisher, cli_args, namespace):
    publisher.put(namespace + "zero", bytes(8192))
    code, report = _check(cli_args, namespace)
    record = report["keys"][0]
    assert code == 1 and record["verdicts"] == ["ZERO_VALUE"]
    assert record["evidence"]["confirmation"]["status"] == "confirmed"
    assert [row["status"] for row in record["evidence"]["replicas"]] == ["ok"]
    assert record["evidence"]["replicas"][0]["xxh3"] == record["xxh3"]


def test_a_run_that_cannot_start_says_so_in_the_prom_file(publisher, cli_args, namespace, tmp_path):
    from audit.cluster import free_port

    publisher.put(namespace + "k", b"\x01" * 100)
    prom = tmp_path / "audit.prom"
    assert _check(cli_args, namespace, "--prom-file", str(prom))[0] == 0
    success = _metrics(prom)["mooncake_audit_last_success_timestamp_seconds"]
    dead = f"127.0.0.1:{free_port()}"
    result = run_cli("check", "--master", dead, "--admin", f"http://{dead}", "--prom-file", str(prom))
    assert result.exit_code == 2
    after = _metrics(prom)
    assert after["mooncake_audit_exit_code"] == 2 and after["mooncake_audit_complete"] == 0
    assert after["mooncake_audit_last_success_timestamp_seconds"] == success
