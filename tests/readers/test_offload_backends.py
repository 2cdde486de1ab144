"""Every key of a tiered store read, in both read modes, whichever way Mooncake's SSD tier was
written (issue #41): the file-per-key backend (a `KVEntry {1: key, 2: value}` file per key) beside
the bucket backend, and on-evict mode (master `--offload_on_evict=true`: a value reaches the disk
only when memory pressure evicts it) beside eager offload. Each store holds memory-only, disk-only
and both-tier keys, with all-zero values among the memory-only and disk-only ones; `--offload-dir`
reads the disk-only ones from the holder's files and compares the disk copies of the others.

The bucket backend in eager mode is `tests/readers/test_tiered.py`'s store.
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
from audit.readers.key_files import KEY_FILES_DIR
from audit.readers.offload_index import index_directories
from tests.conftest import settings_for
from tests.helpers import by_key, run_cli, scan_json
from tests.readers.test_tiered import MEMORY_KEYS, SEGMENT_MB, VALUE_BYTES, TieredStore, _fill, _put, _settled

EVICTED_SEGMENT_MB = 16
EVICTED_KEYS = 24  # put back to back into the 16 MiB segment: on-evict offload keeps up, none is lost
ZERO_EVERY = 3
TIERS = {("memory",), ("local_disk",), ("local_disk", "memory")}


def _fill_on_evict(cluster: LocalCluster) -> TieredStore:
    """`EVICTED_KEYS` values of 1 MiB put on the one holder, every 3rd all zero: most of the older
    are evicted to disk-only, some offloaded but still in memory (which is the master's choice: once
    01, 03, 05, 13 and 15), the newest 8 never left memory."""
    store = open_store(settings_for(cluster))
    built = TieredStore(cluster)
    try:
        for index in range(EVICTED_KEYS):
            built.put(store, f"tiered/evicted/{index:02d}", index % ZERO_EVERY == 0, cluster.running_holders[0].segment)
    finally:
        store.close()
    return built


@pytest.fixture(scope="module", params=[("file_per_key", False), ("bucket", True), ("file_per_key", True)],
                ids=["file-per-key", "bucket-on-evict", "file-per-key-on-evict"])
def tiered(request, tmp_path_factory):
    backend, on_evict = request.param
    with LocalCluster(holders=1, segment_mb=EVICTED_SEGMENT_MB if on_evict else SEGMENT_MB, offload=True,
                      backend=backend, offload_on_evict=on_evict, log_dir=tmp_path_factory.mktemp("tiered")) as cluster:
        built = _fill_on_evict(cluster) if on_evict else _fill(cluster, MEMORY_KEYS)
        yield backend, built, _settled(built)


def _cli(cluster: LocalCluster) -> list[str]:
    return ["--master", cluster.master_address, "--metadata", cluster.metadata_url, "--admin", cluster.admin_url,
            "--local-hostname", "127.0.0.1"]


def _assert_every_key_read(document: dict, store: TieredStore) -> dict[str, dict]:
    summary, records = document["summary"], by_key(document)
    assert summary["keys_scanned"] == len(store.values) == len(records)
    assert summary["verdicts"] == {"ZERO_VALUE": len(store.zero)}
    assert {record["key"] for record in document["findings"]} == store.zero
    for key, value in store.values.items():
        assert records[key]["xxh3"] == f"{xxhash.xxh3_64_intdigest(value):016x}", key
    assert summary["coverage"]["complete"] and summary["coverage"]["keys_read"] == len(store.values)
    return records


def test_the_store_holds_every_tier_with_zero_values_in_each(tiered):
    backend, store, tiers = tiered
    assert set(tiers) == TIERS and sum(map(len, tiers.values())) == len(store.values)  # none lost
    assert tiers[("local_disk",)] & store.zero and tiers[("memory",)] & store.zero, tiers
    offload_dir = store.cluster.running_holders[0].offload_dir
    on_disk = index_directories([offload_dir])
    assert {stored_key("default", key) for key in tiers[("local_disk",)] | tiers[("local_disk", "memory")]} <= set(on_disk)
    if backend == "file_per_key":
        assert not list(offload_dir.glob("*.bucket"))
        assert all(value.path.is_relative_to(offload_dir / KEY_FILES_DIR) and value.offset == 0
                   for value in on_disk.values())
        assert len(on_disk) == len(list((offload_dir / KEY_FILES_DIR).rglob("default_*")))


@pytest.mark.parametrize("read_mode", ["lease", "peek"])
def test_a_scan_reads_every_key_with_exact_verdicts(tiered, read_mode):
    _, store, tiers = tiered
    code, document = scan_json(_cli(store.cluster), "--prefix", "tiered/", "--all", "--read-mode", read_mode)
    assert code == 1
    _assert_every_key_read(document, store)
    disk_keys = len(tiers[("local_disk",)]) + len(tiers[("local_disk", "memory")])
    assert document["summary"]["coverage"]["replica_tiers"]["local_disk"]["keys"] == disk_keys
    assert _settled(store) == tiers  # read, not moved (no --promotion_on_hit)


def test_check_with_the_offload_dir_reads_disk_only_keys_from_the_files_and_compares_the_rest(tiered):
    backend, store, tiers = tiered
    offload_dir = store.cluster.running_holders[0].offload_dir
    result = run_cli("check", *_cli(store.cluster), "--prefix", "tiered/", "--read-mode", "peek",
                     "--offload-dir", str(offload_dir), "--format", "json", "--all", "--no-progress")
    assert result.exit_code == 1, result.output
    document = json.loads(result.stdout)
    records = _assert_every_key_read(document, store)
    files_under = offload_dir / KEY_FILES_DIR if backend == "file_per_key" else offload_dir
    for key in tiers[("local_disk",)]:
        (row,) = records[key]["evidence"]["replicas"]
        assert row["tier"] == "local_disk" and row["status"] == "ok", row
        assert row["file"].startswith(str(files_under)) and row["size"] == VALUE_BYTES
    offload = document["summary"]["offload"]
    assert offload["disk_copies_compared"] == len(tiers[("local_disk", "memory")])
    assert offload["disk_copies_divergent"] == 0 and offload["unlisted"]["values"] == 0
    assert _settled(store) == tiers


def test_a_bad_disk_only_value_and_a_bad_disk_copy_are_flagged(tiered):
    """The holder's files changed under it: a disk-only key's value zeroed (ZERO_VALUE, read from its
    file) and a both-tier key's disk copy changed (REPLICA_DIVERGENT). Runs last: the files stay so."""
    _, store, tiers = tiered
    offload_dir = store.cluster.running_holders[0].offload_dir
    index = index_directories([offload_dir])
    zeroed = min(tiers[("local_disk",)] - store.zero)
    diverged = min(tiers[("local_disk", "memory")] - store.zero)
    for key, patch in ((zeroed, bytes(VALUE_BYTES)), (diverged, b"\xff" * 64)):
        value = index[stored_key("default", key)]
        with open(value.path, "r+b") as stored:
            os.pwrite(stored.fileno(), patch, value.value_offset)
    code, document = scan_json(_cli(store.cluster), "--prefix", "tiered/", "--all", "--read-mode", "peek",
                               "--offload-dir", str(offload_dir))
    records = by_key(document)
    assert code == 1 and document["summary"]["verdicts"] == {"ZERO_VALUE": len(store.zero) + 1, "REPLICA_DIVERGENT": 1}
    assert records[zeroed]["verdicts"] == ["ZERO_VALUE"]
    assert records[zeroed]["xxh3"] == f"{xxhash.xxh3_64_intdigest(bytes(VALUE_BYTES)):016x}"
    assert records[diverged]["verdicts"] == ["REPLICA_DIVERGENT"]
    assert records[diverged]["xxh3"] == f"{xxhash.xxh3_64_intdigest(store.values[diverged]):016x}"  # memory's bytes judged


def test_a_partly_written_key_file_is_left_alone(tmp_path):
    """A file-per-key file shorter than its KVEntry says (still being written) is not indexed."""
    root = tmp_path / KEY_FILES_DIR / "a" / "b"
    root.mkdir(parents=True)
    key = b"default\0k/1"
    whole = b"\x0a" + bytes([len(key)]) + key + b"\x12\x04" + b"abcd"
    (root / "default_k_1").write_bytes(whole)
    (root / "default_k_2").write_bytes(whole.replace(b"k/1", b"k/2")[:-1])
    (root / "stray").write_bytes(b"not a KVEntry")
    (value,) = index_directories([tmp_path]).values()
    assert (value.stored_key, value.size, value.value_offset, value.path.name) == (key, 4, len(whole) - 4, "default_k_1")


def test_put_reaches_the_disk_only_on_eviction_in_on_evict_mode(tmp_path):
    """On-evict mode offloads nothing while memory has room: the disk reader finds no file."""
    with LocalCluster(holders=1, segment_mb=EVICTED_SEGMENT_MB, offload=True, offload_on_evict=True,
                      backend="file_per_key", log_dir=tmp_path) as cluster:
        store = open_store(settings_for(cluster))
        try:
            _put(store, "roomy/0", os.urandom(VALUE_BYTES), cluster.running_holders[0].segment)
        finally:
            store.close()
        time.sleep(3)  # an eager holder would have offloaded it within a heartbeat or two (1 s each)
        assert cluster.tiers(["roomy/0"]) == {"roomy/0": {"memory"}}
        assert index_directories([cluster.running_holders[0].offload_dir]) == {}
