"""The HTML report: self-contained, hostile key names inert, the heat map true to the regions,
and a real render in headless Chromium. Report documents are built here (no cluster) and
validated against the report schema, so the page is tested on what scans really write."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import struct
import subprocess
import zlib
from html.parser import HTMLParser
from importlib import resources
from pathlib import Path

import jsonschema
import numpy as np
import pytest

from audit.errors import AuditError
from audit.report.html import HEATMAP_MAX_ROWS, STATE_COLOURS, inert_html, render_html, write_html
from audit.report.inert import printable

SCHEMA = json.loads(resources.files("audit").joinpath("schemas/report.schema.json").read_text())
LAYOUT = "tiny-mamba/group:0/mamba1/tp2"
HOSTILE_KEYS = [
    "</script><script>alert(1)</script>",
    "<img src=x onerror=alert(1)>",
    "{{ config.__class__ }} {% raw %}",
    "line1\nline2\x1b[31m\u202eevil",
    '" onmouseover="alert(1)',
]


# --- report documents ------------------------------------------------------------------------

def layer_regions(layer: int, *, conv_zero=False, ssm_zero=False, nan=0, padding=False) -> list[dict]:
    """One recurrent-state segment (conv, ssm, optional padding) as the judge reports it."""
    offset = layer * 192
    regions = [
        dict(segment=f"layers.{layer}", layer=layer, region="conv", kind="state", offset=offset, length=64,
             dtype="bfloat16", xxh3="0" * 16, zero=conv_zero, nan=0, inf=0),
        dict(segment=f"layers.{layer}", layer=layer, region="ssm", kind="state", offset=offset + 64, length=64,
             dtype="bfloat16", xxh3="1" * 16, zero=ssm_zero, nan=nan, inf=0),
    ]
    if padding:
        regions.append(dict(segment=f"layers.{layer}", layer=layer, region="padding", kind="padding",
                            offset=offset + 128, length=64, dtype="raw", xxh3="2" * 16, zero=False, nan=0, inf=0))
    return regions


def unused_segment(index: int) -> list[dict]:
    """A hybrid model's segment no layer of the key's group owns: one padding region."""
    return [dict(segment=f"unused.{index}", layer=-1, region="unused", kind="padding", offset=index * 192,
                 length=192, dtype="raw", xxh3="3" * 16, zero=False, nan=0, inf=0)]


def vllm_fields(tp_rank: int, chunk: int, model="tiny-mamba", group=0) -> dict:
    return dict(scheme="vllm", model=model, tp_rank=tp_rank, pcp=0, dcp=0, pp_rank=0, group=group,
                chunk_hash=hashlib.sha256(str(chunk).encode()).hexdigest())


def vllm_key(fields: dict) -> str:
    return (f"{fields['model']}@tp_rank:{fields['tp_rank']}@pcp0@dcp0@pp_rank:0@group:{fields['group']}"
            f"@{fields['chunk_hash']}")


def record(key: str, verdicts: list[str], *, regions=None, fields=None, evidence=None, layout=LAYOUT,
           size=768) -> dict:
    document = dict(key=key, verdicts=verdicts, size=size, xxh3="abcdef0123456789", zero=False,
                    fields=fields or {"scheme": "opaque"}, evidence=evidence or {})
    if regions is not None:
        document["regions"] = regions
        document["layout"] = layout
    return document


def zero_state_record(tp_rank: int, chunk: int, layers=4, **overrides) -> dict:
    fields = vllm_fields(tp_rank, chunk)
    regions = [r for layer in range(layers) for r in layer_regions(layer, conv_zero=True, ssm_zero=True)]
    evidence = {"zero_state": {"state_regions": 2 * layers, "layers": layers, "value_all_zero": True}}
    return record(vllm_key(fields), ["ZERO_STATE"], regions=regions, fields=fields, evidence=evidence, **overrides)


def report(findings: list[dict], *, keys: list[dict] | None = None, exit_code=None, block_tables=False,
           **summary_fields) -> dict:
    """A schema-valid report document whose summary agrees with its records."""
    records = keys if keys is not None else findings
    verdicts: dict[str, int] = {}
    for each in records:
        for verdict in each["verdicts"]:
            verdicts[verdict] = verdicts.get(verdict, 0) + 1
    summary = dict(
        tool={"name": "mooncake-audit", "version": "0.1.0"}, started_at="2026-01-02T03:04:05+00:00",
        finished_at="2026-01-02T03:04:07+00:00", cluster={"master": "10.0.0.5:50051", "admin": "http://10.0.0.5:9003"},
        filters={"prefix": "", "match": None}, read_mode="lease", device="cpu", checker="numpy",
        layouts=[f"{LAYOUT}: 768 bytes per key"], keys_listed=len(records), keys_selected=len(records),
        keys_scanned=len(records), keys_unread=0, keys_not_reached=0, bytes_scanned=768 * len(records),
        duration_s=2.0, bytes_per_s=384 * len(records), findings=len(findings), verdicts=verdicts, shared_groups=0,
        interrupted=False, complete=True, exit_code=(1 if findings else 0) if exit_code is None else exit_code)
    if block_tables:
        summary["block_tables"] = dict(files=["/var/log/vllm/blocks.jsonl"], records=2, keys=len(records),
                                       null_backed_keys=1, keys_not_in_store=0, skipped_lines=0)
    summary.update(summary_fields)
    document = dict(schema="mooncake-audit/report", version=1, summary=summary, findings=findings, shared_groups=[])
    if keys is not None:
        document["keys"] = keys
    jsonschema.validate(document, SCHEMA)
    return document


# --- reading the page back -------------------------------------------------------------------

class Page(HTMLParser):
    """What a browser would build from the page: tags, attributes, text, and the heat maps'
    columns, rows and cells."""

    def __init__(self, text: str):
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict]] = []
        self.text: list[str] = []
        self.heatmaps: list[dict] = []
        self.feed(text)
        self.close()

    def handle_starttag(self, tag, attrs):
        attributes = dict(attrs)
        self.tags.append((tag, attributes))
        kind = attributes.get("class")
        if tag == "svg" and kind == "heatmap":
            self.heatmaps.append({"layout": attributes["data-layout"], "columns": [], "rows": []})
        elif tag == "text" and kind == "column":
            self.heatmaps[-1]["columns"].append(attributes["data-segment"])
        elif tag == "g" and kind == "row":
            self.heatmaps[-1]["rows"].append({"key": attributes["data-key"], "cells": []})
        elif tag == "rect" and kind == "cell":
            self.heatmaps[-1]["rows"][-1]["cells"].append(attributes)

    def handle_data(self, data):
        self.text.append(data)

    def bars(self, chart: str) -> dict[str, int]:
        """label -> count of one bar chart (`verdict-chart`, `rank-chart`, `group-chart`)."""
        inside, bars = False, {}
        for tag, attributes in self.tags:
            if tag == "svg":
                inside = attributes.get("class") == chart
            elif inside and tag == "g" and attributes.get("class") == "bar":
                bars[attributes["data-label"]] = int(attributes["data-count"])
        return bars


# --- the page --------------------------------------------------------------------------------

def test_page_is_self_contained():
    page = render_html(report([zero_state_record(0, 1)], block_tables=True))
    assert page.startswith("<!DOCTYPE html>")
    assert not re.search(r"""\b(?:src|href)\s*=\s*["']?\s*(?:https?:)?//""", page, re.IGNORECASE)
    for fetching in ("<link", "<script", "<iframe", "<img", "@import", "url("):
        assert fetching not in page.lower()
    assert "default-src 'none'" in page  # the CSP: nothing loads or runs even if markup got through
    assert "<svg" in page and "<style>" in page


def test_hostile_key_names_render_as_text():
    zero_regions = layer_regions(0, conv_zero=True, ssm_zero=True)
    findings = [record(key, ["ZERO_STATE"], regions=zero_regions) for key in HOSTILE_KEYS]  # table and heat map
    findings.append(record(HOSTILE_KEYS[1] + "-no-regions", ["ZERO_VALUE"], evidence={"zero": {}}))
    findings.append(record(HOSTILE_KEYS[0] + "-vllm", ["NULL_BACKED", "ZERO_STATE"], regions=zero_regions,
                           fields=vllm_fields(0, 7, model="<b>model</b>"), layout="<svg onload=alert(1)>",
                           evidence={"block_table": {"block_ids": [0], "sources": ["<i>f</i>:1"],
                                                     "req_ids": ["<u>req</u>"]}}))
    page_text = render_html(report(findings, filters={"prefix": "<a href=http://x>", "match": "{{"}))

    assert "<img" not in page_text and "&lt;img src=x onerror=alert(1)&gt;" in page_text
    assert "</script>" not in page_text and "&lt;/script&gt;" in page_text
    for raw in ("<b>model", "<svg onload", "<i>f", "<u>req", "<a href", "\x1b", "\u202e"):
        assert raw not in page_text
    assert "line1\\nline2\\x1b[31m\\u202eevil" in page_text  # control characters shown, not obeyed

    page = Page(page_text)
    tags = {tag for tag, _ in page.tags}
    assert tags <= {"html", "head", "meta", "title", "style", "body", "h1", "h2", "h3", "p", "span", "section",
                    "div", "dl", "dt", "dd", "b", "code", "figure", "svg", "text", "g", "rect", "table", "thead",
                    "tbody", "tr", "th", "td", "br"}
    assert not [name for _, attributes in page.tags for name in attributes if name.startswith("on")]
    text = "".join(page.text)
    for key in HOSTILE_KEYS:  # each name is there, as text, exactly as printable() shows it
        assert printable(key) in text
    row_keys = {row["key"] for heatmap in page.heatmaps for row in heatmap["rows"]}
    assert row_keys == {printable(key) for key in HOSTILE_KEYS + [HOSTILE_KEYS[0] + "-vllm"]}


def test_the_ssd_tier_section_names_unlisted_values_and_latent_copies_as_text():
    hostile = HOSTILE_KEYS[1]
    offload = {"directories": ["/mnt/nvme/offload"], "disk_copies_compared": 7, "disk_copies_divergent": 1,
               "disk_copies_elsewhere": 0,
               "unlisted": {"values": 1, "other_tenants_values": 0,
                            "named": [{"key": "copies/2", "file": "/mnt/nvme/offload/1.bucket", "offset": 9, "size": 256}]},
               "latent": {"copies": 2, "unlike_memory": 1, "named": [
                   {"key": hostile, "file": "/mnt/nvme/offload/2.bucket", "offset": 262_153, "size": 256,
                    "xxh3": "00000000000000aa", "memory_xxh3": "00000000000000bb"},
                   {"key": "again/5", "file": "/mnt/nvme/offload/3.bucket", "offset": 9, "size": 256,
                    "xxh3": "00000000000000cc", "memory_xxh3": "00000000000000cc",
                    "current_copy": {"file": "/mnt/nvme/other/<b>4.bucket", "offset": 9}}]}}
    page_text = render_html(report([], offload=offload))
    assert "<img" not in page_text and "&lt;img src=x onerror=alert(1)&gt;" in page_text
    text = " ".join(Page(page_text).text)
    assert "7 disk copies compared with memory, 1 divergent" in text
    assert "On disk, listed by no master (1)" in text and "copies/2" in text
    assert "On disk, not listed for their key (2, 1 unlike memory)" in text
    rows = re.findall(r'<tr><td class="key">(.*?)</td><td>(.*?)</td><td>(.*?)</td><td>(.*?)</td><td>(.*?)</td>', page_text)
    assert [(key, newer, unlike) for key, _, _, newer, unlike in rows[1:]] == [
        (inert_html(hostile, 512), "", "yes"), ("again/5", "/mnt/nvme/other/&lt;b&gt;4.bucket", "no")]
    assert "SSD tier" not in render_html(report([]))  # no --offload-dir: no section


def test_heat_map_has_a_row_per_flagged_key_and_a_column_per_layer():
    partial = zero_state_record(1, 2, layers=6)
    for region in partial["regions"][4:]:
        region["zero"] = False
    partial["verdicts"] = ["PARTIAL_ZERO"]
    partial["evidence"] = {"partial_zero": {"zero_layers": [0, 1], "layers": 6}}
    other_layout = zero_state_record(0, 3, layers=2, layout="other/group:1/mamba2/tp1")
    no_regions = record("opaque/short", ["SIZE_MISMATCH"], evidence={"size_mismatch": {"expected": 768, "actual": 5}})
    findings = [zero_state_record(0, 1, layers=6), partial, zero_state_record(1, 4, layers=6), other_layout, no_regions]
    ok = record("ok-key", [], regions=[r for layer in range(6) for r in layer_regions(layer)])
    page = Page(render_html(report(findings, keys=findings + [ok])))

    by_layout = {heatmap["layout"]: heatmap for heatmap in page.heatmaps}
    assert set(by_layout) == {LAYOUT, "other/group:1/mamba2/tp1"}
    main = by_layout[LAYOUT]
    assert main["columns"] == [f"layers.{layer}" for layer in range(6)]
    assert sorted(row["key"] for row in main["rows"]) == sorted(r["key"] for r in findings[:3])
    assert all([cell["data-segment"] for cell in row["cells"]] == main["columns"] for row in main["rows"])
    assert [len(row["cells"]) for row in by_layout["other/group:1/mamba2/tp1"]["rows"]] == [2]
    assert "1 flagged key(s) have no per-region results" in "".join(page.text)


def test_heat_map_colours_follow_the_region_states():
    regions = (layer_regions(0, conv_zero=True, ssm_zero=True)               # every state region zero
               + layer_regions(1, conv_zero=True)                            # conv zero, ssm not
               + layer_regions(2, nan=3)                                     # a NaN in ssm
               + layer_regions(3)                                            # fine
               + layer_regions(4, conv_zero=True, ssm_zero=True, padding=True)  # padding does not count
               + unused_segment(5))                                          # padding only
    evidence = {"partial_zero": {"zero_layers": [0, 4], "layers": 5},
                "nonfinite": {"nan": 3, "inf": 0, "regions": [{"segment": "layers.2", "region": "ssm", "nan": 3,
                                                               "inf": 0}]}}
    fields = vllm_fields(0, 9)
    flagged = record(vllm_key(fields), ["PARTIAL_ZERO", "NONFINITE"], regions=regions, fields=fields,
                     evidence=evidence)
    page = Page(render_html(report([flagged])))

    [heatmap] = page.heatmaps
    cells = heatmap["rows"][0]["cells"]
    expected = ["zero", "partly_zero", "nonfinite", "ok", "zero", "padding"]
    assert [cell["data-state"] for cell in cells] == expected
    assert [cell["fill"] for cell in cells] == [STATE_COLOURS[state] for state in expected]
    assert len(set(STATE_COLOURS.values())) == len(STATE_COLOURS)
    assert heatmap["columns"] == [f"layers.{layer}" for layer in range(5)] + ["unused.5"]


def test_heat_map_rows_are_capped_and_rare_damage_stays_visible():
    findings = [zero_state_record(index % 2, index) for index in range(HEATMAP_MAX_ROWS + 4)]
    rare = findings[-1]
    rare["verdicts"] = ["NONFINITE"]
    rare["regions"][1].update(zero=False, nan=1)
    rare["evidence"] = {"nonfinite": {"nan": 1, "inf": 0, "regions": [{"segment": "layers.0", "region": "ssm",
                                                                       "nan": 1, "inf": 0}]}}
    page = Page(render_html(report(findings)))

    rows = page.heatmaps[0]["rows"]
    assert len(rows) == HEATMAP_MAX_ROWS
    assert rows[0]["key"] == rare["key"]
    assert f"Showing {HEATMAP_MAX_ROWS} of {len(findings)} flagged keys" in "".join(page.text)


@pytest.mark.parametrize("exit_code, word", [(0, "clean"), (1, "findings"), (3, "incomplete")])
def test_status_in_words(exit_code, word):
    findings = [zero_state_record(0, 1)] if exit_code == 1 else []
    incomplete = dict(keys_unread=1, complete=False) if exit_code == 3 else {}
    page = render_html(report(findings, exit_code=exit_code, **incomplete))
    assert f'<span class="status status-{word}">{word.upper()}</span>' in page
    assert f"{word} (exit code {exit_code})" in page


def test_summary_gives_cluster_time_keys_bytes_and_rate():
    page = render_html(report([zero_state_record(0, 1)], keys_listed=1000, bytes_scanned=12_000_000_000,
                              duration_s=4.0, bytes_per_s=3_000_000_000))
    text = "".join(Page(page).text)
    for shown in ("10.0.0.5:50051", "http://10.0.0.5:9003", "2026-01-02T03:04:05+00:00", "1,000", "12,000,000,000",
                  "4.00 s", "3.000 GB/s"):
        assert shown in text


def test_charts_count_verdicts_ranks_and_groups_and_never_invent_boundaries():
    null_backed = zero_state_record(1, 5)
    null_backed["verdicts"] = ["NULL_BACKED", "ZERO_STATE"]
    null_backed["evidence"].update(block_table={"block_ids": [0], "sources": ["blocks.jsonl:3"], "req_ids": ["r1"]},
                                   null_backed={"null_block_id": 0, "bytes_zero": True, "state_zero": True})
    findings = [zero_state_record(0, 1), zero_state_record(0, 2), null_backed,
                record("opaque/zero", ["ZERO_VALUE"], evidence={"zero": {}})]
    page = Page(render_html(report(findings, block_tables=True)))

    assert page.bars("verdict-chart") == {"ZERO_STATE": 3, "NULL_BACKED": 1, "ZERO_VALUE": 1}
    assert list(page.bars("rank-chart").items()) == [("tp_rank 0", 2), ("tp_rank 1", 1), ("not vLLM (opaque)", 1)]
    assert page.bars("group-chart") == {"tiny-mamba / group 0": 3, "not vLLM (opaque)": 1}
    text = "".join(page.text)
    assert "boundary unknown. A key names a chunk hash" in text
    assert "block table maps it to NULL block 0; bytes zero: yes" in text

    without_tables = "".join(Page(render_html(report(findings[:2]))).text)
    assert "boundary unknown without block tables" in without_tables


def test_boundaries_from_per_request_block_tables_are_charted():
    findings = [zero_state_record(0, i) for i in range(1, 5)]
    for finding, boundary in zip(findings[:3], (2112, 2112, 3024)):
        finding["evidence"]["block_table"] = {"block_ids": [0], "sources": ["t.jsonl:1"], "req_ids": ["r1"],
                                              "boundary_tokens": boundary}
    page = Page(render_html(report(findings, block_tables=True)))
    assert list(page.bars("boundary-chart").items()) == [("2,112 tokens", 2), ("3,024 tokens", 1)]
    assert "flagged keys with no known boundary: 1." in "".join(page.text)


def test_findings_table_lists_every_finding_with_its_evidence():
    findings = [zero_state_record(0, 1), record("opaque/short", ["SIZE_MISMATCH"],
                                                 evidence={"size_mismatch": {"expected": 768, "actual": 5}}, size=5)]
    page = Page(render_html(report(findings)))
    cells = [attributes for tag, attributes in page.tags if tag == "td" and attributes.get("class") == "key"]
    assert len(cells) == 2
    text = "".join(page.text)
    assert "all 8 state regions in 4 layers zero; whole value zero" in text
    assert "5 bytes, the layout says 768" in text
    assert "abcdef0123456789" in text and "tiny-mamba" in text


def test_binding_findings_are_said_in_words():
    """Issue #40: WEIGHTS_MISMATCH and PREFIX_MISMATCH each get a line of their own, not raw JSON."""
    weights = record("m@group:0@aa", ["WEIGHTS_MISMATCH"], evidence={"weights_mismatch": {
        "layer": 0, "region": "conv", "row_tolerance": 0.05,
        "rows": [{"row": 0, "nearest_token": 7, "distance": 0.01}, {"row": 1, "nearest_token": 9, "distance": 0.23}]}})
    prefix = record("m@group:0@bb", ["PREFIX_MISMATCH"], evidence={"prefix_mismatch": {
        "chunk_hash": "bb" * 32, "region": "v", "window": 16, "recorded_digest": "0123abcd",
        "decoded_digest": "fedc9876", "digest": "xxh3_64", "shared_images": 0}})
    text = "".join(Page(render_html(report([weights, prefix]))).text)
    assert "layer-0 conv rows are no token's image under these weights: 2 rows, farthest 0.23" in text
    assert "16 tokens, digest fedc9876 against 0123abcd recorded" in text
    assert "weights_mismatch:" not in text and "prefix_mismatch:" not in text


def test_unread_keys_explain_an_incomplete_scan():
    unreachable = record("gone/<key>", ["UNREACHABLE"], evidence={})
    unreachable.update(xxh3=None, zero=None, error={"code": -800, "name": "UNREACHABLE", "message": "holder down"})
    keys = [unreachable, record("fine", [])]
    listed = Page(render_html(report([], keys=keys, exit_code=3, keys_unread=1, complete=False)))
    assert "Unread keys (1)" in "".join(listed.text)
    assert "UNREACHABLE (-800): holder down" in "".join(listed.text) and "gone/<key>" in "".join(listed.text)

    counted = "".join(Page(render_html(report([], exit_code=3, keys_unread=1, complete=False))).text)
    assert "1 key(s) could not be read. Scan with --all to list them" in counted


# --- write_html ------------------------------------------------------------------------------

def test_write_html_replaces_the_page_atomically(tmp_path):
    document = report([zero_state_record(0, 1)])
    source, out = tmp_path / "report.json", tmp_path / "report.html"
    source.write_text(json.dumps(document))
    out.write_text("old page")
    write_html(source, out)
    assert out.read_text(encoding="utf-8") == render_html(document)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["report.html", "report.json"]


@pytest.mark.parametrize("content, message", [
    (None, "cannot read report"),
    ("{not json", "is not JSON"),
    ('{"type": "header", "schema": "mooncake-audit/report-jsonl", "version": 1}\n{"type": "summary"}\n',
     "is JSON Lines"),
    ('{"schema": "mooncake-audit/layout", "version": 1}', "is not a mooncake-audit report"),
    ('{"schema": "mooncake-audit/report", "version": 2, "summary": {}, "findings": []}', "has version 2"),
    ('{"schema": "mooncake-audit/report", "version": 1, "summary": {}, "findings": [{"key": "k"}]}', "is malformed"),
    ('{"schema": "mooncake-audit/report", "version": 1, "summary": [], "findings": []}', "is malformed"),
], ids=["missing", "not-json", "jsonl", "other-document", "version", "bad-record", "bad-summary"])
def test_unreadable_or_malformed_reports_are_one_line_errors(tmp_path, content, message):
    source, out = tmp_path / "report\nname.json", tmp_path / "out.html"
    if content is not None:
        source.write_text(content)
    out.write_text("old page")
    with pytest.raises(AuditError) as raised:
        write_html(source, out)
    assert message in str(raised.value) and "\n" not in str(raised.value)
    assert out.read_text() == "old page"


def test_write_html_into_a_missing_directory_is_an_error(tmp_path):
    source = tmp_path / "report.json"
    source.write_text(json.dumps(report([])))
    with pytest.raises(AuditError, match="no directory"):
        write_html(source, tmp_path / "absent" / "out.html")


# --- a real browser --------------------------------------------------------------------------

def read_png(path: Path) -> np.ndarray:
    """Pixels (height, width, channels) of an 8-bit, non-interlaced RGB or RGBA PNG, which is
    what Chromium writes; decoded with zlib so the test needs no imaging library."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    position, compressed = 8, []
    while position < len(data):
        length, kind = struct.unpack(">I4s", data[position:position + 8])
        body = data[position + 8:position + 8 + length]
        if kind == b"IHDR":
            width, height, depth, colour_type, _, _, interlace = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            compressed.append(body)
        position += 12 + length
    assert depth == 8 and colour_type in (2, 6) and interlace == 0
    channels = 3 if colour_type == 2 else 4
    stride = width * channels
    raw = zlib.decompress(b"".join(compressed))
    pixels = np.empty((height, stride), dtype=np.uint8)
    above = np.zeros(stride, dtype=np.uint8)
    for y in range(height):
        start = y * (stride + 1)
        line = np.frombuffer(raw, np.uint8, stride, start + 1)
        pixels[y] = _unfilter(raw[start], line, above, channels)
        above = pixels[y]
    return pixels.reshape(height, width, channels)


def _unfilter(kind: int, line: np.ndarray, above: np.ndarray, channels: int) -> np.ndarray:
    """Undo one scanline's PNG filter (RFC 2083, 6.2); uint8 arithmetic wraps as the spec says."""
    if kind == 0:
        return line
    if kind == 1:
        return np.cumsum(line.reshape(-1, channels), axis=0, dtype=np.uint8).reshape(-1)
    if kind == 2:
        return line + above
    out, up = bytearray(len(line)), above.tobytes()
    for i, x in enumerate(line.tobytes()):
        left = out[i - channels] if i >= channels else 0
        if kind == 3:
            out[i] = (x + (left + up[i]) // 2) & 255
            continue
        corner = up[i - channels] if i >= channels else 0
        estimate = left + up[i] - corner
        far_left, far_up, far_corner = abs(estimate - left), abs(estimate - up[i]), abs(estimate - corner)
        nearest = left if far_left <= far_up and far_left <= far_corner else up[i] if far_up <= far_corner else corner
        out[i] = (x + nearest) & 255
    return np.frombuffer(bytes(out), dtype=np.uint8)


def _rgb(colour: str) -> tuple[int, int, int]:
    return tuple(int(colour[i:i + 2], 16) for i in (1, 3, 5))


@pytest.mark.skipif(shutil.which("chromium") is None,
                    reason="needs Debian's chromium package: apt-get install -y chromium")
def test_chromium_draws_the_heat_map(tmp_path):
    findings = [zero_state_record(rank % 2, rank, layers=8) for rank in range(6)]
    for chunk in range(6, 9):  # half the layers zero
        partial = zero_state_record(0, chunk, layers=8)
        for region in partial["regions"][8:]:
            region["zero"] = False
        partial["verdicts"], partial["evidence"] = ["PARTIAL_ZERO"], {"partial_zero": {"zero_layers": [0, 1, 2, 3],
                                                                                       "layers": 8}}
        findings.append(partial)
    broken = zero_state_record(1, 9, layers=8)
    for region in broken["regions"]:
        region["zero"] = False
    broken["regions"][5]["nan"] = 2
    broken["verdicts"], broken["evidence"] = ["NONFINITE"], {"nonfinite": {"nan": 2, "inf": 0, "regions": []}}
    findings.append(broken)
    html_path, png_path = tmp_path / "report.html", tmp_path / "shot.png"
    page = render_html(report(findings))
    html_path.write_text(page, encoding="utf-8")

    browser = subprocess.run(
        ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={png_path}", "--window-size=1400,1000",
         html_path.as_uri()], capture_output=True, text=True, timeout=120)
    assert browser.returncode == 0 and png_path.exists(), browser.stderr[-2000:]
    pixels = read_png(png_path)[:, :, :3]

    cell = Page(page).heatmaps[0]["rows"][0]["cells"][0]
    cell_area = int(cell["width"]) * int(cell["height"])
    drawn = {state: int(np.all(pixels == _rgb(STATE_COLOURS[state]), axis=-1).sum()) for state in STATE_COLOURS}
    expected_cells = {"zero": 6 * 8 + 3 * 4, "ok": 3 * 4 + 7, "nonfinite": 1}
    for state, cells in expected_cells.items():  # the cells in full, give or take the legend's swatch
        assert cells * cell_area <= drawn[state] <= cells * cell_area + 400, (state, drawn)
    assert drawn["partly_zero"] < 400 and drawn["padding"] < 400  # legend swatches only
