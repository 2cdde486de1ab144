"""`impact`: a report's flagged keys joined with the consumers' load records. An incident is built
here as files (a report, put records, load records): which requests got which keys is known, so
the join is held to exact request sets, counts and exit codes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from audit.errors import AuditError
from audit.forensics.impact import IMPACT_SCHEMA, assess_impact, impact_of_report
from audit.judge.merge import SCHEMA
from audit.keys import vllm_key
from audit.loadrecords import is_load_record_path, read_load_records
from audit.records import KeyRecord

T0 = 1_780_000_000.0  # 2026-05-28T20:26:40Z


def key(n: int, tp_rank: int = 0) -> str:
    return vllm_key("tiny-mamba", f"{n:02x}" * 32, tp_rank=tp_rank, group=1)


BAD1, BAD2, NULL_IN_REPORT, REFUSED_ONLY, FAILED_ONLY, UNLOADED = (key(n) for n in (1, 2, 3, 4, 5, 6))
GOOD1, GOOD2, GONE, GONE_NULL, WARNED = key(10), key(11), key(12), key(13), key(14)


def record(name: str, verdicts=(), zero=False) -> KeyRecord:
    return KeyRecord(key=name, size=4096, fields=None, xxh3=0x1234 + len(verdicts), zero=zero,
                     verdicts=list(verdicts))


def report_records() -> list[KeyRecord]:
    """The scan: two bad keys by their bytes, one warning, a key clean by its bytes (block 0 was
    not zero) that the put records say is null-backed, keys never served, good keys."""
    return [record(BAD1, ["ZERO_STATE"]), record(BAD2, ["NONFINITE"]), record(NULL_IN_REPORT),
            record(REFUSED_ONLY, ["ZERO_STATE"]), record(FAILED_ONLY, ["PARTIAL_ZERO"]),
            record(UNLOADED, ["ZERO_STATE"]), record(GOOD1), record(GOOD2),
            record(WARNED, ["SHARED_CONTENT"])]


def load(name, when, host="host-a", request_id=None, vllm_request_id=None, rc=4096, **extra) -> dict:
    return {"key": name, "time": T0 + when, "host": host, "pid": 100, "request_id": request_id,
            "vllm_request_id": vllm_request_id, "bytes": 4096, "rc": rc, **extra}


LOADS_A = [  # host-a, process 100
    load(BAD1, 10, request_id="r1", vllm_request_id="1-aa"),
    load(GOOD1, 11, request_id="r1", vllm_request_id="1-aa"),
    load(GOOD1, 20, request_id="r6", vllm_request_id="6-ff"),
    load(GOOD2, 21, request_id="r7"),
    load(REFUSED_ONLY, 30, request_id="r5", refused=True, reason="ZERO_STATE"),
    load(FAILED_ONLY, 31, request_id="r8", rc=-704, error="OBJECT_NOT_FOUND"),
    load(FAILED_ONLY, 32, request_id="r8", rc=None, error="RuntimeError: transfer failed"),  # the get raised
    load(BAD1, 40, request_id=None, vllm_request_id=None),   # served, naming no request
    load(GONE, 50, request_id="r9"),
]
LOADS_B = [  # host-b, in a subdirectory
    load(BAD1, 3600 + 5, host="host-b", request_id="r2", tp_rank=1),
    load(BAD2, 3600 + 6, host="host-b", request_id="r2"),
    load(GOOD2, 3600 + 7, host="host-b", request_id="r3", vllm_request_id="3-cc"),
    load(BAD2, 3600 + 8, host="host-b", vllm_request_id="3-cc"),  # the API's id is on another of r3's loads
    load(NULL_IN_REPORT, 3600 + 9, host="host-b", request_id="r4"),
    load(GONE_NULL, 3600 + 10, host="host-b", request_id="r10"),
    load(WARNED, 3600 + 11, host="host-b", request_id="r11"),
    load(BAD2, 3600 + 12, host="host-b", request_id="r12", refused=True, reason="NONFINITE"),
]
PUTS = [{"key": NULL_IN_REPORT, "block_ids": [0], "rc": 0, "time": T0}, {"key": GONE_NULL, "block_ids": [0], "rc": 0,
        "time": T0}, {"key": GOOD1, "block_ids": [7], "rc": 0, "time": T0}]
# Served flagged keys: BAD1 (r1, r2, unnamed), BAD2 (r2, r3), NULL_IN_REPORT (r4), GONE_NULL (r10), WARNED (r11).
AFFECTED_REQUESTS = {"r1", "r2", "r3", "r4", "r10", "r11"}


def write_jsonl(path: Path, rows) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return path


def write_incident(tmp_path: Path, records=None, loads_a=LOADS_A, loads_b=LOADS_B, *, every_key=True) -> tuple[Path, Path]:
    """(the report, the recorder's directory) of the incident above."""
    records = report_records() if records is None else records
    findings = [r.to_json() for r in records if r.is_finding]
    document = {"schema": SCHEMA, "version": 1,
                "summary": {"finished_at": "2026-05-29T00:00:00+00:00", "findings": len(findings)},
                "findings": findings, "shared_groups": [], "expected_duplicates": []}
    if every_key:
        document["keys"] = [r.to_json() for r in records]
    report = tmp_path / "report.json"
    report.write_text(json.dumps(document))
    records_dir = tmp_path / "mooncake-audit"
    write_jsonl(records_dir / "blocks-host-a-100-0001.jsonl", PUTS)
    (records_dir / "manifest-host-a-100.json").write_text("{}")
    write_jsonl(records_dir / "loads-host-a-100-0001.jsonl", loads_a)
    write_jsonl(records_dir / "rank1" / "loads-host-b-200-0001.jsonl", loads_b)
    write_jsonl(records_dir / "denied-host-a-100-0001.jsonl", [{"key": REFUSED_ONLY, "time": T0, "reason": "ZERO_STATE"}])
    return report, records_dir


def test_load_records_are_read_from_subdirectories_and_only_from_load_files(tmp_path):
    _, records_dir = write_incident(tmp_path)
    loads = read_load_records([records_dir])
    assert loads.records == len(LOADS_A) + len(LOADS_B) and loads.skipped_lines == 0
    assert [Path(f).name for f in loads.files] == ["loads-host-a-100-0001.jsonl", "loads-host-b-200-0001.jsonl"]
    bad1 = loads.get(BAD1)
    assert [(l.host, l.request_id, l.served, l.tp_rank) for l in bad1] == [
        ("host-a", "r1", True, None), ("host-a", None, True, None), ("host-b", "r2", True, 1)]
    refused, (failed, raised) = loads.get(REFUSED_ONLY)[0], loads.get(FAILED_ONLY)
    assert (refused.refused, refused.served, refused.failed) == ("ZERO_STATE", False, False)
    assert (failed.refused, failed.rc, failed.served, failed.failed) == (None, -704, False, True)
    assert (raised.rc, raised.served, raised.failed) == (None, False, True)
    assert is_load_record_path(Path("x/loads-h-1-0002.jsonl")) and is_load_record_path("loads-h-1-0002.jsonl.1")
    assert not is_load_record_path(Path("blocks-h-1-0.jsonl")) and not is_load_record_path(Path("loads-h.json"))


@pytest.mark.parametrize("line, reason", [
    ("{not json", "Expecting property name"),
    ('["a list"]', "JSON object"),
    (json.dumps({**load(BAD1, 0), "time": "noon"}), "'time'"),
    (json.dumps({k: v for k, v in load(BAD1, 0).items() if k != "rc"}), "'rc'"),
    (json.dumps({**load(BAD1, 0), "rc": "4096"}), "'rc'"),
    (json.dumps({k: v for k, v in load(BAD1, 0).items() if k != "host"}), "'host'"),
    (json.dumps({**load(BAD1, 0), "request_id": 7}), "'request_id'"),
    (json.dumps({**load(BAD1, 0), "refused": True}), "'reason'"),
    (json.dumps({**load(BAD1, 0), "refused": 1, "reason": "ZERO_STATE"}), "'refused' must be true or false"),
    (json.dumps({**load(BAD1, 0), "pid": True}), "'pid'"),
    (json.dumps({**load(BAD1, 0), "time": float("nan")}), "'time'"),
])
def test_a_malformed_line_names_file_and_line_or_is_skipped_when_lenient(tmp_path, line, reason):
    path = write_jsonl(tmp_path / "loads-h-1-0001.jsonl", [load(GOOD1, 0), line, load(GOOD2, 1)])
    with pytest.raises(AuditError) as error:
        read_load_records([tmp_path])
    assert str(error.value).startswith(f"load records {path}:2: ") and reason in str(error.value)
    lenient = read_load_records([tmp_path], lenient=True)
    assert (lenient.records, lenient.skipped_lines, sorted(lenient.loads)) == (2, 1, sorted([GOOD1, GOOD2]))


def test_the_join_names_exactly_the_requests_served_flagged_keys(tmp_path):
    report, records_dir = write_incident(tmp_path)
    result = impact_of_report(report, [records_dir])
    document = result.to_json()
    assert document["schema"] == IMPACT_SCHEMA and document["version"] == 1 and result.exit_code == 1
    summary = document["summary"]
    assert {row["request"] for row in document["requests"]} == AFFECTED_REQUESTS  # precision and recall
    assert summary["requests_affected"] == len(AFFECTED_REQUESTS)
    assert summary["served_without_request_id"] == 1
    # Flagged: the report's 6 findings (WARNED's SHARED_CONTENT is a warning, and a finding), and
    # NULL_IN_REPORT and GONE_NULL from the put records.
    assert summary["flagged_keys"] == 8 and summary["null_backed_from_block_tables"] == 2
    assert summary["flagged_keys_loaded"] == 6 and summary["flagged_keys_served"] == 5
    assert (summary["loads_of_flagged"], summary["served_loads_of_flagged"], summary["refused_loads_of_flagged"]) \
        == (12, 8, 2)
    assert (summary["refused_loads"], summary["failed_loads"], summary["load_records"], summary["keys_loaded"]) \
        == (2, 2, 17, 10)
    assert (summary["first_load"], summary["last_load"]) == ("2026-05-28T20:26:50.000+00:00",
                                                             "2026-05-28T21:26:52.000+00:00")
    assert summary["report_complete"] is True and summary["loaded_gone"] == 2 and summary["exit_code"] == 1
    assert summary["block_tables"]["null_backed_keys"] == 2 and summary["block_tables"]["keys_not_in_store"] == 1
    assert [Path(f).name for f in summary["block_tables"]["files"]] == ["blocks-host-a-100-0001.jsonl"]  # puts only

    rows = {row["key"]: row for row in document["affected"]}
    assert [row["key"] for row in document["affected"]] == [BAD1, REFUSED_ONLY, BAD2, NULL_IN_REPORT, GONE_NULL, WARNED]
    assert FAILED_ONLY not in rows and UNLOADED not in rows and GOOD1 not in rows  # never served nor refused
    assert {name: (row["loads"], row["refused"], row["requests"]) for name, row in rows.items()} == {
        BAD1: (3, 0, 2), REFUSED_ONLY: (0, 1, 0), BAD2: (2, 1, 2), NULL_IN_REPORT: (1, 0, 1), GONE_NULL: (1, 0, 1),
        WARNED: (1, 0, 1)}
    assert (rows[BAD1]["request_ids"], rows[BAD1]["vllm_request_ids"], rows[BAD1]["hosts"]) == (
        ["r1", "r2"], ["1-aa"], ["host-a", "host-b"])
    assert (rows[BAD2]["request_ids"], rows[BAD2]["vllm_request_ids"], rows[BAD2]["refused_requests"],
            rows[BAD2]["refused_reasons"]) == (["r2"], ["3-cc"], ["r12"], {"NONFINITE": 1})
    assert (rows[REFUSED_ONLY]["request_ids"], rows[REFUSED_ONLY]["refused_requests"]) == ([], ["r5"])
    assert rows[NULL_IN_REPORT]["verdicts"] == ["NULL_BACKED"] and rows[NULL_IN_REPORT]["in_report"] is True
    assert rows[GONE_NULL]["verdicts"] == ["NULL_BACKED"] and rows[GONE_NULL]["in_report"] is False
    assert (rows[WARNED]["severity"], rows[BAD1]["severity"]) == ("warning", "error")
    assert (rows[BAD1]["first_load"], rows[BAD1]["last_load"]) == ("2026-05-28T20:26:50.000+00:00",
                                                                   "2026-05-28T21:26:45.000+00:00")

    requests = {row["request"]: row for row in document["requests"]}
    assert (requests["r3"]["request_id"], requests["r3"]["vllm_request_ids"], requests["r3"]["keys"]) == (
        "r3", ["3-cc"], 1)  # vLLM's id alone on the flagged load, the API's from another load of r3
    assert (requests["r2"]["keys"], requests["r2"]["hosts"]) == (2, ["host-b"])
    assert document["by_host"] == {"host-a": 1, "host-b": 5}
    assert document["by_hour"] == {"2026-05-28T20:00Z": 1, "2026-05-28T21:00Z": 5}
    assert [(row["key"], row["loads"], row["served"], row["flagged"]) for row in document["loaded_gone"]] == [
        (GONE_NULL, 1, 1, True), (GONE, 1, 1, False)]
    assert result.timeline[BAD2] == [(T0 + 3606, True), (T0 + 3608, True), (T0 + 3612, False)]
    json.dumps(document)  # plain JSON throughout


def test_a_findings_only_report_says_so_and_lists_no_loaded_gone(tmp_path):
    report, records_dir = write_incident(tmp_path, every_key=False)
    summary = impact_of_report(report, [records_dir]).to_json()
    assert summary["summary"]["report_complete"] is False and summary["summary"]["loaded_gone"] is None
    assert summary["loaded_gone"] == []
    # The put records still flag NULL_IN_REPORT (clean bytes: not among the findings) and GONE_NULL.
    assert {row["request"] for row in summary["requests"]} == AFFECTED_REQUESTS


def test_a_jsonl_report_holds_every_key(tmp_path):
    _, records_dir = write_incident(tmp_path)
    report = write_jsonl(tmp_path / "report.jsonl", [
        {"type": "header", "schema": SCHEMA + "-jsonl", "version": 1},
        *({"type": "key", **r.to_json()} for r in report_records()), {"type": "summary", "findings": 6}])
    document = impact_of_report(report, [records_dir]).to_json()
    assert document["summary"]["report_complete"] is True and len(document["loaded_gone"]) == 2
    assert document["summary"]["requests_affected"] == len(AFFECTED_REQUESTS)


def test_without_put_records_only_the_reports_verdicts_flag(tmp_path):
    records = report_records()
    records[2].verdicts.append("NULL_BACKED")  # NULL_IN_REPORT: the scan had block tables
    loads = read_load_records([write_incident(tmp_path)[1]])
    result = assess_impact(records, loads, tables=None, report_complete=True)
    assert {row["request"] for row in result.requests} == AFFECTED_REQUESTS - {"r10"}  # GONE_NULL: no table says
    assert result.summary["null_backed_from_block_tables"] == 0 and result.summary["flagged_keys"] == 7


def test_refused_loads_alone_exit_0_and_are_listed(tmp_path):
    loads = read_load_records([write_jsonl(tmp_path / "loads-h-1-0001.jsonl", [
        load(REFUSED_ONLY, 0, request_id="r5", refused=True, reason="ZERO_STATE"),
        load(GOOD1, 1, request_id="r6"), load(FAILED_ONLY, 2, request_id="r8", rc=-800)])])
    result = assess_impact(report_records(), loads, report_complete=True)
    assert result.exit_code == 0 and result.requests == [] and result.summary["requests_affected"] == 0
    assert [(row["key"], row["loads"], row["refused"]) for row in result.affected] == [(REFUSED_ONLY, 0, 1)]
    assert result.by_host == {} and result.by_hour == {}


def test_unreadable_inputs_are_one_line_errors(tmp_path):
    report, records_dir = write_incident(tmp_path)
    with pytest.raises(AuditError, match="cannot read report"):
        impact_of_report(tmp_path / "missing.json", [records_dir])
    (records_dir / "loads-host-a-100-0002.jsonl").write_bytes(b'{"key": "\xff"}\n\xff\xfe\n')
    with pytest.raises(AuditError, match="not UTF-8"):
        impact_of_report(report, [records_dir])
