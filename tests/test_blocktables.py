"""Producer block-table files: both record shapes, directories, malformed lines."""

from __future__ import annotations

import json

import pytest

from audit.blocktables import read_block_tables
from audit.errors import AuditError
from audit.keys import vllm_key


def _write(path, lines):
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def test_per_request_records_expand_to_vllm_keys(tmp_path):
    table = _write(tmp_path / "t.jsonl", [{
        "req_id": "r1", "model": "/models/mamba-130m-hf", "tp_rank": 1, "pp_rank": 0, "pcp": 0, "dcp": 0,
        "cache_prefix": "", "group": 0, "block_size": 528, "block_ids": [7, 0, 9], "chunk_hashes": ["aa", "bb", "cc"]}])
    tables = read_block_tables([table])
    keys = [vllm_key("mamba-130m-hf", h, tp_rank=1) for h in ("aa", "bb", "cc")]
    assert sorted(tables.entries) == sorted(keys)
    assert [tables.get(k).null_backed for k in keys] == [False, True, False]
    assert [tables.get(k).boundary for k in keys] == [528, 1056, 1584]  # tokens up to the chunk's end
    assert tables.get(keys[1]).sources == [f"{table}:1"] and tables.get(keys[1]).req_ids == ["r1"]


def test_per_key_records_with_one_or_many_segments_and_directories(tmp_path):
    (tmp_path / "rank0").mkdir()
    _write(tmp_path / "rank0" / "a.jsonl", [{"key": "k1", "block_id": 3}, {"key": "k2", "block_ids": [4, 0, 4]}])
    _write(tmp_path / "b.jsonl", [{"key": "k3", "block_ids": [5, 5], "rc": 0, "pid": 12}, ""])
    tables = read_block_tables([tmp_path])
    assert {k: e.block_ids for k, e in tables.entries.items()} == {"k1": (3,), "k2": (4, 0, 4), "k3": (5, 5)}
    assert tables.records == 3 and len(tables.files) == 2
    assert [k for k, e in tables.entries.items() if e.null_backed] == ["k2"]


def test_a_null_record_wins_over_a_real_one_for_the_same_key(tmp_path):
    tables = read_block_tables([_write(tmp_path / "t.jsonl", [{"key": "k", "block_id": 5}, {"key": "k", "block_id": 0}])])
    assert tables.get("k").null_backed and len(tables.get("k").sources) == 2


def test_the_source_of_a_key_is_its_first_successful_put(tmp_path):
    """Mooncake keeps a key's first copy; withheld and failed puts store nothing (issue #11)."""
    _write(tmp_path / "rank0.jsonl", [
        # the guard withheld a block-0 read, and vLLM's retry stored the key from block 5
        {"key": "retried", "block_ids": [0, 0], "rc": -600, "withheld": True, "reason": "NULL_BLOCK_ID", "time": 1.0},
        {"key": "retried", "block_ids": [5, 5], "rc": 0, "time": 2.0},
        # a put that failed in transfer, then a good one
        {"key": "failed-first", "block_ids": [0, 0], "rc": -800, "time": 1.0},
        {"key": "failed-first", "block_ids": [6, 6], "rc": 0, "time": 2.0},
        # the block-0 put landed first: the later real put changed nothing (#53084's dedup)
        {"key": "null-first", "block_ids": [0, 0], "rc": 0, "time": 1.0},
        {"key": "null-first", "block_ids": [7, 7], "rc": 0, "time": 3.0},
        {"key": "never-stored", "block_ids": [0, 0], "rc": -600, "withheld": True, "time": 1.0},
    ])
    # another process's file, read later, holds the earliest successful put of a key
    _write(tmp_path / "rank1.jsonl", [{"key": "real-first", "block_ids": [8, 8], "rc": 0, "time": 0.5}])
    _write(tmp_path / "rank2.jsonl", [{"key": "real-first", "block_ids": [0, 0], "rc": 0, "time": 0.9}])
    tables = read_block_tables([tmp_path / "rank2.jsonl", tmp_path / "rank0.jsonl", tmp_path / "rank1.jsonl"])
    assert {k: e.block_ids for k, e in tables.entries.items()} == {
        "retried": (5, 5), "failed-first": (6, 6), "null-first": (0, 0), "real-first": (8, 8)}
    assert sorted(k for k, e in tables.entries.items() if e.null_backed) == ["null-first"]
    assert tables.failed_puts == 3 and tables.summary(None)["failed_puts"] == 3


@pytest.mark.parametrize("line, reason", [
    ("{not json", "Expecting property name"),
    ('["a list"]', "JSON object"),
    ('{"key": "k"}', "block_id"),
    ('{"key": "k", "block_id": -1}', "non-negative"),
    ('{"model": "m", "block_ids": [1], "chunk_hashes": ["a", "b"]}', "equal length"),
    ('{"block_ids": [1]}', "'key'"),
])
def test_malformed_line_names_file_and_line_or_is_skipped_when_lenient(tmp_path, line, reason):
    table = _write(tmp_path / "bad.jsonl", [{"key": "ok", "block_id": 1}, line, {"key": "ok2", "block_id": 2}])
    with pytest.raises(AuditError) as error:
        read_block_tables([table])
    assert f"{table}:2" in str(error.value) and reason in str(error.value)
    lenient = read_block_tables([table], lenient=True)
    assert lenient.skipped_lines == 1 and sorted(lenient.entries) == ["ok", "ok2"]


def test_missing_file_is_a_clean_error(tmp_path):
    with pytest.raises(AuditError, match="cannot read block table"):
        read_block_tables([tmp_path / "absent.jsonl"])


def test_summary_counts_keys_not_in_the_store(tmp_path):
    tables = read_block_tables([_write(tmp_path / "t.jsonl", [{"key": "here", "block_id": 0}, {"key": "gone", "block_id": 2}])])
    summary = tables.summary({"here", "other"})
    assert summary["keys_not_in_store"] == 1 and summary["null_backed_keys"] == 1 and summary["records"] == 2


def test_recorder_lines_without_resolved_blocks_are_counted_not_errors(tmp_path):
    table = _write(tmp_path / "blocks-host-1-0.jsonl", [
        {"key": "k1", "block_ids": [2, 2]},
        {"key": "k2", "block_ids": None, "offsets": [12], "note": "segment offset is not a multiple of its size"}])
    tables = read_block_tables([table])
    assert sorted(tables.entries) == ["k1"] and tables.unresolved == 1
    assert tables.summary(None)["unresolved_records"] == 1
