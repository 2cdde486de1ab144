"""`watch` on a tiered store (issue #41): with `--read-mode peek --offload-dir DIR` it reads the
disk-only keys from the holder's bucket files, lease-free, flags a disk-only value that went bad on
disk, and with `--purged LOG` flags a purged key that a holder restart brought back; and a key held
in memory and on disk whose disk copy changes under a running watcher is REPLICA_DIVERGENT, once.

One offloading holder (bucket backend, eager, buckets of 4), 8 values of 256 KiB, two all zero:
one of them purged (its disk copy left, no `--offload-dir`), another key's disk copy zeroed in its
bucket; then the holder restarts and registers every key from its buckets, disk-only.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
import xxhash

from audit.cluster import LocalCluster
from audit.readers.buckets import stored_key
from audit.readers.offload_index import index_directories
from tests.helpers import run_cli
from tests.readers.test_disk_copies import BUCKET_KEYS, VALUE_BYTES, put_again, cli_args, fill
from tests.run.test_watch import watchers  # noqa: F401  (the fixture)

PURGED, ZERO, WENT_BAD = "tiered/1", "tiered/6", "tiered/3"


def _findings(state_dir) -> dict[str, dict]:
    lines = (state_dir / "findings.jsonl").read_text().splitlines()
    return {line["key"]: line for line in map(json.loads, lines)}


def test_watch_reads_disk_only_keys_from_the_files_and_flags_a_bad_one_and_a_returned_purge(watchers, tmp_path):  # noqa: F811
    with LocalCluster(holders=1, segment_mb=64, offload=True, bucket_keys=BUCKET_KEYS, client_ttl_s=3,
                      log_dir=tmp_path) as cluster:
        values = fill(cluster, "tiered", zero={1, 6})
        holder = cluster.running_holders[0]
        offload_dir = holder.offload_dir

        report = tmp_path / "purged.json"
        scanned = run_cli("scan", *cli_args(cluster), "--prefix", PURGED, "--read-mode", "peek", "--format", "json",
                          "--output", str(report), "--no-progress")
        assert scanned.exit_code == 1, scanned.output
        done = run_cli("purge", str(report), *cli_args(cluster), "--yes", "--evidence", str(tmp_path / "evidence"))
        assert done.exit_code == 3, done.output  # removed; its disk copy remains (no --offload-dir)
        stored = index_directories([offload_dir])[stored_key("default", WENT_BAD)]
        with open(stored.path, "r+b") as bucket:
            os.pwrite(bucket.fileno(), bytes(VALUE_BYTES), stored.value_offset)
        cluster.restart_holder(holder)
        cluster.wait_held(values, "local_disk")  # every key registered again from its bucket, the purged one too
        assert cluster.tiers(values) == {key: {"local_disk"} for key in values}

        watcher = watchers(cli_args(cluster), "tiered/", tmp_path / "state", "--read-mode", "peek",
                           "--offload-dir", str(offload_dir), "--purged", str(tmp_path / "evidence" / "purge-log.jsonl"))
        metrics = watcher.wait_for(lambda m: m.get("mooncake_audit_watch_keys_verified_within_period") == len(values),
                                   timeout_s=60)
        assert metrics["mooncake_audit_findings"] == 3
        assert metrics["mooncake_audit_verdict_keys{severity=error,verdict=ZERO_VALUE}"] == 3
        assert metrics["mooncake_audit_verdict_keys{severity=error,verdict=PURGED_RETURNED}"] == 1
        assert watcher.stop() == 0
        assert cluster.tiers(values) == {key: {"local_disk"} for key in values}  # no lease, no promotion

    found = _findings(tmp_path / "state")
    assert {key: line["verdicts"] for key, line in found.items()} == {
        PURGED: ["ZERO_VALUE", "PURGED_RETURNED"], ZERO: ["ZERO_VALUE"], WENT_BAD: ["ZERO_VALUE"]}
    assert found[PURGED]["evidence"]["purged"]["log"] == str(tmp_path / "evidence" / "purge-log.jsonl")
    assert found[WENT_BAD]["xxh3"] == f"{xxhash.xxh3_64_intdigest(bytes(VALUE_BYTES)):016x}"
    for line in found.values():  # read from the bucket files, where the holder keeps them
        (row,) = line["evidence"]["replicas"]
        assert row["tier"] == "local_disk" and row["status"] == "ok" and row["file"].startswith(str(offload_dir)), row


@pytest.mark.parametrize("backend", ["bucket", "file_per_key"])
def test_watch_flags_a_both_tier_key_whose_disk_copy_changed_once(watchers, tmp_path, backend):  # noqa: F811
    with LocalCluster(holders=1, segment_mb=64, offload=True, bucket_keys=BUCKET_KEYS, backend=backend,
                      log_dir=tmp_path) as cluster:
        values = fill(cluster, "both")  # every key in memory and on disk
        offload_dir = cluster.running_holders[0].offload_dir
        watcher = watchers(cli_args(cluster), "both/", tmp_path / "state", "--read-mode", "peek",
                           "--offload-dir", str(offload_dir))
        watcher.wait_for(lambda m: m.get("mooncake_audit_watch_keys_verified_within_period") == len(values),
                         timeout_s=60)
        rounds = watcher.metrics()["mooncake_audit_watch_rounds_total"]
        watcher.wait_for(lambda m: m["mooncake_audit_watch_rounds_total"] >= rounds + 3)
        assert watcher.metrics()["mooncake_audit_findings"] == 0  # every disk copy compared, all alike

        changed = "both/5"
        stored = index_directories([offload_dir])[stored_key("default", changed)]
        with open(stored.path, "r+b") as stored_file:
            os.pwrite(stored_file.fileno(), b"\xff" * 4096, stored.value_offset + 8192)
        metrics = watcher.wait_for(lambda m: m.get("mooncake_audit_findings") == 1, timeout_s=30)
        assert metrics["mooncake_audit_verdict_keys{severity=error,verdict=REPLICA_DIVERGENT}"] == 1
        time.sleep(2)  # more rounds: the finding is not reported again
        assert watcher.stop() == 0
        assert cluster.tiers(values) == {key: {"memory", "local_disk"} for key in values}  # no lease, no promotion

    (line,) = (tmp_path / "state" / "findings.jsonl").read_text().splitlines()
    found = json.loads(line)
    assert found["key"] == changed and found["verdicts"] == ["REPLICA_DIVERGENT"]
    memory = f"{xxhash.xxh3_64_intdigest(values[changed]):016x}"
    changed_bytes = bytearray(values[changed])
    changed_bytes[8192:8192 + 4096] = b"\xff" * 4096
    disk = f"{xxhash.xxh3_64_intdigest(bytes(changed_bytes)):016x}"
    assert found["evidence"]["replica_divergent"]["tiers"] == {"local_disk": [disk], "memory": [memory]}
    (disk_row,) = [row for row in found["evidence"]["replicas"] if row.get("tier") == "local_disk"]
    assert (disk_row["file"], disk_row["offset"]) == (str(stored.path), stored.value_offset)


def test_watch_names_a_copy_no_master_lists_once_a_key_is_put_again(watchers, tmp_path):  # noqa: F811
    """A key removed and put again with other bytes stays in memory only, its first value's copy
    still in its bucket (the bucket backend offloads a key once); put again on another holder of the
    host, a key is offloaded there and its first copy stays beside the new one. The watcher reads
    each key again at once, names each copy in one log line and two gauges, and flags nothing."""
    with LocalCluster(holders=2, segment_mb=64, offload=True, bucket_keys=1, client_ttl_s=3, log_dir=tmp_path) as cluster:
        values = fill(cluster, "again")
        directories = [holder.offload_dir for holder in cluster.running_holders]
        dirs = [argument for directory in directories for argument in ("--offload-dir", str(directory))]
        watcher = watchers(cli_args(cluster), "again/", tmp_path / "state", "--read-mode", "peek", *dirs,
                           "--period", "1h")
        metrics = watcher.wait_for(lambda m: m.get("mooncake_audit_watch_keys_verified_within_period") == len(values),
                                   timeout_s=60)
        assert metrics["mooncake_audit_watch_disk_copies_not_listed"] == 0
        changed, moved = "again/3", "again/5"
        put_again(cluster, {changed: os.urandom(VALUE_BYTES)})
        put_again(cluster, {moved: os.urandom(VALUE_BYTES)}, holder=1)
        cluster.wait_held([moved], "local_disk")
        metrics = watcher.wait_for(lambda m: m.get("mooncake_audit_watch_disk_copies_not_listed_unlike_memory") == 2,
                                   timeout_s=30)
        assert metrics["mooncake_audit_watch_disk_copies_not_listed"] == 2 and metrics["mooncake_audit_findings"] == 0
        rounds = metrics["mooncake_audit_watch_rounds_total"]
        watcher.wait_for(lambda m: m["mooncake_audit_watch_rounds_total"] >= rounds + 3)  # named once, not again
        watcher.process.send_signal(signal.SIGTERM)
        _, stderr = watcher.process.communicate(timeout=15)
        assert watcher.process.returncode == 0
    named = [line for line in stderr.decode().splitlines() if line.startswith("watch: on disk")]
    index = index_directories(directories)
    stored = index[stored_key("default", changed)]
    (older,), newer = index.superseded[stored_key("default", moved)], index[stored_key("default", moved)]
    assert (older.path.parent, newer.path.parent) == tuple(directories)
    assert sorted(named) == [
        f"watch: on disk beside its key's current copy: {moved} ({older.path} at {older.value_offset}; current: "
        f"{newer.path}), unlike the bytes in memory: served again if its holder restarts once the key has left the store",
        f"watch: on disk but not listed for its key: {changed} ({stored.path} at {stored.value_offset}), "
        "unlike the bytes in memory: a restart of its holder registers it again in their place"]
    assert not (tmp_path / "state" / "findings.jsonl").exists() or \
        (tmp_path / "state" / "findings.jsonl").read_text() == ""
