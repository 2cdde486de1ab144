"""One key's record, as `judge_read` makes it from a read and its check."""

from __future__ import annotations

from audit.checks.host import ValueCheck
from audit.judge.key import judge_read
from audit.records import KeyInfo, KeyRecord


def test_a_clean_read_is_recorded_field_by_field():
    """`judge_read` builds the record positionally (it runs once a key): every field lands where its
    name says, whatever order KeyRecord's fields come to have."""
    key = KeyInfo("m@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@1a", 256, {"scheme": "vllm"}, [], None, 7)
    record = judge_read(key, 256, ValueCheck(xxh3=0x1234, zero=False))
    assert record == KeyRecord(key=key.name, size=256, fields={"scheme": "vllm"}, xxh3=0x1234, zero=False, ordinal=7)
    assert record.verdicts == [] and record.evidence == {} and record.verdicts is not judge_read(
        key, 256, ValueCheck(xxh3=0x1234, zero=False)).verdicts  # a fresh list for each record
