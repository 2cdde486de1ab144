"""Every copy compared on a tiered store (issue #41): a key in memory and on its holder's SSD has
its disk copy read from the bucket file (`--offload-dir`) and compared with the memory bytes, and
a value on disk that no master lists (a key removed through Mooncake) is named.

One offloading holder, buckets of 4 keys, 8 values of 256 KiB: every key ends in memory and on disk.
"""

from __future__ import annotations

import os
import time

import pytest
import xxhash

from audit.cluster import LocalCluster
from audit.connection import open_store
from audit.readers.buckets import stored_key
from audit.readers.offload_index import index_directories
from tests.conftest import settings_for
from tests.helpers import by_key, run_cli, scan_json
from tests.readers.test_tiered import put_on_disk

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
