"""A tiered store (Mooncake's SSD offload, FACTS §11) scanned in both read modes: every key read,
whether memory-only, disk-only or both, and every planted zero value flagged, disk-only ones too;
and disk-only keys read from the holder's bucket files, without a lease and without a promotion.

One holder offloads (bucket backend, eager) and its 32 MiB segment is filled with 48 values of
1 MiB, so the oldest are evicted to disk-only; a second holder, added afterwards, keeps no SSD tier
and takes the memory-only keys.
"""

from __future__ import annotations

import json
import os
import time

import pytest
import xxhash
from mooncake.store import ReplicateConfig

from audit.checks.host import HostChecker
from audit.cluster import LocalCluster
from audit.connection import AdminClient, open_store
from audit.errors import AuditError
from audit.readers.buffers import plan_batches
from audit.readers.buckets import stored_key
from audit.readers.disk import DEFAULT_TENANT, DiskReader
from audit.readers.readahead import calls
from audit.records import Verdict
from audit.run.scan import scan_keys
from audit.sources.listing import AdminListing, KeyFilter, admin_readable
from tests.conftest import settings_for
from tests.helpers import by_key, run_cli, scan_json
from tests.readers.willneed import WillNeedCalls

VALUE_BYTES = 1 << 20
SEGMENT_MB = 32
TIERED_KEYS = 48      # into the segment: the oldest 16-20 end up disk-only
PART = 8              # keys put between waits for the disk: a key evicted before it reached the disk is lost
ZERO_EVERY = 8        # every 8th value put on the offloading holder is all zero
BUCKET_KEYS = 4       # keys per bucket file where values must lie inside buckets, not only at their start
MEMORY_KEYS = 8
NO_SPACE = -200       # a put into a full segment while eviction catches up
OBJECT_HAS_LEASE = -706
OBJECT_NOT_FOUND = -704
PUT_PATIENCE_S = 30.0


def _on(segment: str) -> ReplicateConfig:
    config = ReplicateConfig()
    config.replica_num = 1
    config.preferred_segment = segment
    return config


def _put(store, key: str, value: bytes, segment: str) -> None:
    deadline = time.monotonic() + PUT_PATIENCE_S
    while (rc := store.put(key, value, _on(segment))) == NO_SPACE and time.monotonic() < deadline:
        time.sleep(0.05)
    assert rc == 0, (key, rc)


def put_on_disk(cluster: LocalCluster, values: dict[str, bytes]) -> None:
    """`values` put on the offloading holder; returns once each is on its disk too."""
    store = open_store(settings_for(cluster))
    try:
        for key, value in values.items():
            _put(store, key, value, cluster.running_holders[0].segment)
    finally:
        store.close()
    cluster.wait_held(values, "local_disk")


class TieredStore:
    """The cluster, every value put, by key, and which keys are zero-filled."""

    def __init__(self, cluster: LocalCluster):
        self.cluster = cluster
        self.values: dict[str, bytes] = {}
        self.zero: set[str] = set()

    def put(self, store, key: str, zero: bool, segment: str) -> None:
        value = bytes(VALUE_BYTES) if zero else os.urandom(VALUE_BYTES)
        _put(store, key, value, segment)
        self.values[key] = value
        if zero:
            self.zero.add(key)

    def by_tiers(self) -> dict[tuple[str, ...], set[str]]:
        grouped: dict[tuple[str, ...], set[str]] = {}
        for name, tiers in self.cluster.tiers(self.values).items():
            grouped.setdefault(tuple(sorted(tiers)), set()).add(name)
        return grouped


def _fill(cluster: LocalCluster, memory_keys: int) -> TieredStore:
    """The offloading holder filled past its segment; then `memory_keys` more (every 4th zero) on a
    holder added without an SSD tier."""
    store = open_store(settings_for(cluster))
    built = TieredStore(cluster)
    offloading = cluster.running_holders[0]
    on_disk = [f"tiered/disk/{i:02d}" for i in range(TIERED_KEYS)]
    for first in range(0, TIERED_KEYS, PART):
        part = on_disk[first:first + PART]
        for index, key in enumerate(part, first):
            built.put(store, key, index % ZERO_EVERY == 0, offloading.segment)
        cluster.wait_held(part, "local_disk")
    cluster.wait_disk_only(on_disk, TIERED_KEYS - SEGMENT_MB)
    if memory_keys:
        memory_only = cluster.add_holder(offload=False)
        for index in range(memory_keys):
            built.put(store, f"tiered/memory/{index:02d}", index % 4 == 0, memory_only.segment)
    store.close()
    return built


@pytest.fixture(scope="module")
def tiered():
    with LocalCluster(holders=1, segment_mb=SEGMENT_MB, offload=True) as cluster:
        yield _fill(cluster, MEMORY_KEYS)


@pytest.fixture(scope="module")
def promoting():
    """A master that copies a disk-only key back into memory at its first read (`--promotion_on_hit`)."""
    with LocalCluster(holders=1, segment_mb=SEGMENT_MB, offload=True, promote_after=1) as cluster:
        yield _fill(cluster, 0)


def test_the_tiered_cluster_holds_keys_in_memory_on_disk_and_in_both(tiered):
    tiers = tiered.by_tiers()
    assert set(tiers) == {("memory",), ("local_disk",), ("local_disk", "memory")}
    assert sum(map(len, tiers.values())) == TIERED_KEYS + MEMORY_KEYS  # no key lost to eviction
    assert tiers[("memory",)] == {key for key in tiered.values if key.startswith("tiered/memory/")}
    assert len(tiers[("local_disk",)]) >= TIERED_KEYS - SEGMENT_MB and len(tiers[("local_disk", "memory")]) >= 8
    assert len(tiers[("local_disk",)] & tiered.zero) >= 2
    offloaded, plain = tiered.cluster.running_holders
    assert plain.offload_dir is None and offloaded.offload_dir.parent == tiered.cluster.log_dir
    assert len(list(offloaded.offload_dir.glob("*.bucket"))) == TIERED_KEYS  # a bucket per key
    assert len(list(offloaded.offload_dir.glob("*.meta"))) == TIERED_KEYS


@pytest.mark.parametrize("read_mode", ["lease", "peek"])
def test_a_scan_reads_every_key_of_every_tier(tiered, read_mode):
    disk_only = tiered.by_tiers()[("local_disk",)]
    cluster = tiered.cluster
    cli_args = ["--master", cluster.master_address, "--metadata", cluster.metadata_url,
                "--admin", cluster.admin_url, "--local-hostname", "127.0.0.1"]
    code, document = scan_json(cli_args, "--prefix", "tiered/", "--all", "--read-mode", read_mode)
    summary, records = document["summary"], by_key(document)
    assert code == 1 and summary["keys_scanned"] == len(tiered.values) == len(records)
    assert summary["verdicts"] == {"ZERO_VALUE": len(tiered.zero)}
    assert {record["key"] for record in document["findings"]} == tiered.zero
    for key, value in tiered.values.items():
        assert records[key]["size"] == VALUE_BYTES, key
        assert records[key]["xxh3"] == f"{xxhash.xxh3_64_intdigest(value):016x}", key
    coverage = summary["coverage"]
    assert coverage["complete"] and coverage["keys_read"] == len(tiered.values)
    assert coverage["replica_tiers"]["local_disk"]["keys"] == TIERED_KEYS
    assert tiered.by_tiers()[("local_disk",)] == disk_only  # read, not promoted (no --promotion_on_hit)


def _settled(store: TieredStore, quiet_s: float = 3.0, patience_s: float = 30.0) -> dict:
    """The store's tiers once no key has changed tier for `quiet_s` (eviction after a fill goes on a
    while): what an audit's effect is measured against."""
    deadline = time.monotonic() + patience_s
    tiers = store.by_tiers()
    while time.monotonic() < deadline:
        time.sleep(quiet_s)
        now = store.by_tiers()
        if now == tiers:
            return now
        tiers = now
    raise AssertionError(f"the tiers still changed after {patience_s:g} s")


def test_check_in_peek_mode_reads_the_offload_directory_and_promotes_nothing(promoting):
    """`check --read-mode peek --offload-dir DIR` on a master that promotes a disk-only key at its
    first lease read: every key read, every disk-only one from its bucket file, and none promoted."""
    cluster = promoting.cluster
    before = _settled(promoting)
    offload_dir = cluster.running_holders[0].offload_dir
    result = run_cli("check", "--master", cluster.master_address, "--metadata", cluster.metadata_url,
                     "--admin", cluster.admin_url, "--local-hostname", "127.0.0.1", "--prefix", "tiered/",
                     "--read-mode", "peek", "--offload-dir", str(offload_dir), "--format", "json", "--all",
                     "--no-progress")
    assert result.exit_code == 1, result.output
    document = json.loads(result.stdout)
    records = by_key(document)
    assert set(records) == set(promoting.values) and document["summary"]["verdicts"] == {"ZERO_VALUE": len(promoting.zero)}
    for key, value in promoting.values.items():
        assert records[key]["xxh3"] == f"{xxhash.xxh3_64_intdigest(value):016x}", key
    for key in before[("local_disk",)]:
        (row,) = records[key]["evidence"]["replicas"]
        assert row["tier"] == "local_disk" and row["file"].startswith(str(offload_dir)), row
    time.sleep(3)  # a promotion lands within a heartbeat or two (1 s each)
    assert promoting.by_tiers() == before


def test_the_disk_reader_asks_for_its_values_in_its_order_once_it_knows_it(promoting, monkeypatch):
    """Read ahead (`audit.readers.readahead`): once the reader has put its keys in order, the kernel
    is asked for their records in that order, file by file, front to back; a reader told not to
    (`--max-bandwidth`) asks for none. Reads only: the fixture's keys stay as they were."""
    admin = AdminClient(promoting.cluster.admin_url)
    disk_only = [key for key in AdminListing(admin, KeyFilter("tiered/")).list().keys if not admin_readable(key)]
    offload_dir = promoting.cluster.running_holders[0].offload_dir
    asked = WillNeedCalls(monkeypatch)
    paced = DiskReader(admin, [offload_dir], 8 << 20, read_ahead=False)
    try:
        paced.order(disk_only)
    finally:
        paced.close()
    assert asked.calls == []
    reader = DiskReader(admin, [offload_dir], 8 << 20)
    try:
        values = [reader.index[stored_key(DEFAULT_TENANT, key.name)] for key in reader.order(disk_only)]
        expected = [(str(path), offset, length) for path, offset, length in
                    calls([(os.path.realpath(value.path), value.offset, len(value.head) + value.size) for value in values])]
        assert len(values) == len(disk_only) >= 2
        assert [value.path for value in values] == sorted(value.path for value in values)
        assert asked.settled(len(expected)) == expected
    finally:
        reader.close()


def test_the_disk_reader_reads_disk_only_keys_without_a_lease_or_a_promotion(promoting):
    cluster = promoting.cluster
    admin = AdminClient(cluster.admin_url)
    disk_only = [key for key in AdminListing(admin, KeyFilter("tiered/")).list().keys if not admin_readable(key)]
    names = {key.name for key in disk_only}
    assert names == promoting.by_tiers()[("local_disk",)] and len(names & promoting.zero) >= 2
    offload_dir = cluster.running_holders[0].offload_dir
    reader = DiskReader(admin, [offload_dir], 8 << 20)
    records = {record.key: record for record in scan_keys(disk_only, reader, HostChecker())}
    assert set(records) == names
    for name, record in records.items():
        assert record.xxh3 == xxhash.xxh3_64_intdigest(promoting.values[name]), name
        assert record.verdicts == ([Verdict.ZERO_VALUE] if name in promoting.zero else []), name
        (row,) = record.evidence["replicas"]
        assert (row["tier"], row["status"], row["size"]) == ("local_disk", "ok", VALUE_BYTES)
        assert row["file"].startswith(str(offload_dir))
    learnt = reader.index.owners
    assert learnt[offload_dir].endpoint == row["endpoint"] and learnt[offload_dir].known == "learnt"
    zero = [records[name] for name in sorted(names & promoting.zero)]
    assert {confirmation.status for confirmation in reader.confirm(zero).values()} == {"confirmed"}
    assert reader.index.owners is learnt  # indexed afresh, the directory still its holder's: not asked again

    store = open_store(settings_for(cluster))
    try:
        removed, control, *untouched = sorted(names)
        assert store.remove(removed) == 0  # no lease: the application's remove right after succeeds
        assert store.get(control) == promoting.values[control]  # a lease read, through the holder's RPC
        assert store.remove(control) == OBJECT_HAS_LEASE
        cluster.wait_held([control], "memory")  # promoted within a few heartbeats (evicting others to disk) ...
        assert set(untouched) <= promoting.by_tiers()[("local_disk",)]  # ... while no key the disk reader read was
    finally:
        store.close()
    (removed_key,) = [key for key in disk_only if key.name == removed]
    (slots,) = plan_batches([removed_key], reader.capacity)
    assert reader.fetch(slots, 0).results == [OBJECT_NOT_FOUND]  # its bytes stay on disk; the master says gone


def test_the_disk_reader_finds_each_value_inside_a_bucket_of_several(tmp_path):
    """Mooncake's default buckets hold 500 keys: values lie at offsets within them. The keys stay
    in memory too: with the segment full, keys waiting for their bucket to fill never reached the
    disk in 3 of 5 tries."""
    with LocalCluster(holders=1, segment_mb=SEGMENT_MB, offload=True, bucket_keys=BUCKET_KEYS,
                      log_dir=tmp_path) as cluster:
        values = {f"bucketed/{index}": os.urandom(VALUE_BYTES - 64 * index) for index in range(2 * BUCKET_KEYS)}
        put_on_disk(cluster, values)
        admin = AdminClient(cluster.admin_url)
        offload_dir = cluster.running_holders[0].offload_dir
        reader = DiskReader(admin, [offload_dir], 16 << 20)
        keys = list(AdminListing(admin, KeyFilter("bucketed/")).list().keys)
        records = {record.key: record for record in scan_keys(keys, reader, HostChecker())}
    assert len(list(offload_dir.glob("*.bucket"))) == 2
    assert {key: record.xxh3 for key, record in records.items()} == {
        key: xxhash.xxh3_64_intdigest(value) for key, value in values.items()}
    offsets = sorted(row["offset"] for record in records.values() for row in record.evidence["replicas"])
    assert len(offsets) == 2 * BUCKET_KEYS and offsets[-1] > VALUE_BYTES  # values past a bucket's first


def test_a_bucket_cut_short_is_a_failed_read_never_a_mapping_past_its_end(tmp_path):
    """The disk reader maps values in place: a value that its file no longer holds whole must fail
    its read (UNREACHABLE, as a short read did) and leave the other values' verdicts alone."""
    with LocalCluster(holders=1, segment_mb=SEGMENT_MB, offload=True, bucket_keys=BUCKET_KEYS,
                      log_dir=tmp_path) as cluster:
        values = {f"cut/{index}": os.urandom(VALUE_BYTES) for index in range(BUCKET_KEYS)}
        values["cut/0"] = bytes(VALUE_BYTES)
        put_on_disk(cluster, values)
        admin = AdminClient(cluster.admin_url)
        offload_dir = cluster.running_holders[0].offload_dir
        reader = DiskReader(admin, [offload_dir], 16 << 20)
        (bucket,) = offload_dir.glob("*.bucket")
        last = max(reader.index.values(), key=lambda value: value.offset)
        os.truncate(bucket, last.value_offset + VALUE_BYTES // 2)  # the last value half there
        keys = list(AdminListing(admin, KeyFilter("cut/")).list().keys)
        records = {record.key: record for record in scan_keys(keys, reader, HostChecker())}
    cut = last.stored_key.split(b"\0", 1)[1].decode()
    assert records[cut].verdicts == [Verdict.UNREACHABLE] and records[cut].xxh3 is None
    assert records[cut].evidence["replicas"][0]["status"] == "failed"
    assert {key: record.xxh3 for key, record in records.items() if key != cut} == {
        key: xxhash.xxh3_64_intdigest(value) for key, value in values.items() if key != cut}
    assert all(record.evidence["replicas"][0]["xxh3"] == f"{record.xxh3:016x}"  # the checks' digest, taken once
               for key, record in records.items() if key != cut)
    assert all(record.verdicts == ([Verdict.ZERO_VALUE] if key == "cut/0" else [])
               for key, record in records.items() if key != cut)


def test_an_offload_directory_that_is_not_one_is_a_one_line_error(tmp_path):
    with pytest.raises(AuditError, match="offload directory .*missing does not exist"):
        DiskReader(None, [tmp_path / "missing"], 1 << 20)
    (tmp_path / "1.bucket").write_bytes(b"")
    (tmp_path / "1.meta").write_bytes(b"\x0f\x00")  # wire type 7: no protobuf writes it
    with pytest.raises(AuditError, match=r"cannot read offload metadata .*1\.meta: unexpected wire type 7"):
        DiskReader(None, [tmp_path], 1 << 20)
