"""Identical bytes under distinct keys: what LMCache writes by design, and what stays a finding."""

from audit.judge.duplicates import mark_duplicates
from audit.records import KeyRecord, Verdict
from tests.producers.writers import lmcache_key


def record(key: str, digest: int) -> KeyRecord:
    return KeyRecord(key=key, size=262_172, fields=None, xxh3=digest, zero=False)


def verdicts(records: list[KeyRecord]) -> dict[str, list[str]]:
    return {r.key: r.verdicts for r in records if r.verdicts}


def test_one_chunk_under_two_tags_is_expected():
    records = [record(lmcache_key("m", 1, 0, 0xAB, "float", tags={"user": user}), 7) for user in ("alice", "bob")]
    shared, expected = mark_duplicates(records)
    assert shared == [] and verdicts(records) == {r.key: [Verdict.EXPECTED_DUPLICATE] for r in records}
    assert expected[0]["reason"] == "one chunk, one worker: the keys differ only in tags"
    assert records[0].evidence["expected_duplicate"]["others"] == [records[1].key]


def _tp2(chunks: int, heads_replicated: bool) -> list[KeyRecord]:
    return [record(lmcache_key("m", 2, worker, chunk, "float"), chunk if heads_replicated else 10 * chunk + worker)
            for chunk in range(1, chunks + 1) for worker in (0, 1)]


def test_workers_holding_a_replicated_head_are_expected():
    records = _tp2(4, heads_replicated=True)
    shared, expected = mark_duplicates(records)
    assert shared == [] and len(expected) == 4 and all(r.verdicts == [Verdict.EXPECTED_DUPLICATE] for r in records)
    assert "one block of 2 as most of its chunks show" in expected[0]["reason"]


def test_a_shard_stored_as_another_workers_is_shared_content():
    """World 2, 2 KV heads: every chunk's workers differ, but one chunk's worker 1 holds worker 0's bytes."""
    records = _tp2(6, heads_replicated=False)
    records[3].xxh3 = records[2].xxh3
    shared, expected = mark_duplicates(records)
    assert expected == [] and verdicts(records) == {r.key: [Verdict.SHARED_CONTENT] for r in records[2:4]}


def test_the_model_config_says_what_is_replicated():
    """World 4, 2 KV heads: workers 0-1 and 2-3 hold copies; 1 and 2 never do."""
    records = [record(lmcache_key("m", 4, worker, 0xC, "float"), worker // 2) for worker in range(4)]
    records.append(record(lmcache_key("m", 4, 0, 0xD, "float"), 5))
    records.append(record(lmcache_key("m", 4, 3, 0xD, "float"), 5))  # not one block: a finding
    shared, expected = mark_duplicates(records, replication=lambda fields: 2)
    assert [group["keys"] for group in expected] == [[r.key for r in records[:2]], [r.key for r in records[2:4]]]
    assert "by the model config" in expected[0]["reason"]
    assert [group["keys"] for group in shared] == [[records[4].key, records[5].key]]


def test_other_identical_bytes_stay_findings():
    records = [record(lmcache_key("m", 1, 0, 0xA, "float"), 9), record(lmcache_key("m", 1, 0, 0xB, "float"), 9),
               record("opaque-1", 8), record("opaque-2", 8)]
    shared, expected = mark_duplicates(records)
    assert expected == [] and len(shared) == 2 and all(r.verdicts == [Verdict.SHARED_CONTENT] for r in records)


def test_marking_twice_changes_nothing():
    records = _tp2(2, heads_replicated=True) + [record("opaque-1", 8), record("opaque-2", 8)]
    first = mark_duplicates(records)
    assert mark_duplicates(records) == first
    assert all(len(r.verdicts) == 1 for r in records)
