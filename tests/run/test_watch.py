"""`watch`, the continuous scrubber, on a real cluster: new bad keys flagged while it runs and clean
ones never, agreement with `scan`, state kept across kill -9, and a dead holder's keys retried."""

from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
import urllib.request

import pytest
import xxhash
from prometheus_client.parser import text_string_to_metric_families

from audit.cluster import LocalCluster, free_port
from audit.connection import AdminClient
from audit.workload import Publisher
from tests.conftest import settings_for
from tests.helpers import run_cli, scan_json


def _put_clean(publisher, namespace, count, size=1000):
    names = [f"{namespace}clean{i:03d}" for i in range(count)]
    for i, name in enumerate(names):
        publisher.put(name, bytes([i % 251 + 1]) * size)
    return names


class _Watcher:
    def __init__(self, cli_args, namespace, state_dir, *extra):
        self.port = free_port()
        code = "from cli import main; import sys; sys.argv = ['mooncake-audit', *sys.argv[1:]]; main()"
        self.process = subprocess.Popen(
            [sys.executable, "-c", code, "watch", *cli_args, "--prefix", namespace, "--state-dir", str(state_dir),
             "--interval", "0.3", "--listen", f"127.0.0.1:{self.port}", *extra],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))

    def metrics(self) -> dict[str, float]:
        body = urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=2).read().decode()
        values = {}
        for family in text_string_to_metric_families(body):
            for sample in family.samples:
                label = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                values[f"{sample.name}{{{label}}}" if label else sample.name] = sample.value
        return values

    def wait_for(self, condition, timeout_s=20.0) -> dict[str, float]:
        deadline = time.monotonic() + timeout_s
        last = {}
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.process.stderr.read().decode()
            time.sleep(0.1)
            try:
                last = self.metrics()
            except OSError:  # the listener is not up yet
                continue
            if condition(last):
                return last
        raise AssertionError(f"timed out; last metrics: { {k: v for k, v in last.items() if 'watch' in k} }")

    def stop(self, sig=signal.SIGTERM) -> int:
        self.process.send_signal(sig)
        try:
            return self.process.wait(timeout=15)
        finally:
            self.process.stdout.close()
            self.process.stderr.close()


@pytest.fixture
def watchers():
    started: list[_Watcher] = []
    yield lambda *args: started.append(_Watcher(*args)) or started[-1]
    for watcher in started:
        if watcher.process.poll() is None:
            watcher.stop(signal.SIGKILL)


def _verified(state_dir) -> dict[str, float]:
    with sqlite3.connect(state_dir / "watch.sqlite") as db:
        return dict(db.execute("SELECT name, last_verified FROM keys WHERE last_verified IS NOT NULL"))


def test_new_zero_keys_are_flagged_while_watching_and_agree_with_scan(watchers, publisher, cli_args, namespace,
                                                                      tmp_path):
    clean = _put_clean(publisher, namespace, 6)
    watcher = watchers(cli_args, namespace, tmp_path)
    watcher.wait_for(lambda m: m.get("mooncake_audit_watch_keys_verified_within_period") == 6)
    assert watcher.metrics()["mooncake_audit_findings"] == 0
    zeros = [f"{namespace}zero{i}" for i in range(2)]
    for name in zeros:
        publisher.put(name, bytes(4096))
    metrics = watcher.wait_for(lambda m: m.get("mooncake_audit_findings") == 2)
    assert metrics["mooncake_audit_verdict_keys{severity=error,verdict=ZERO_VALUE}"] == 2
    assert metrics["mooncake_audit_severity_keys{severity=error}"] == 2
    assert metrics["mooncake_audit_watch_first_seen_to_verified_seconds_count"] == 8
    assert metrics["mooncake_audit_watch_listing_seconds"] > 0
    assert urllib.request.urlopen(f"http://127.0.0.1:{watcher.port}/healthz", timeout=2).status == 200
    assert watcher.stop() == 0

    found = [json.loads(line) for line in (tmp_path / "findings.jsonl").read_text().splitlines()]
    assert sorted(line["key"] for line in found) == zeros and all(line["verdicts"] == ["ZERO_VALUE"] for line in found)
    code, document = scan_json(cli_args, "--prefix", namespace)
    assert code == 1 and sorted(record["key"] for record in document["findings"]) == zeros
    assert not set(clean) & {line["key"] for line in found}


def test_kill_9_keeps_the_state_and_verified_keys_are_not_read_again(watchers, publisher, cli_args, namespace,
                                                                      tmp_path):
    _put_clean(publisher, namespace, 5)
    first = watchers(cli_args, namespace, tmp_path)
    first.wait_for(lambda m: m.get("mooncake_audit_watch_keys_verified_within_period") == 5)
    first.stop(signal.SIGKILL)
    stamps = _verified(tmp_path)
    assert len(stamps) == 5

    again = watchers(cli_args, namespace, tmp_path)
    metrics = again.wait_for(lambda m: m.get("mooncake_audit_watch_rounds_total", 0) >= 3)
    assert metrics["mooncake_audit_bytes_scanned_total"] == 0
    assert metrics["mooncake_audit_watch_keys_known"] == 5
    assert metrics["mooncake_audit_watch_keys_verified_within_period"] == 5
    assert again.stop() == 0
    assert _verified(tmp_path) == stamps


def test_a_short_period_reads_verified_keys_again(watchers, publisher, cli_args, namespace, tmp_path):
    _put_clean(publisher, namespace, 3)
    watcher = watchers(cli_args, namespace, tmp_path, "--period", "1s")
    watcher.wait_for(lambda m: m.get("mooncake_audit_bytes_scanned_total", 0) >= 3 * 3000)
    assert watcher.metrics()["mooncake_audit_findings"] == 0
    assert watcher.stop() == 0


def test_a_dead_holders_keys_are_unreachable_retried_and_not_flagged(watchers, tmp_path, monkeypatch):
    # A read from a holder that does not answer waits out MC_TRANSFER_TIMEOUT (30 s unless set; 5 s is
    # its minimum), each round, until the master drops the holder: a round may take that long.
    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", "5")
    with LocalCluster(holders=1, segment_mb=64) as own:  # its dead segment must not take other tests' puts
        extra = own.add_holder()
        publisher = Publisher(settings_for(own))
        try:
            names = _put_clean(publisher, "dead/", 30)
        finally:
            publisher.close()
        on_extra = {name for name, answer in AdminClient(own.admin_url).query(names)
                    if any(r.get("transport_endpoint_") == extra.segment for r in answer.get("values") or [])}
        assert on_extra, "no key landed on the extra holder"
        own.kill_holder(extra)
        args = ["--master", own.master_address, "--metadata", own.metadata_url, "--admin", own.admin_url,
                "--local-hostname", "127.0.0.1"]
        watcher = watchers(args, "dead/", tmp_path)
        metrics = watcher.wait_for(lambda m: m.get("mooncake_audit_watch_keys_unreachable", 0) >= 1, timeout_s=60)
        rounds = metrics["mooncake_audit_watch_rounds_total"]
        metrics = watcher.wait_for(lambda m: m["mooncake_audit_watch_rounds_total"] >= rounds + 2, timeout_s=90)
        assert metrics["mooncake_audit_findings"] == 0
        verified = _verified(tmp_path)
        assert set(names) - on_extra <= set(verified) and not on_extra & set(verified)
        assert watcher.stop() == 0
    assert not (tmp_path / "findings.jsonl").exists()


def test_watch_refuses_bad_options_in_one_line(cli_args, tmp_path):
    result = run_cli("watch", *cli_args)
    assert result.exit_code == 2 and "--state-dir" in result.output
    result = run_cli("watch", *cli_args, "--state-dir", str(tmp_path), "--period", "soon")
    assert result.exit_code == 2 and result.output.count("\n") == 1 and "--period" in result.output
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        result = run_cli("watch", *cli_args, "--state-dir", str(tmp_path), "--listen",
                         f"127.0.0.1:{busy.getsockname()[1]}")
    assert result.exit_code == 2 and "cannot listen" in result.output and "Traceback" not in result.output


def test_a_recorder_record_written_while_watching_flags_its_key(watchers, publisher, cli_args, namespace, tmp_path):
    tables = tmp_path / "tables"
    tables.mkdir()
    watcher = watchers(cli_args, namespace, tmp_path / "state", "--block-tables", str(tables))
    _put_clean(publisher, namespace, 2)
    watcher.wait_for(lambda m: m.get("mooncake_audit_watch_keys_verified_within_period") == 2)
    name = f"{namespace}clean001"  # already verified clean: the record makes it read again
    (tables / "rank0.jsonl").write_text(json.dumps({"key": name, "block_ids": [0, 0], "rc": 0}) + "\n")
    metrics = watcher.wait_for(lambda m: m.get("mooncake_audit_findings") == 1)
    assert metrics["mooncake_audit_verdict_keys{severity=error,verdict=NULL_BACKED}"] == 1
    assert watcher.stop() == 0
    found = [json.loads(line) for line in (tmp_path / "state" / "findings.jsonl").read_text().splitlines()]
    assert [(line["key"], line["verdicts"], line["severity"]) for line in found] == [(name, ["NULL_BACKED"], "error")]


def test_an_unreachable_master_is_retried_not_a_crash(watchers, cli_args, tmp_path):
    dead = ["--admin", f"http://127.0.0.1:{free_port()}", *cli_args[:4]]
    watcher = watchers(dead, "none/", tmp_path)
    metrics = watcher.wait_for(lambda m: m.get("mooncake_audit_watch_master_up") == 0, timeout_s=10)
    assert metrics["mooncake_audit_watch_rounds_total"] == 0
    time.sleep(1.5)  # backoff 1 s, then 2 s: still running
    assert watcher.process.poll() is None
    assert watcher.stop() == 0


def test_durations_and_windows_parse_and_wrap_midnight():
    from datetime import datetime

    from audit.errors import AuditError
    from audit.run.watch import in_window, parse_duration, parse_window

    assert [parse_duration(text) for text in ("90", "30s", "15m", "24h", "7d")] == [90, 30, 900, 86400, 604800]
    window = parse_window("22:30-02:00")
    assert in_window(window, datetime(2026, 1, 1, 23, 0)) and in_window(window, datetime(2026, 1, 1, 1, 59))
    assert not in_window(window, datetime(2026, 1, 1, 2, 0)) and in_window(None, datetime(2026, 1, 1))
    for bad in (lambda: parse_duration("soon"), lambda: parse_window("25:00-01:00")):
        with pytest.raises(AuditError):
            bad()


def test_bytes_shared_with_a_key_of_an_earlier_round_flag_both(watchers, publisher, cli_args, namespace, tmp_path):
    value = bytes(range(1, 251)) * 8
    publisher.put(f"{namespace}first", value)
    watcher = watchers(cli_args, namespace, tmp_path)
    watcher.wait_for(lambda m: m.get("mooncake_audit_watch_keys_verified_within_period") == 1)
    publisher.put(f"{namespace}second", value)
    metrics = watcher.wait_for(lambda m: m.get("mooncake_audit_severity_keys{severity=warning}") == 2)
    assert metrics["mooncake_audit_verdict_keys{severity=warning,verdict=SHARED_CONTENT}"] == 2
    assert watcher.stop() == 0
    found = [json.loads(line) for line in (tmp_path / "findings.jsonl").read_text().splitlines()]
    assert sorted(line["key"] for line in found) == [f"{namespace}first", f"{namespace}second"]
    code, document = scan_json(cli_args, "--prefix", namespace, "--fail-on", "warning")
    assert code == 1 and {r["key"] for r in document["findings"]} == {line["key"] for line in found}


def test_a_record_flags_its_key_between_listings(watchers, publisher, cli_args, namespace, tmp_path):
    """With a long --interval the listing cannot be what finds the key: the record round does, from the
    record alone, whether the record comes after the put or before it (the key looked for until it exists)."""
    tables = tmp_path / "tables"
    tables.mkdir()
    _put_clean(publisher, namespace, 2)
    watcher = watchers(cli_args, namespace, tmp_path / "state", "--block-tables", str(tables), "--interval", "60")
    metrics = watcher.wait_for(lambda m: m.get("mooncake_audit_watch_keys_verified_within_period") == 2)
    listings = metrics["mooncake_audit_watch_listings_total"]
    records = tables / "blocks-host-1-0.jsonl"
    after, before = f"{namespace}after", f"{namespace}before"
    publisher.put(after, bytes([7]) * 1000)
    written = time.monotonic()
    with open(records, "a") as handle:
        handle.write(json.dumps({"key": after, "block_ids": [0, 3], "rc": 0}) + "\n")
    metrics = watcher.wait_for(lambda m: m.get("mooncake_audit_findings") == 1, timeout_s=10)
    assert time.monotonic() - written < 5
    with open(records, "a") as handle:  # named before the store holds it: looked for on later slices
        handle.write(json.dumps({"key": before, "block_ids": [0], "rc": 0}) + "\n")
    watcher.wait_for(lambda m: m.get("mooncake_audit_watch_record_keys_pending") == 1, timeout_s=10)
    publisher.put(before, bytes([9]) * 1000)
    metrics = watcher.wait_for(lambda m: m.get("mooncake_audit_findings") == 2, timeout_s=10)
    assert metrics["mooncake_audit_watch_listings_total"] == listings  # no listing in between
    assert metrics["mooncake_audit_watch_record_keys_total"] == 2
    assert metrics["mooncake_audit_verdict_keys{severity=error,verdict=NULL_BACKED}"] == 2
    assert metrics["mooncake_audit_watch_first_seen_to_verified_seconds_count"] == 4
    assert metrics["mooncake_audit_watch_record_keys_pending"] == 0
    assert watcher.stop() == 0
    found = [json.loads(line) for line in (tmp_path / "state" / "findings.jsonl").read_text().splitlines()]
    assert [(line["key"], line["verdicts"]) for line in found] == [(after, ["NULL_BACKED"]), (before, ["NULL_BACKED"])]


@pytest.mark.parametrize("read_mode", ["peek", "lease"])
def test_listings_after_the_first_size_only_new_names_and_reads_size_keys_again(publisher, settings, namespace,
                                                                                 tmp_path, read_mode):
    """The listing of a round takes the last listing's keys from it (`mooncake_audit_watch_keys_sized`
    counts what the master sized); a key due for a re-read is sized again first, so a key put again at
    another size is read at the new one, and a key gone since is forgotten, as with a full listing."""
    import threading

    from audit.run.options import ScanOptions
    from audit.run.stops import StopOnSignals
    from audit.run.watch import FULL_LISTING_EVERY, Watcher, WatchOptions
    from audit.run.watch_state import WatchState

    for i in range(12):
        publisher.put(f"{namespace}k{i:02d}", bytes([i + 1]) * 2000)
    options = WatchOptions(state_dir=tmp_path, interval_s=0.1, period_s=0.001,  # every key due every round
                           scan=ScanOptions(prefix=namespace, read_mode=read_mode))
    watcher = Watcher(settings, options, log=lambda line: None)
    state = WatchState(tmp_path)
    stop, signals = threading.Event(), StopOnSignals()
    try:
        watcher._round(state, stop, signals, 0.1)
        assert watcher.metrics.keys_sized._value.get() == 12 and watcher._last_listing_full
        if read_mode == "peek":  # a lease read's lease keeps a key from being removed for a while
            assert publisher.remove(f"{namespace}k03") == 0
            publisher.put(f"{namespace}k03", b"\x42" * 3000)   # put again, another size
            assert publisher.remove(f"{namespace}k05") == 0     # gone
        publisher.put(f"{namespace}new", b"\x07" * 1500)
        watcher._round(state, stop, signals, 0.1)
        assert watcher.metrics.keys_sized._value.get() == 1 and not watcher._last_listing_full
        stored = {name: (size, digest, verdicts) for name, size, digest, verdicts in state.db.execute(
            "SELECT name, size, digest, verdicts FROM keys")}
        if read_mode == "peek":
            assert f"{namespace}k05" not in stored and len(stored) == 12
            assert stored[f"{namespace}k03"] == (3000, f"{xxhash.xxh3_64_intdigest(b'B' * 3000):016x}", "[]")
        else:
            assert len(stored) == 13
        assert stored[f"{namespace}new"] == (1500, f"{xxhash.xxh3_64_intdigest(bytes([7]) * 1500):016x}", "[]")
        assert all(verdicts == "[]" for _, _, verdicts in stored.values())
        for _ in range(FULL_LISTING_EVERY - 2):
            watcher._round(state, stop, signals, 0.1)
            assert not watcher._last_listing_full
        watcher._round(state, stop, signals, 0.1)  # one listing in FULL_LISTING_EVERY sizes every key
        assert watcher._last_listing_full and watcher.metrics.keys_sized._value.get() == len(stored)
    finally:
        watcher._close_reader()
        state.close()
