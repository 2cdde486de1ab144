"""The `peek` read mode on real embedded clusters: digests, no leases, eviction order, replica
comparison, races with removal, a dead holder, and confirming findings by a second read.

The module starts clusters of its own (two holders, short leases), since it corrupts replicas,
evicts and kills holders.
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
import xxhash
from mooncake.store import ReplicateConfig

from audit.checks.host import HostChecker
from audit.cluster import LocalCluster
from audit.connection import AdminClient, open_store
from audit.errors import MOVED, NOT_PEEKABLE
from audit.readers.buffers import plan_batches
from audit.readers.lease import LeaseReader
from audit.judge.key import judge_read
from audit.readers import PeekReader, apply_confirmation, judge_replicas
from audit.readers.engine import RawRead, RawTransfer
from audit.records import KeyInfo, Verdict
from audit.run.scan import scan_keys
from audit.sources.listing import AdminListing, KeyFilter
from tests.conftest import settings_for

LEASE_TTL_MS = 2000
OBJECT_HAS_LEASE = -706
OBJECT_NOT_FOUND = -704
TRANSFER_FAIL = -800
NO_SPACE = -200


def _replicas(count: int, segment: str | None = None) -> ReplicateConfig:
    config = ReplicateConfig()
    config.replica_num = count
    if segment is not None:
        config.preferred_segment = segment
    return config


class Client:
    """A cluster's producer-side store, admin client and settings, as one test needs them."""

    def __init__(self, cluster: LocalCluster):
        self.cluster = cluster
        self.settings = settings_for(cluster)
        self.admin = AdminClient(cluster.admin_url)
        self.store = open_store(self.settings)

    def put(self, key: str, value: bytes, replicas: int = 1, segment: str | None = None) -> None:
        assert self.store.put(key, value, _replicas(replicas, segment)) == 0, key

    def listed(self, prefix: str) -> list[KeyInfo]:
        return AdminListing(self.admin, KeyFilter(prefix)).list().keys

    def peek(self, buffer_bytes: int = 8 << 20) -> PeekReader:
        return PeekReader(self.settings, self.admin, buffer_bytes)

    def close(self) -> None:
        self.store.close()


@pytest.fixture(scope="module")
def two_holders():
    with LocalCluster(holders=2, segment_mb=128, lease_ttl_ms=LEASE_TTL_MS) as cluster:
        client = Client(cluster)
        yield client
        client.close()


@pytest.fixture(scope="module")
def reader(two_holders):
    peek = two_holders.peek()
    yield peek
    peek.close()


def read_all(reader, keys: list[KeyInfo]) -> dict[str, tuple[int, bytes | None, list[dict]]]:
    """Per key: the result code, the bytes left in the buffer, the replica rows."""
    out = {}
    for turn, slots in enumerate(plan_batches(keys, reader.capacity)):
        batch = reader.fetch(slots, turn)
        for index, (slot, code) in enumerate(zip(batch.slots, batch.results)):
            data = batch.view(slot, code).tobytes() if code >= 0 else None
            out[slot.key.name] = (code, data, batch.replicas[index] if batch.replicas else [])
        batch.release()
    return out


def record_of(key: KeyInfo, code: int, data: bytes | None, rows: list[dict]):
    """What `check_batch` will make of a peek read: the usual record, plus replica comparison."""
    check = HostChecker().check_value(np.frombuffer(data, np.uint8)) if data is not None else None
    record = judge_read(key, code, check)
    judge_replicas(record, rows)
    return record


def test_digests_are_those_of_the_bytes_put(two_holders):
    rng = np.random.default_rng(1)
    prefix = "digests/"
    sizes = [4096] * 300 + [100_000] * 4 + [3 << 20]  # many keys per batch; one value above a buffer half
    values = {f"{prefix}{i:04d}": rng.integers(0, 256, size, dtype=np.uint8).tobytes() for i, size in enumerate(sizes)}
    for index, (key, value) in enumerate(values.items()):
        two_holders.put(key, value, replicas=1 + index % 2)
    peek = two_holders.peek(buffer_bytes=4 << 20)
    try:
        batches = list(plan_batches(two_holders.listed(prefix), peek.capacity))
        assert max(len(batch) for batch in batches) >= 100 and len(batches) >= 2
        read = read_all(peek, two_holders.listed(prefix))
    finally:
        peek.close()
    assert set(read) == set(values)
    for index, (key, value) in enumerate(values.items()):
        code, data, rows = read[key]
        assert code == len(value) and data == value, key
        assert len(rows) == 1 + index % 2
        assert {row["status"] for row in rows} == {"ok"}
        assert {row["xxh3"] for row in rows} == {f"{xxhash.xxh3_64_intdigest(value):016x}"}
        assert len({row["endpoint"] for row in rows}) == len(rows)  # replicas live on distinct holders


def test_scan_keys_runs_on_a_peek_reader(two_holders, reader):
    two_holders.put("scan/zero", bytes(8192), replicas=2)
    two_holders.put("scan/data", b"\x07" * 8192, replicas=2)
    records = {record.key: record for record in scan_keys(two_holders.listed("scan/"), reader, HostChecker())}
    assert records["scan/zero"].verdicts == [Verdict.ZERO_VALUE]
    assert records["scan/data"].verdicts == [] and records["scan/data"].xxh3 == xxhash.xxh3_64_intdigest(b"\x07" * 8192)


def test_confirming_each_batch_while_the_next_is_read(two_holders):
    """How the orchestrator confirms findings: in `on_batch`, while the fetch thread reads ahead."""
    rng = np.random.default_rng(5)
    for i in range(40):
        two_holders.put(f"confirm/{i:02d}", rng.integers(0, 256, 300_000, dtype=np.uint8).tobytes(), replicas=2)
    statuses = []
    peek = two_holders.peek(buffer_bytes=2 << 20)  # several batches
    try:
        list(scan_keys(two_holders.listed("confirm/"), peek, HostChecker(),
                       on_batch=lambda records: statuses.extend(c.status for c in peek.confirm(records).values())))
    finally:
        peek.close()
    assert statuses == ["confirmed"] * 40


def test_peek_takes_no_lease_lease_read_blocks_remove(two_holders, reader):
    two_holders.put("lease/peeked", b"p" * 10_000)
    two_holders.put("lease/leased", b"l" * 10_000)
    peeked, leased = sorted(two_holders.listed("lease/"), key=lambda key: key.name != "lease/peeked")
    assert read_all(reader, [peeked])["lease/peeked"][0] == 10_000
    assert two_holders.store.remove("lease/peeked") == 0

    lease_reader = LeaseReader(two_holders.store, 1 << 20)
    try:
        batch = lease_reader.fetch(next(plan_batches([leased], lease_reader.capacity)), 0)
        assert batch.results == [10_000]
    finally:
        lease_reader.close()
    assert two_holders.store.remove("lease/leased") == OBJECT_HAS_LEASE


def test_one_corrupted_replica_diverges_and_a_second_read_confirms(two_holders, reader):
    value = np.random.default_rng(2).integers(0, 256, 200_000, dtype=np.uint8).tobytes()
    two_holders.put("div/corrupted", value, replicas=2)
    two_holders.put("div/intact", value[::-1], replicas=2)
    keys = {key.name: key for key in two_holders.listed("div/")}
    victim = keys["div/corrupted"].replicas[1]

    vandal = RawTransfer(two_holders.settings)
    junk = np.full(64, 0xAB, np.uint8)
    vandal.register_buffer(junk.ctypes.data, junk.nbytes)
    try:
        assert vandal.engine.transfer_sync_write(victim["endpoint"], junk.ctypes.data,
                                                 victim["address"] + 1000, junk.nbytes) == 0
    finally:
        vandal.unregister_buffer(junk.ctypes.data)
        vandal.close()

    read = read_all(reader, list(keys.values()))
    records = {name: record_of(keys[name], *read[name]) for name in keys}
    corrupted, intact = records["div/corrupted"], records["div/intact"]
    assert corrupted.verdicts == [Verdict.REPLICA_DIVERGENT] and corrupted.is_finding
    digests = [row["xxh3"] for row in corrupted.evidence["replicas"]]
    assert digests[0] == f"{xxhash.xxh3_64_intdigest(value):016x}" and digests[1] != digests[0]
    assert corrupted.evidence["replicas"][1]["endpoint"] == victim["endpoint"]
    assert intact.verdicts == [] and len({row["xxh3"] for row in intact.evidence["replicas"]}) == 1

    confirmation = reader.confirm([corrupted])["div/corrupted"]
    assert confirmation.confirmed
    apply_confirmation(corrupted, confirmation)
    assert corrupted.verdicts == [Verdict.REPLICA_DIVERGENT]


def test_bytes_replaced_at_the_same_address_fail_confirmation(two_holders, reader):
    """Removed and re-put with the same size, a value lands at the same address: the descriptor
    cannot tell, a second read can."""
    two_holders.put("reput/key", bytes(50_000))
    key = two_holders.listed("reput/")[0]
    record = record_of(key, *read_all(reader, [key])["reput/key"])
    assert record.verdicts == [Verdict.ZERO_VALUE]
    assert two_holders.store.remove("reput/key") == 0
    two_holders.put("reput/key", b"\x01" * 50_000, segment=key.replicas[0]["endpoint"])
    assert two_holders.listed("reput/")[0].replicas == key.replicas  # same place, other bytes

    confirmation = reader.confirm([record])["reput/key"]
    assert confirmation.status == "changed"
    apply_confirmation(record, confirmation)
    assert record.verdicts == [Verdict.MOVED] and not record.is_finding and not record.is_incomplete
    assert record.evidence["unconfirmed_verdicts"] == [Verdict.ZERO_VALUE]


class RacingAdmin:
    """The admin client, with `race` run once right after the first descriptor query: what
    happens to a key between the peek reader's look-up and its raw read."""

    def __init__(self, admin: AdminClient, race):
        self.admin, self.race = admin, race

    def query(self, keys):
        answer = list(self.admin.query(keys))
        race, self.race = self.race, None
        if race is not None:
            race()
        return iter(answer)


def test_changes_around_the_read_are_moved_or_vanished_never_findings(two_holders):
    client = two_holders
    for name in ["gone-before", "gone-during", "resized", "moved-during", "steady"]:
        client.put(f"race/{name}", bytes(30_000))  # all zero: a finding if ever checked
    keys = client.listed("race/")
    assert client.store.remove("race/gone-before") == 0
    assert client.store.remove("race/resized") == 0
    client.put("race/resized", bytes(40_000))

    moving = next(key for key in keys if key.name == "race/moved-during")
    elsewhere = next(h.segment for h in client.cluster.running_holders if h.segment != moving.replicas[0]["endpoint"])

    def race():
        assert client.store.remove("race/gone-during") == 0
        assert client.store.remove("race/moved-during") == 0
        client.put("race/moved-during", b"\x03" * 30_000, segment=elsewhere)

    # Keys named without their replicas (by records, say): the reader asks where they are just before
    # the read, and the race runs between that answer and the read.
    named = [KeyInfo(name=key.name, size=key.size) for key in keys]
    peek = PeekReader(client.settings, RacingAdmin(client.admin, race), 1 << 20)
    try:
        read = read_all(peek, named)
    finally:
        peek.close()
    codes = {name.removeprefix("race/"): outcome[0] for name, outcome in read.items()}
    assert codes == {"gone-before": OBJECT_NOT_FOUND, "gone-during": OBJECT_NOT_FOUND, "resized": MOVED,
                     "moved-during": MOVED, "steady": 30_000}
    assert [row["status"] for row in read["race/moved-during"][2]] == ["moved"]
    records = {key.name: record_of(key, *read[key.name]) for key in named}
    assert [name for name, record in records.items() if record.is_finding] == ["race/steady"]
    assert records["race/gone-during"].verdicts == [Verdict.VANISHED]


def test_listed_keys_changed_since_the_listing_are_read_where_the_master_says_now(two_holders):
    """Listed keys are read where the listing saw them, and checked against the master's answer after
    the read; a key described otherwise by then is read again where that answer says, as a key
    named without its replicas would be: changes between the listing and the read end as they would
    with a look-up just before the read."""
    client = two_holders
    for name in ["gone", "resized", "moved", "steady"]:
        client.put(f"since/{name}", bytes(30_000))
    keys = client.listed("since/")
    moving = next(key for key in keys if key.name == "since/moved")
    elsewhere = next(h.segment for h in client.cluster.running_holders if h.segment != moving.replicas[0]["endpoint"])
    assert client.store.remove("since/gone") == 0
    assert client.store.remove("since/resized") == 0
    client.put("since/resized", bytes(40_000))
    assert client.store.remove("since/moved") == 0
    client.put("since/moved", b"\x03" * 30_000, segment=elsewhere)

    results = {}
    for described in (keys, [KeyInfo(name=key.name, size=key.size) for key in keys]):
        peek = client.peek(1 << 20)
        try:
            results[described is keys] = read_all(peek, described)
        finally:
            peek.close()
    listed, named = results[True], results[False]
    assert listed == named
    codes = {name.removeprefix("since/"): outcome[0] for name, outcome in listed.items()}
    assert codes == {"gone": OBJECT_NOT_FOUND, "resized": MOVED, "moved": 30_000, "steady": 30_000}
    assert listed["since/moved"][1] == b"\x03" * 30_000
    assert [row["endpoint"] for row in listed["since/moved"][2]] == [elsewhere]


def test_a_key_holding_a_comma_is_not_peekable(two_holders, reader):
    two_holders.put("comma/a,b", b"c" * 1000)
    key = KeyInfo(name="comma/a,b", size=1000)
    assert read_all(reader, [key])["comma/a,b"][0] == NOT_PEEKABLE


def test_a_failed_batch_is_retried_read_by_read_when_the_holder_answers(two_holders):
    two_holders.put("attribution/key", b"a" * 1000)
    replica = two_holders.listed("attribution/")[0].replicas[0]
    transfer = RawTransfer(two_holders.settings)
    landing = np.zeros(3000, np.uint8)
    base = landing.ctypes.data
    transfer.register_buffer(base, landing.nbytes)
    try:
        codes = transfer.read([RawRead(replica["endpoint"], base + 1000 * i, address, 1000)
                               for i, address in enumerate([replica["address"], 4096, replica["address"]])])
    finally:
        transfer.unregister_buffer(base)
        transfer.close()
    assert codes == [0, TRANSFER_FAIL, 0]
    assert landing[:1000].tobytes() == landing[2000:].tobytes() == b"a" * 1000


class _CountingEngine:
    """The real transfer engine, with its batch reads counted (how many transfers each call made)."""

    def __init__(self, engine):
        self.engine = engine
        self.transfers: list[int] = []

    def batch_transfer_sync_read(self, endpoint, locals_, remotes, lengths):
        self.transfers.append(len(locals_))
        return self.engine.batch_transfer_sync_read(endpoint, locals_, remotes, lengths)

    def __getattr__(self, name):
        return getattr(self.engine, name)


def test_neighbours_in_a_holders_memory_are_read_as_one_transfer(two_holders):
    rng = np.random.default_rng(7)
    prefix = "neighbours/"
    values = {f"{prefix}{i:04d}": rng.integers(0, 256, 1024, dtype=np.uint8).tobytes() for i in range(600)}
    for key, value in values.items():
        two_holders.put(key, value)
    listed = two_holders.listed(prefix)
    peek = two_holders.peek(buffer_bytes=1 << 20)
    counting = peek.transfer.engine = _CountingEngine(peek.transfer.engine)
    try:
        ordered = peek.order(listed)
        first = list(plan_batches(ordered, peek.capacity))[0]
        assert len({slot.key.replicas[0]["endpoint"] for slot in first}) == 2  # a batch reads both holders
        assert [key.name for key in ordered] != [key.name for key in listed]  # listing order is not theirs
        records = {record.key: record for record in scan_keys(listed, peek, HostChecker())}
    finally:
        peek.close()
    assert {key: record.xxh3 for key, record in records.items()} == \
        {key: xxhash.xxh3_64_intdigest(value) for key, value in values.items()}
    assert sum(counting.transfers) <= len(values) // 20, counting.transfers  # ~600 reads were a handful


def test_a_failed_run_of_neighbours_is_retried_read_by_read(two_holders):
    two_holders.put("run/key", b"r" * 1024)
    replica = two_holders.listed("run/")[0].replicas[0]
    transfer = RawTransfer(two_holders.settings)
    landing = np.zeros(130 << 20, np.uint8)
    base = landing.ctypes.data
    transfer.register_buffer(base, landing.nbytes)
    try:  # the second read runs past the end of the holder's 128 MB segment: the run of both is refused
        codes = transfer.read([RawRead(replica["endpoint"], base, replica["address"], 1024),
                               RawRead(replica["endpoint"], base + 1024, replica["address"] + 1024, 129 << 20)])
    finally:
        transfer.unregister_buffer(base)
        transfer.close()
    assert codes == [0, TRANSFER_FAIL]
    assert landing[:1024].tobytes() == b"r" * 1024


@pytest.fixture(scope="module")
def doomed():
    """Two holders, and a client TTL long enough that a silent holder's replicas stay listed."""
    with LocalCluster(holders=2, segment_mb=64, client_ttl_s=60) as cluster:
        client = Client(cluster)
        rng = np.random.default_rng(3)
        values = {f"dead/{i:02d}": rng.integers(0, 256, 20_000, dtype=np.uint8).tobytes() for i in range(12)}
        for index, (key, value) in enumerate(values.items()):
            client.put(key, value, replicas=2 if index < 8 else 1)
        keys = client.listed("dead/")
        # The victim holds the first replica of some two-replica key: its bytes come from the other.
        victim = next(key.replicas[0]["endpoint"] for key in keys if len(key.replicas) == 2)
        yield client, keys, values, next(h for h in cluster.running_holders if h.segment == victim)
        client.close()


def _read_without(doomed) -> tuple[float, dict]:
    client, keys, values, victim = doomed
    peek = client.peek()
    try:
        started = time.monotonic()
        read = read_all(peek, keys)
        return time.monotonic() - started, read
    finally:
        peek.close()


def _assert_victims_replicas_failed(doomed, read) -> None:
    client, keys, values, victim = doomed
    for key in keys:
        code, data, rows = read[key.name]
        on_victim = [row for row in rows if row["endpoint"] == victim.segment]
        assert all(row["status"] == "failed" and row["error"]["code"] == TRANSFER_FAIL for row in on_victim)
        assert all(row["status"] == "ok" for row in rows if row["endpoint"] != victim.segment)
        if len(rows) == 2:
            assert code == len(values[key.name]) and data == values[key.name]
        else:
            assert code == (TRANSFER_FAIL if on_victim else len(values[key.name]))
    assert any(read[key.name][2][0]["endpoint"] == victim.segment and len(key.replicas) == 2 for key in keys)


def test_a_silent_holder_costs_one_transfer_timeout(doomed, monkeypatch):
    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", "5")  # read when the engine is made; 5 s is its minimum
    victim = doomed[3]
    os.kill(victim.process.pid, signal.SIGSTOP)
    try:
        elapsed, read = _read_without(doomed)
    finally:
        os.kill(victim.process.pid, signal.SIGCONT)
    assert elapsed < 5 + 3  # one wait for both replica rounds, no retries read by read
    _assert_victims_replicas_failed(doomed, read)


def test_a_dead_holders_replicas_fail_fast_the_others_are_read(doomed):
    client, _, _, victim = doomed
    client.cluster.kill_holder(victim)
    elapsed, read = _read_without(doomed)
    assert elapsed < 2
    _assert_victims_replicas_failed(doomed, read)


def _put_while_evicting(client: Client, key: str, value: bytes) -> None:
    """A producer under memory pressure: puts fail (-200) until the master's eviction thread frees room."""
    for _ in range(100):
        rc = client.store.put(key, value)
        if rc != NO_SPACE:
            break
        time.sleep(0.02)
    assert rc == 0, key


def _evicted_after_filling(client: Client, prefix: str, read) -> tuple[int, int]:
    """Fill a small segment, `read` half the keys, put more to force eviction: (read, unread) evicted."""
    rng = np.random.default_rng(4)
    names = [f"{prefix}{i:03d}" for i in range(50)]
    for name in names:
        client.put(name, rng.integers(0, 256, 256 << 10, dtype=np.uint8).tobytes())
    audited = set(names[::2])
    read([key for key in client.listed(prefix) if key.name in audited])
    for i in range(20):
        _put_while_evicting(client, f"{prefix}more{i:02d}", rng.integers(0, 256, 256 << 10, dtype=np.uint8).tobytes())
    time.sleep(0.5)  # the master evicts in a thread of its own
    alive = {key.name for key in client.listed(prefix)}
    evicted = set(names) - alive
    return len(evicted & audited), len(evicted - audited)


def test_a_lease_scan_reorders_eviction_a_peek_scan_does_not():
    with LocalCluster(holders=1, segment_mb=16, lease_ttl_ms=1000) as cluster:
        client = Client(cluster)
        peek = client.peek(buffer_bytes=16 << 20)
        lease = LeaseReader(client.store, 16 << 20)
        try:
            peek_read, peek_unread = _evicted_after_filling(client, "evict-peek/", lambda keys: read_all(peek, keys))
            for key in client.listed("evict-peek/"):
                assert client.store.remove(key.name) == 0  # no peek read left a lease behind
            lease_read, lease_unread = _evicted_after_filling(client, "evict-lease/",
                                                              lambda keys: read_all(lease, keys))
        finally:
            peek.close()
            lease.close()
            client.close()
    # Never-read keys share one lease timestamp (none), so eviction picks among all of them;
    # a leased key cannot be evicted until its lease ends, and is evicted last after that.
    assert peek_read > 0 and peek_unread > 0
    assert lease_read == 0 and lease_unread > 0
