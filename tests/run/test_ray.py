"""`--ray`: the scan on a local Ray instance (2 CPUs) against a loopback cluster of 3 holders gives
the report one process gives; a killed Ray worker is retried, a killed holder or a task lost twice
leaves UNREACHABLE keys (exit 3); without Ray installed, `--ray` is a one-line exit 2."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import jsonschema
import numpy as np
import pytest
import ray

from audit.cluster import LocalCluster
from audit.connection import AdminClient, open_store
from audit.sources.listing import AdminListing
from audit.report.json_report import JsonSink
from audit.run.orchestrator import ScanOptions, run_scan
from audit.run.shards import holder_host, plan_shards
from audit.records import KeyInfo
from audit.workload import Publisher
from tests.conftest import settings_for
from tests.helpers import by_key, report_schema, run_cli

ROOT = Path(__file__).resolve().parents[2]
KEYS = 90


@pytest.fixture(scope="module")
def local_ray():
    """One light Ray instance for the module: no dashboard, a small object store."""
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=80 << 20, log_to_driver=False,
             logging_level="WARNING")
    yield
    ray.shutdown()


def _publish(settings, count: int = KEYS, size: int = 100_000, findings: bool = True) -> None:
    """Random values and, with `findings`, zero values and one value under several keys (which
    land on several holders)."""
    rng = np.random.default_rng(11)
    shared = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
    values = {}
    for i in range(count):
        if findings and i % 15 == 0:
            values[f"key-{i:03d}"] = shared
        elif findings and i % 11 == 0:
            values[f"key-{i:03d}"] = bytes(size)
        else:
            values[f"key-{i:03d}"] = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
    publisher = Publisher(settings)
    try:
        publisher.put_many(values.items())
    finally:
        publisher.close()


@pytest.fixture(scope="module")
def three_holders():
    with LocalCluster(holders=3, segment_mb=64) as cluster:
        _publish(settings_for(cluster))
        yield cluster


def _args(cluster) -> list[str]:
    return ["--master", cluster.master_address, "--metadata", cluster.metadata_url, "--admin", cluster.admin_url,
            "--local-hostname", "127.0.0.1"]


SAME = ("keys_listed", "keys_selected", "keys_scanned", "keys_unread", "keys_not_reached", "bytes_scanned",
        "findings", "verdicts", "shared_groups", "complete", "exit_code")


def _report(*args: str) -> tuple[int, dict]:
    """Exit code and the validated JSON report of a scanning command."""
    result = run_cli(*args, "--format", "json", "--no-progress")
    assert result.exit_code in (0, 1, 3), result.output
    document = json.loads(result.stdout)
    jsonschema.validate(document, report_schema())
    return result.exit_code, document


@pytest.mark.parametrize("command", ["scan", "check"])
def test_ray_report_is_the_single_process_report(local_ray, three_holders, command):
    """Lease reads (`scan`) and lease-free peek reads with their confirmation (`check`)."""
    code, one = _report(command, *_args(three_holders), "--all")
    ray_code, many = _report(command, *_args(three_holders), "--all", "--ray", "local", "--shard-mb", "1")
    assert ray_code == code == 1
    assert by_key(many) == by_key(one)  # every record, verdicts, digests, shared-content evidence
    assert many["shared_groups"] == one["shared_groups"] and len(one["shared_groups"]) == 1
    assert {k: many["summary"][k] for k in SAME} == {k: one["summary"][k] for k in SAME}
    entry = many["summary"]["ray"]
    assert entry["shards"] >= 3 and entry["tasks_lost"] == entry["keys_lost"] == 0
    assert sum(row["tasks"] for row in entry["by_node"]) == entry["shards"]
    # Loopback holders are on the driver's node: every byte was read locally.
    assert sum(row["bytes_local"] for row in entry["by_node"]) == one["summary"]["bytes_scanned"]
    assert sum(row["bytes_remote"] for row in entry["by_node"]) == 0


def test_deadline_and_bandwidth_are_shared_by_the_tasks(local_ray, three_holders):
    """2 task slots at 1 MB/s in all: about 3 MB in 3 s, then every task stops between batches."""
    code, document = _report("check", *_args(three_holders), "--ray", "local", "--shard-mb", "1", "--buffer-mb", "1",
                             "--max-bandwidth", "1000000", "--deadline", "3")
    summary = document["summary"]
    assert code in (1, 3) and summary["interrupted"] and "deadline of 3 s reached" in summary["aborted"]
    assert 0 < summary["bytes_scanned"] <= 5_000_000
    assert summary["keys_scanned"] + summary["keys_unread"] + summary["keys_not_reached"] == KEYS


def _workers() -> list[int]:
    """PIDs of Ray workers running a shard (Ray titles them `ray::scan_shard`)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "cmdline").read_bytes().startswith(b"ray::scan_shard"):
                    found.append(int(entry.name))
            except OSError:
                continue  # the process ended meanwhile
    return found


class _AfterRecords(JsonSink):
    """The JSON sink, plus fault injection once `after` records have arrived."""

    def __init__(self, output, after, act):
        super().__init__(output, include_all=True)
        self.after, self.act, self.seen = after, act, 0

    def record(self, record):
        self.seen += 1
        if self.seen == self.after:
            self.act()


def test_killed_worker_is_retried_and_the_report_is_complete(local_ray, three_holders, tmp_path):
    settings = settings_for(three_holders)
    alone = run_scan(settings, ScanOptions(buffer_mb=1), JsonSink(tmp_path / "alone.json"))
    killed = []

    def kill_the_first_worker():
        """Mid-read: one shard per holder (3 MB) at 2 MB/s per task takes seconds to read."""
        while not (workers := _workers()):
            time.sleep(0.02)
        time.sleep(1.0)
        os.kill(workers[0], signal.SIGKILL)
        killed.append(workers[0])

    killer = threading.Thread(target=kill_the_first_worker)
    killer.start()
    report = run_scan(settings, ScanOptions(buffer_mb=1, ray="local", shard_mb=4, max_bandwidth=4e6),
                      JsonSink(tmp_path / "ray.json"))
    killer.join()
    assert killed and report.summary["ray"]["tasks_retried"] == 1 and report.summary["ray"]["tasks_lost"] == 0
    assert report.summary["complete"] and report.exit_code == alone.exit_code == 1
    assert {r.key: r.to_json() for r in report.records} == {r.key: r.to_json() for r in alone.records}


def test_task_lost_twice_leaves_its_keys_unreachable(local_ray, three_holders, tmp_path):
    done = threading.Event()

    def kill_every_worker():
        while not done.is_set():
            for pid in _workers():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    continue  # already gone
            done.wait(0.05)

    killer = threading.Thread(target=kill_every_worker)
    killer.start()
    try:
        report = run_scan(settings_for(three_holders), ScanOptions(buffer_mb=1, ray="local", shard_mb=4),
                          JsonSink(tmp_path / "r.json"))
    finally:
        done.set()
        killer.join()
    entry = report.summary["ray"]
    lost = [r for r in report.records if r.error and r.error["name"] == "TASK_LOST"]
    assert entry["tasks_lost"] >= 1 and entry["keys_lost"] == len(lost) > 0
    assert all(r.verdicts == ["UNREACHABLE"] for r in lost)
    assert len(report.records) == KEYS and not report.summary["complete"]  # nothing dropped silently


def test_killed_holder_leaves_its_keys_unreachable_and_exit_3(local_ray, tmp_path):
    with LocalCluster(holders=3, segment_mb=64) as cluster:
        settings = settings_for(cluster)
        _publish(settings, count=60, findings=False)  # no finding hides exit 3
        victim = cluster.running_holders[0]
        holder_of = {key.name: key.replicas[0]["endpoint"] for key in AdminListing(AdminClient(cluster.admin_url)).list().keys}
        sink = _AfterRecords(tmp_path / "r.json", 3, lambda: cluster.kill_holder(victim))
        report = run_scan(settings, ScanOptions(buffer_mb=1, ray="local", shard_mb=1, max_bandwidth=4e6), sink)
    verdicts = report.summary["verdicts"]
    assert report.exit_code == 3 and verdicts.get("UNREACHABLE", 0) > 0
    assert set(verdicts) <= {"UNREACHABLE", "VANISHED"}
    unreachable = {r.key for r in report.records if "UNREACHABLE" in r.verdicts}
    assert {holder_of[key] for key in unreachable} == {victim.segment}
    assert report.summary["keys_scanned"] + sum(verdicts.values()) == 60 == len(report.records)


def test_shards_follow_holders_and_stay_within_bounds():
    keys = [KeyInfo(f"k{i}", 400_000, replicas=[{"endpoint": f"10.0.0.{i % 3}:1234{i % 2}"}]) for i in range(30)]
    keys.append(KeyInfo("comma,key", 10))  # sized by the store client: no replica known
    shards = plan_shards(keys, max_bytes=1_000_000)
    assert [s.index for s in shards] == list(range(len(shards)))
    assert all(s.nbytes <= 1_000_000 and {holder_host(k) for k in s.keys} == {s.host} for s in shards)
    assert sorted(k.name for s in shards for k in s.keys) == sorted(k.name for k in keys)
    assert [s.host for s in shards[:4]] == ["10.0.0.0", "10.0.0.1", "10.0.0.2", None]  # holders interleaved
    assert holder_host(KeyInfo("v6", 1, replicas=[{"endpoint": "[fe80::1]:80"}])) == "fe80::1"


def test_without_ray_installed_ray_exits_2_with_one_line(cli_args):
    blocked = "import sys; sys.modules['ray'] = None; sys.argv[0] = 'mooncake-audit'; from cli import main; main()"
    result = subprocess.run([sys.executable, "-c", blocked, "scan", *cli_args, "--ray", "local", "--no-progress"],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.splitlines() == [
        "mooncake-audit: error: --ray needs Ray, which is not installed: pip install 'mooncake-audit[ray]'"]


def test_unreachable_ray_address_exits_2_in_seconds(cli_args):
    result = subprocess.run([sys.executable, "-m", "cli", "scan", *cli_args, "--ray", "127.0.0.1:1", "--no-progress"],
                            cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.splitlines() == ["mooncake-audit: error: Ray at 127.0.0.1:1 unreachable: Connection refused"]


def test_ray_tasks_read_disk_only_keys_from_the_holders_offload_directory(local_ray, tmp_path):
    """On a tiered store (issue #41), `check --read-mode peek --offload-dir DIR --ray`: the Ray task
    placed on the holder's host reads its disk-only keys from the offload files there, lease-free,
    as one process reads them; every zero value flagged, in memory or on disk only."""
    from tests.readers.test_disk_copies import remove
    from tests.readers.test_tiered import _fill

    with LocalCluster(holders=1, segment_mb=32, offload=True, log_dir=tmp_path) as cluster:
        built = _fill(cluster, 0)
        tiers, settled_by = None, time.monotonic() + 30
        while (now := built.by_tiers()) != tiers and time.monotonic() < settled_by:  # eviction runs on a while
            tiers = now
            time.sleep(2)
        disk_only = tiers[("local_disk",)]
        assert len(disk_only) >= 10 and disk_only & built.zero
        offload_dir = cluster.running_holders[0].offload_dir
        code, document = _report("check", *_args(cluster), "--prefix", "tiered/", "--all", "--read-mode", "peek",
                                 "--offload-dir", str(offload_dir), "--ray", "local", "--shard-mb", "8")
        assert code == 1
        records = by_key(document)
        assert {key for key, record in records.items() if record["verdicts"]} == built.zero
        assert all(records[key]["verdicts"] == ["ZERO_VALUE"] for key in built.zero)
        for key in disk_only:  # read from the files, where the holder keeps them
            (row,) = records[key]["evidence"]["replicas"]
            assert row["tier"] == "local_disk" and row["status"] == "ok" and row["file"].startswith(str(offload_dir))
        entry = document["summary"]["ray"]
        assert sum(row["keys"] for row in entry["by_node"]) == len(built.values)  # all read by the Ray tasks
        coverage = document["summary"]["coverage"]
        assert coverage["keys_read"] == len(built.values) and coverage["complete"] is True
        assert coverage["replica_tiers"]["local_disk"]["not_read"] == 0
        assert built.by_tiers() == tiers  # nothing promoted
        store = open_store(settings_for(cluster))
        try:
            remove(store, sorted(disk_only)[0], patience_s=0)  # no lease left: removable at once
        finally:
            store.close()


def test_an_offload_directory_given_with_its_holder_is_refused_with_ray(cli_args, tmp_path):
    result = subprocess.run([sys.executable, "-m", "cli", "scan", *cli_args, "--ray", "local", "--read-mode", "peek",
                             "--offload-dir", f"{tmp_path}=127.0.0.1:9", "--no-progress"],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.splitlines()[-1] == (
        "mooncake-audit: error: --offload-dir DIR=ENDPOINT names one holder's directory, and each host's Ray task "
        "reads DIR of its own holder: give DIR alone with --ray")
