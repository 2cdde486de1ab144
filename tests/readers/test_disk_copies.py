"""Every copy compared on a tiered store (issue #41): a key in memory and on its holder's SSD has
its disk copy read from the bucket file (`--offload-dir`) and compared with the memory bytes, and
a value on disk that no master lists (a key removed through Mooncake) is named.

One offloading holder, buckets of 4 keys, 8 values of 256 KiB: every key ends in memory and on disk.
"""

from __future__ import annotations

import json
import os
import time

import pytest
import xxhash

from audit.cluster import LocalCluster
from audit.connection import open_store
from audit.readers.buckets import stored_key
from audit.readers.offload_index import index_directories
from audit.sources.tenants import tenant_key_tiers
from tests.conftest import settings_for
from tests.helpers import by_key, run_cli, scan_json
from tests.readers.test_tiered import _put, put_on_disk

VALUE_BYTES = 256 << 10
KEYS = 8
BUCKET_KEYS = 4
OBJECT_HAS_LEASE = -706


def remove(store, key: str, patience_s: float = 15.0) -> None:
    """The application's remove, once the lease a put leaves has run out."""
    deadline = time.monotonic() + patience_s
    while (rc := store.remove(key)) == OBJECT_HAS_LEASE and time.monotonic() < deadline:
        time.sleep(0.2)
    assert rc == 0, (key, rc)


def fill(cluster: LocalCluster, prefix: str, zero: set[int] = frozenset()) -> dict[str, bytes]:
    """`KEYS` values put on the offloading holder (those at `zero` all zero), once all are on disk too."""
    values = {f"{prefix}/{index}": bytes(VALUE_BYTES) if index in zero else os.urandom(VALUE_BYTES)
              for index in range(KEYS)}
    put_on_disk(cluster, values)
    assert cluster.tiers(values) == {key: {"memory", "local_disk"} for key in values}
    return values


def cli_args(cluster: LocalCluster) -> list[str]:
    return ["--master", cluster.master_address, "--metadata", cluster.metadata_url, "--admin", cluster.admin_url,
            "--local-hostname", "127.0.0.1"]


@pytest.fixture
def tiered(tmp_path):
    with LocalCluster(holders=1, segment_mb=64, offload=True, bucket_keys=BUCKET_KEYS, log_dir=tmp_path) as cluster:
        yield cluster, fill(cluster, "copies")


@pytest.mark.parametrize("read_mode", ["lease", "peek"])
def test_a_disk_copy_unlike_its_memory_copy_is_replica_divergent(tiered, read_mode):
    cluster, values = tiered
    offload_dir = cluster.running_holders[0].offload_dir
    args = [*cli_args(cluster), "--prefix", "copies/", "--all", "--read-mode", read_mode,
            "--offload-dir", str(offload_dir)]
    code, clean = scan_json(args)
    assert code == 0 and clean["summary"]["verdicts"] == {}
    assert clean["summary"]["offload"]["disk_copies_compared"] == KEYS
    assert clean["summary"]["offload"]["disk_copies_divergent"] == 0
    assert clean["summary"]["offload"]["unlisted"] == {"values": 0, "other_tenants_values": 0, "named": []}
    assert clean["summary"]["coverage"]["replica_tiers"]["local_disk"] == {"keys": KEYS, "replicas": KEYS, "not_read": 0}

    index = index_directories([offload_dir])
    corrupted = max(values, key=lambda key: index[stored_key("default", key)].offset)  # deep inside its bucket
    stored = index[stored_key("default", corrupted)]
    assert stored.value_offset > 2 * VALUE_BYTES
    with open(stored.path, "r+b") as bucket:
        os.pwrite(bucket.fileno(), b"\xff" * 64, stored.value_offset + 4096)
    on_disk = bytearray(values[corrupted])
    on_disk[4096:4096 + 64] = b"\xff" * 64

    code, document = scan_json(args)
    summary, records = document["summary"], by_key(document)
    assert code == 1 and summary["verdicts"] == {"REPLICA_DIVERGENT": 1}
    assert [record["key"] for record in document["findings"]] == [corrupted]
    assert summary["offload"]["disk_copies_divergent"] == 1 and summary["offload"]["disk_copies_compared"] == KEYS
    memory, disk = f"{xxhash.xxh3_64_intdigest(values[corrupted]):016x}", f"{xxhash.xxh3_64_intdigest(bytes(on_disk)):016x}"
    assert records[corrupted]["xxh3"] == memory  # the bytes judged: memory's
    assert records[corrupted]["evidence"]["replica_divergent"]["tiers"] == {"local_disk": [disk], "memory": [memory]}
    disk_row = records[corrupted]["evidence"]["replicas"][-1]
    assert (disk_row["tier"], disk_row["file"], disk_row["offset"]) == ("local_disk", str(stored.path), stored.value_offset)
    for key, value in values.items():
        if key != corrupted:
            assert records[key]["verdicts"] == [] and records[key]["xxh3"] == f"{xxhash.xxh3_64_intdigest(value):016x}"


def test_a_value_on_disk_that_no_master_lists_is_named(tiered):
    cluster, _ = tiered
    offload_dir = cluster.running_holders[0].offload_dir
    store = open_store(settings_for(cluster))
    try:
        remove(store, "copies/2")
    finally:
        store.close()
    code, document = scan_json([*cli_args(cluster), "--prefix", "copies/", "--read-mode", "peek",
                                "--offload-dir", str(offload_dir)])
    offload = document["summary"]["offload"]
    assert code == 0 and document["summary"]["keys_scanned"] == KEYS - 1
    assert offload["disk_copies_compared"] == KEYS - 1 and offload["unlisted"]["values"] == 1
    (named,) = offload["unlisted"]["named"]
    assert named["key"] == "copies/2" and named["size"] == VALUE_BYTES and named["file"].startswith(str(offload_dir))
    human = run_cli("scan", *cli_args(cluster), "--prefix", "copies/", "--read-mode", "peek",
                    "--offload-dir", str(offload_dir), "--no-progress")
    assert human.exit_code == 0, human.output
    assert "on disk but listed by no master: 1 value(s), which a holder restart registers again: copies/2" in human.stdout
    assert "disk copies (--offload-dir): 7 compared with memory, 0 divergent" in human.stdout


def put_again(cluster: LocalCluster, values: dict[str, bytes], holder: int = 0) -> None:
    """`values`' keys removed by the application and put again with `values`, on an offloading holder."""
    store = open_store(settings_for(cluster))
    try:
        for key, value in values.items():
            remove(store, key)
            _put(store, key, value, cluster.running_holders[holder].segment)
    finally:
        store.close()
    time.sleep(3)  # offloading is eager (a heartbeat of 1 s): it would have happened by now


def test_a_key_put_again_keeps_its_first_copy_on_disk_which_a_holder_restart_serves(tmp_path):
    """The bucket backend offloads a key once: removed and put again, the key stays in memory only,
    the master lists no disk copy, and the first value's copy stays in its bucket, which a restarted
    holder registers in place of the bytes that were in memory. The scan names that copy (`latent`)
    and says whether it holds the bytes read from memory; it is no finding."""
    with LocalCluster(holders=1, segment_mb=64, offload=True, bucket_keys=BUCKET_KEYS, client_ttl_s=3,
                      log_dir=tmp_path) as cluster:
        first = fill(cluster, "again")
        holder = cluster.running_holders[0]
        changed, same = "again/2", "again/5"
        second = {**first, changed: os.urandom(VALUE_BYTES)}
        put_again(cluster, {changed: second[changed], same: second[same]})
        assert cluster.tiers([changed, same]) == {changed: {"memory"}, same: {"memory"}}

        args = [*cli_args(cluster), "--prefix", "again/", "--all", "--offload-dir", str(holder.offload_dir)]
        for read_mode in ("lease", "peek"):
            code, document = scan_json([*args, "--read-mode", read_mode])
            offload = document["summary"]["offload"]
            assert code == 0 and document["summary"]["verdicts"] == {}, read_mode
            assert offload["unlisted"]["values"] == 0 and offload["disk_copies_compared"] == KEYS - 2
            latent = offload["latent"]
            assert (latent["copies"], latent["unlike_memory"]) == (2, 1), latent
            assert [(row["key"], row["xxh3"], row["memory_xxh3"]) for row in latent["named"]] == [
                (changed, _digest(first[changed]), _digest(second[changed])),  # the one unlike memory first
                (same, _digest(first[same]), _digest(first[same]))]
            assert latent["named"][0]["file"].startswith(str(holder.offload_dir))
        human = run_cli("scan", *args, "--read-mode", "peek", "--no-progress")
        assert human.exit_code == 0, human.output
        assert ("on disk but not listed for its key: 2 copy(ies), 1 unlike the bytes in memory, which a restart "
                f"of the holder registers again in their place: {changed}, {same}") in human.stdout

        cluster.restart_holder(holder)
        cluster.wait_held(first, "local_disk")
        store = open_store(settings_for(cluster))
        try:
            assert store.get(changed) == first[changed]  # the first value is back under the key
        finally:
            store.close()
        code, document = scan_json([*args, "--read-mode", "peek"])
        assert code == 0 and document["summary"]["offload"]["latent"]["copies"] == 0
        assert {key: record["xxh3"] for key, record in by_key(document).items()} == {
            key: _digest(value) for key, value in first.items()}


def test_the_file_per_key_backend_offloads_a_key_put_again_anew(tmp_path):
    """Unlike buckets, a key file is written again: the key put again is in both tiers with its new
    value, compared like the rest, and no copy is latent."""
    with LocalCluster(holders=1, segment_mb=64, offload=True, backend="file_per_key", log_dir=tmp_path) as cluster:
        fill(cluster, "again")
        changed = "again/2"
        put_again(cluster, {changed: os.urandom(VALUE_BYTES)})
        assert cluster.tiers([changed]) == {changed: {"memory", "local_disk"}}
        code, document = scan_json([*cli_args(cluster), "--prefix", "again/", "--read-mode", "peek",
                                    "--offload-dir", str(cluster.running_holders[0].offload_dir)])
        offload = document["summary"]["offload"]
        assert code == 0 and document["summary"]["verdicts"] == {}
        assert offload["disk_copies_compared"] == KEYS and offload["latent"]["copies"] == 0


def _digest(value: bytes) -> str:
    return f"{xxhash.xxh3_64_intdigest(value):016x}"


def test_another_tenants_value_on_disk_is_named_where_the_run_found_its_key_gone(tmp_path):
    """The admin API answers for the default tenant only, and a tenant's client leases every key it
    is asked about: a value on disk of a tenant the run audits (`--tenant`) is named, with its
    tenant, where the run's own look-ups of the names its key source gave found the key gone; the
    values of keys found there pass, and those of keys no source named, or of other tenants, are
    counted."""
    with LocalCluster(holders=1, segment_mb=64, offload=True, bucket_keys=1, tenants=("team-a",),
                      log_dir=tmp_path) as cluster:
        holder = cluster.running_holders[0]
        values = {f"ta/{index}": os.urandom(VALUE_BYTES) for index in range(4)}
        tenant = open_store(settings_for(cluster), tenant="team-a")
        try:
            for key, value in values.items():
                _put(tenant, key, value, holder.segment)
            deadline = time.monotonic() + 30
            while len(index_directories([holder.offload_dir])) < len(values) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert {stored_key("team-a", key) for key in values} <= set(index_directories([holder.offload_dir]))
            remove(tenant, "ta/1")
        finally:
            tenant.close()
        named = tmp_path / "keys.txt"
        named.write_text("ta/0\nta/1\nta/2\n")  # ta/3 named by no source
        args = [*cli_args(cluster), "--read-mode", "peek", "--offload-dir", str(holder.offload_dir)]
        _, audited = scan_json(args, "--tenant", "team-a", "--keys", str(named))
        assert audited["summary"]["keys_scanned"] == 2 and audited["summary"]["verdicts"] == {"VANISHED": 1}
        unlisted = audited["summary"]["offload"]["unlisted"]
        assert (unlisted["values"], unlisted["other_tenants_values"]) == (1, 1)
        assert [(row["key"], row["tenant"], row["size"]) for row in unlisted["named"]] == [("ta/1", "team-a", VALUE_BYTES)]
        human = run_cli("scan", *args, "--tenant", "team-a", "--keys", str(named), "--no-progress")
        assert "on disk but listed by no master: 1 value(s), which a holder restart registers again: ta/1 (tenant " \
               "team-a)" in human.stdout
        _, unaudited = scan_json(args)
        assert unaudited["summary"]["offload"]["unlisted"] == {"values": 0, "other_tenants_values": 4, "named": []}


def test_an_audited_tenants_disk_copies_are_compared_and_named_from_its_clients_tiers(tmp_path):
    """The admin listing shows the default tenant's keys only, so an audited tenant's key (read
    through its tenant's client) with a copy in the directories has its tiers asked of that client
    (a lease, as its read took): in memory and on disk, the copy is compared (REPLICA_DIVERGENT when
    it differs); in memory only (removed and put again), the copy is named in `latent` with its
    tenant, and `purge --stale-disk-copies` takes it out, keeping the key."""
    with LocalCluster(holders=1, segment_mb=64, offload=True, bucket_keys=1, tenants=("team-a",), client_ttl_s=3,
                      log_dir=tmp_path) as cluster:
        holder = cluster.running_holders[0]
        values = {f"tb/{index}": os.urandom(VALUE_BYTES) for index in range(4)}
        corrupted, changed = "tb/1", "tb/2"
        tenant = open_store(settings_for(cluster), tenant="team-a")
        try:
            for key, value in values.items():
                _put(tenant, key, value, holder.segment)
            deadline = time.monotonic() + 30  # until the master lists every disk copy (not only once written)
            while (not all("local_disk" in (tenant_key_tiers(tenant, key) or ()) for key in values)
                   and time.monotonic() < deadline):
                time.sleep(0.2)
            remove(tenant, changed)
            again = os.urandom(VALUE_BYTES)
            _put(tenant, changed, again, holder.segment)
        finally:
            tenant.close()
        index = index_directories([holder.offload_dir])
        stored = index[stored_key("team-a", corrupted)]
        with open(stored.path, "r+b") as bucket:
            os.pwrite(bucket.fileno(), b"\xff" * 64, stored.value_offset + 4096)
        named = tmp_path / "keys.txt"
        named.write_text("".join(f"{key}\n" for key in values))
        report = tmp_path / "scan.json"
        args = [*cli_args(cluster), "--offload-dir", str(holder.offload_dir)]
        scanned = run_cli("scan", *args, "--tenant", "team-a", "--keys", str(named), "--format", "json",
                          "--output", str(report), "--no-progress")
        assert scanned.exit_code == 1, scanned.output
        document = json.loads(report.read_text())
        summary = document["summary"]
        assert summary["keys_scanned"] == len(values) and summary["verdicts"] == {"REPLICA_DIVERGENT": 1}
        ((found_key, found_tenant),) = [(record["key"], record["tenant"]) for record in document["findings"]]
        assert (found_key, found_tenant) == (corrupted, "team-a")
        offload = summary["offload"]
        assert (offload["disk_copies_compared"], offload["disk_copies_divergent"]) == (3, 1)
        ((row),) = offload["latent"]["named"]
        assert (row["key"], row["tenant"], row["xxh3"], row["memory_xxh3"]) == (
            changed, "team-a", _digest(values[changed]), _digest(again))
        assert offload["unlisted"]["values"] == 0

        done = run_cli("purge", str(report), *args, "--stale-disk-copies", "--yes", "--evidence", str(tmp_path / "ev"))
        assert done.exit_code == 0 and done.stdout.splitlines()[0] == f"taken-out    {changed}", done.output
        assert stored_key("team-a", changed) not in index_directories([holder.offload_dir])
        tenant = open_store(settings_for(cluster), tenant="team-a")
        try:
            assert tenant.get(changed) == again  # the key stays
        finally:
            tenant.close()
