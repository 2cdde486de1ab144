"""`impact`'s formats: the terminal keeps a key to one line and hostile strings inert, the JSON
document carries its versioned fields, the page escapes everything and loads nothing; and the
scan report's human table keeps keys to one line too (`short_key`)."""

from __future__ import annotations

import io
import json
import re
from html.parser import HTMLParser

from audit.forensics.impact import assess_impact
from audit.judge.merge import merge_records
from audit.loadrecords import read_load_records
from audit.records import KeyRecord
from audit.report.human import HumanSink
from audit.report.impact import TIMELINE_MAX_ROWS, print_human, render_impact_html, write_impact
from audit.report.inert import short_key
from tests.forensics.test_impact import BAD1, BAD2, T0, load, write_incident, write_jsonl

DEMO_KEY = "mamba-130m-hf@tp_rank:1@pcp0@dcp0@pp_rank:0@group:2@" + "3f9a1c2e" + "5" * 50 + "9d0b1f"
HOSTILE = "<script>alert(1)</script>\x1b[31m[red]x[/red]\n"


def test_short_key_elides_the_middle_of_long_hashes_only():
    assert short_key(DEMO_KEY) == "mamba-130m-hf@tp_rank:1@pcp0@dcp0@pp_rank:0@group:2@3f9a1c2e…9d0b1f"
    lmcache = "Qwen/Qwen3-0.6B@1@0@" + "ab" * 16 + "@bfloat16"
    assert short_key(lmcache) == "Qwen/Qwen3-0.6B@1@0@abababab…ababab@bfloat16"  # a hash inside the key too
    sglang_page = "c0ffee" + "0" * 58 + "_0_k"
    assert short_key(sglang_page) == "c0ffee00…000000_0_k"
    for whole in ("a@0123456789abcdef", "m@" + "f" * 23, "sglang_mooncake_store_warmup_key" + "0" * 32,
                  "tenant-a/run-1", "model@tp_rank:0@deadbeefdeadbeefdeadbeefXYZ"):
        assert short_key(whole) == whole  # 64-bit hashes, numbers, hex glued to words stay whole
    assert short_key("bad\x1b[31m@" + "e" * 64) == "bad\\x1b[31m@eeeeeeee…eeeeee"  # and printable


def test_the_scan_reports_human_table_keeps_each_key_on_one_line(tmp_path):
    records = [KeyRecord(key=DEMO_KEY[:-6] + f"{n:06x}", size=4096, fields=None, xxh3=n, zero=True,
                         verdicts=["NULL_BACKED", "ZERO_STATE"]) for n in range(3)]
    report = merge_records(records, context={}, keys_listed=3)
    out = tmp_path / "report.txt"
    HumanSink(out).finish(report)
    lines = out.read_text().splitlines()
    for n in range(3):
        shown = [line for line in lines if f"3f9a1c2e…{n:06x}" in line]
        assert len(shown) == 1 and "mamba-130m-hf@tp_rank:1@pcp0@dcp0@pp_rank:0@group:2@" in shown[0]
        assert "NULL_BACKED" in shown[0] and f"{n:016x}" in shown[0]  # verdicts and digest on the same line
    assert not any("5555555555" in line for line in lines)


def _incident(tmp_path):
    report, records_dir = write_incident(tmp_path)
    from audit.forensics.impact import impact_of_report

    return impact_of_report(report, [records_dir])


def test_human_prints_one_key_per_line_then_requests_by_host_and_hour(tmp_path):
    result = _incident(tmp_path)
    stream = io.StringIO()
    print_human(result.to_json(), stream)
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("AFFECTED: 6 request(s) served a flagged key (6 of 8 flagged key(s) loaded")
    table = [line for line in lines if line.startswith("tiny-mamba@")]
    affected = [row["key"] for row in result.affected]
    gone = [row["key"] for row in result.loaded_gone]
    assert [line.split()[0] for line in table] == [short_key(k) for k in affected + gone]  # one line each, in order
    first = table[0].split()
    assert first[1:6] == ["ZERO_STATE", "3", "0", "2", "host-a"]  # BAD1: served 3, refused 0, 2 requests, 2 hosts
    assert "requests by host: host-a 1, host-b 5" in lines
    assert "requests by hour (UTC): 2026-05-28T20:00Z 1, 2026-05-28T21:00Z 5" in lines
    assert "requests affected: r1, r2, r3, r4, r10, r11" in lines
    assert all(len(line) <= 160 for line in lines)


def test_human_and_html_keep_hostile_strings_inert(tmp_path):
    loads = read_load_records([write_jsonl(tmp_path / "loads-h-1-0001.jsonl", [
        load(HOSTILE, 0, host="<b>host</b>\x1b]8;;http://x\x07", request_id="<img src=x onerror=alert(1)>")])])
    records = [KeyRecord(key=HOSTILE, size=8, fields=None, xxh3=1, zero=True, verdicts=["ZERO_VALUE"])]
    result = assess_impact(records, loads, report_complete=True)
    assert result.exit_code == 1 and result.to_json()["affected"][0]["key"] == HOSTILE  # JSON: whole, as data
    stream = io.StringIO()
    print_human(result.to_json(), stream)
    text = stream.getvalue()
    assert "\x1b" not in text and "\x07" not in text
    assert "<script>alert(1)</script>\\x1b[31m[red]x[/red]\\n" in text and "[red]x[/red]" in text

    page = render_impact_html(result.to_json(), result.timeline)
    assert "<script" not in page and "<img" not in page and "<b>host" not in page and "\x1b" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page and "&lt;img src=x onerror=alert(1)&gt;" in page
    assert "default-src 'none'" in page
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page)  # nothing fetched


class _Page(HTMLParser):
    def __init__(self, page: str):
        super().__init__()
        self.rows, self.ticks, self.tags = [], [], []
        self.feed(page)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.tags.append(tag)
        if tag == "g" and attrs.get("class") == "row":
            self.rows.append(attrs)
        if tag == "rect" and attrs.get("class") in ("served", "refused"):
            self.ticks.append((len(self.rows) - 1, attrs["class"], int(attrs["x"])))


def test_html_draws_one_timeline_row_per_loaded_flagged_key_with_its_loads(tmp_path):
    result = _incident(tmp_path)
    page = _Page(render_impact_html(result.to_json(), result.timeline))
    assert [row["data-key"] for row in page.rows] == [row["key"] for row in result.affected]
    by_row = {}
    for row, kind, _ in page.ticks:
        by_row.setdefault(page.rows[row]["data-key"], []).append(kind)
    assert by_row[BAD1] == ["served"] * 3
    assert sorted(by_row[BAD2]) == ["refused", "served"]  # its two served loads, 2 s apart in an hour: one pixel
    xs = [x for row, _, x in page.ticks if page.rows[row]["data-key"] == BAD2]
    assert xs == sorted(xs)  # in time order, left to right
    assert "script" not in page.tags and "img" not in page.tags and "link" not in page.tags


def test_html_timeline_is_capped_and_dense_rows_stay_small(tmp_path):
    many = [load(f"k{n:04d}@" + "a" * 64, n, request_id=f"r{n}") for n in range(TIMELINE_MAX_ROWS + 5)]
    many += [load("k0000@" + "a" * 64, n / 1000, request_id="dense") for n in range(20_000)]
    loads = read_load_records([write_jsonl(tmp_path / "loads-h-1-0001.jsonl", many)])
    records = [KeyRecord(key=row["key"], size=8, fields=None, xxh3=1, zero=True, verdicts=["ZERO_VALUE"])
               for row in many[:TIMELINE_MAX_ROWS + 5]]
    result = assess_impact(records, loads, report_complete=True)
    page = _Page(render_impact_html(result.to_json(), result.timeline))
    assert len(page.rows) == TIMELINE_MAX_ROWS and result.affected[0]["loads"] == 20_001
    assert sum(1 for row, _, _ in page.ticks if row == 0) <= 800  # one tick a pixel, not one a load


def test_write_impact_json_is_the_versioned_document(tmp_path):
    result = _incident(tmp_path)
    out = tmp_path / "impact.json"
    write_impact(result.to_json(), result.timeline, "json", out)
    document = json.loads(out.read_text())
    assert (document["schema"], document["version"]) == ("mooncake-audit/impact", 1)
    assert set(document) == {"schema", "version", "summary", "affected", "requests", "loaded_gone", "by_host",
                             "by_hour"}
    assert {"requests_affected", "flagged_keys", "flagged_keys_loaded", "loads_of_flagged", "refused_loads",
            "load_records", "files", "skipped_lines", "first_load", "last_load", "report_complete",
            "exit_code"} <= set(document["summary"])
    assert set(document["affected"][0]) >= {"key", "verdicts", "loads", "refused", "request_ids", "vllm_request_ids",
                                            "hosts", "first_load", "last_load"}
    assert document["affected"][0]["first_load_unix"] == T0 + 10
