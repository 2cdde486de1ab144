"""`mooncake-audit report REPORT.json --html OUT.html`: a JSON report as one self-contained page.

Everything is inline (CSS, SVG pictures) and nothing is fetched or run: the page opens the same
from a ticket attachment or an air-gapped share, and its Content-Security-Policy forbids scripts
and network loads should a bug ever let markup through. Every string taken from the report (key
names above all, but also models, request ids, file names) is untrusted: it goes through
`inert_html`, which makes control characters visible and escapes markup. `page`, `inert_html` and
`verdict_badges` serve `impact`'s page too (audit.report.impact).
"""

from __future__ import annotations

import html
import json
from collections import Counter
from pathlib import Path

from audit.errors import AuditError
from audit.records import FINDINGS, INCOMPLETE, UNJUDGED
from audit.report.coverage import coverage_headline, current_copy_place, gap_lines, missed_keys
from audit.report.inert import human_bytes, printable
from audit.report.output import ReportOutput

REPORT_SCHEMA = "mooncake-audit/report"
HEATMAP_MAX_ROWS = 200      # per layout; the JSON report keeps every key
TABLE_MAX_ROWS = 5000       # findings table; beyond that the page gets slow to open
KEY_SHOWN = 512             # characters of a key name in the table (full name in the JSON)
CHART_MAX_BARS = 30         # model/group chart: the largest groups

# Heat-map cell states, worst first: a segment takes the first state that applies.
STATE_COLOURS = {
    "nonfinite": "#7b3294",
    "zero": "#d7191c",
    "partly_zero": "#fdae61",
    "ok": "#a6dba0",
    "padding": "#d9d9d9",
}
STATE_LABELS = {
    "nonfinite": "NaN or Inf in a state/KV region",
    "zero": "every state/KV region all zero",
    "partly_zero": "some state/KV regions all zero",
    "ok": "no region zero, all finite",
    "padding": "padding only (never judged)",
}
VERDICT_CLASS_COLOURS = {"finding": "#b2182b", "incomplete": "#e08214", "recorded": "#878787"}
COUNT_BAR_COLOUR = "#4575b4"
STATUS_WORDS = {0: "clean", 1: "findings", 3: "incomplete"}

CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,"DejaVu Sans",sans-serif;color:#1d1d1f;
margin:0 auto;padding:16px 24px 48px;max-width:1600px;background:#fff}
h1{font-size:20px;margin:0 0 4px}h2{font-size:16px;margin:28px 0 8px;border-bottom:1px solid #ddd;padding-bottom:4px}
h3{font-size:14px;margin:16px 0 6px}
.status{display:inline-block;padding:2px 10px;border-radius:4px;color:#fff;font-weight:600;margin-right:8px}
.status-clean{background:#1a7f37}.status-findings{background:#b2182b}.status-incomplete{background:#bf6a02}
.lead{margin:6px 0 12px;font-size:15px}
.headline{display:flex;flex-wrap:wrap;gap:8px;margin:0 0 12px}
.headline div{background:#f5f5f7;border-radius:6px;padding:6px 14px;min-width:120px;color:#555;font-size:12px}
.headline .figure{display:block;font-size:20px;font-weight:600;color:#1d1d1f}
.summary{display:grid;grid-template-columns:repeat(auto-fill,minmax(330px,1fr));gap:0 24px;margin:0}
.summary div{display:flex;gap:8px;border-bottom:1px dotted #e3e3e3;padding:2px 0}
.summary dt{color:#555;min-width:120px;flex:none}.summary dd{margin:0;overflow-wrap:anywhere}
.context{margin:3px 0;font-size:13px;overflow-wrap:anywhere}
figure{margin:0}
.mono,code,td.key{font-family:"DejaVu Sans Mono",Menlo,Consolas,monospace;font-size:12px}
.charts{display:flex;flex-wrap:wrap;gap:12px 40px;align-items:flex-start}
.legend{display:flex;flex-wrap:wrap;gap:4px 18px;margin:6px 0;font-size:13px}
.swatch{display:inline-block;width:14px;height:14px;vertical-align:-2px;margin-right:5px;border:1px solid #0003}
.note{color:#555;font-size:13px;margin:4px 0}
svg{max-width:100%;height:auto;display:block}
svg text{font-family:"DejaVu Sans Mono",Menlo,Consolas,monospace;font-size:11px;fill:#1d1d1f}
table{border-collapse:collapse;width:100%;font-size:13px}
th,td{border-bottom:1px solid #e6e6e6;padding:3px 8px;text-align:left;vertical-align:top}
th{background:#f5f5f7;position:sticky;top:0}td.num{text-align:right;white-space:nowrap}
td.key{word-break:break-all;width:36%}td.evidence{min-width:300px}
.verdict{display:inline-block;border-radius:3px;padding:0 5px;margin:1px 2px 1px 0;font-size:11px;color:#fff;
font-weight:600;white-space:nowrap}
"""


def inert_html(value: object, limit: int = 160) -> str:
    """Untrusted text for HTML content or an attribute: control characters shown as escapes
    (a newline in a key stays visible as \\n), markup and quotes escaped."""
    return html.escape(printable(str(value), limit), quote=True)


def _rate(bytes_per_s: int | None) -> str:
    """GB/s, the unit scans are sized in; MB/s for tiny test scans, where GB/s would read 0.000."""
    if not bytes_per_s:
        return "-"
    return f"{bytes_per_s / 1e9:.3f} GB/s" if bytes_per_s >= 1e7 else f"{bytes_per_s / 1e6:.3f} MB/s"


def _yes_no(flag: bool | None) -> str:
    return "unknown" if flag is None else "yes" if flag else "no"


def _verdict_class(verdict: str) -> str:
    if verdict in FINDINGS:
        return "finding"
    return "incomplete" if verdict in INCOMPLETE or verdict in UNJUDGED else "recorded"


def verdict_badges(verdicts: list[str]) -> str:
    if not verdicts:
        return "OK"
    return "".join(f'<span class="verdict" style="background:{VERDICT_CLASS_COLOURS[_verdict_class(v)]}">'
                   f"{inert_html(v)}</span>" for v in verdicts)


# --- summary ---------------------------------------------------------------------------------

def _status(summary: dict) -> tuple[str, str]:
    """The exit status in words, and the sentence an operator reads first."""
    word = STATUS_WORDS.get(summary.get("exit_code"), "unknown")
    if word == "findings":
        return word, f"{summary.get('findings', 0):,} key(s) flagged"
    coverage = summary.get("coverage")
    if word == "incomplete" and coverage is not None and not coverage["complete"]:
        missed = "some" if missed_keys(coverage) is None else f"{missed_keys(coverage):,}"
        return word, f"no findings, but {missed} key(s) the master holds were not audited"
    if word == "incomplete":
        return word, "no findings, but not every key could be read"
    if word == "clean":
        return word, "every key read, no findings"
    return word, f"exit code {inert_html(summary.get('exit_code'))}"


def _headline(summary: dict) -> list[tuple[str, str]]:
    """The numbers an operator checks first, shown large."""
    rate = summary.get("bytes_per_s")
    return [
        ("keys listed", f"{summary.get('keys_listed', 0):,}"),
        ("keys scanned", f"{summary.get('keys_scanned', 0):,}"),
        ("keys flagged", f"{summary.get('findings', 0):,}"),
        ("keys unread", f"{summary.get('keys_unread', 0):,}"),
        ("keys not fully judged", f"{summary.get('keys_not_fully_judged', 0):,}"),
        ("bytes scanned", human_bytes(summary.get("bytes_scanned"))),
        ("duration", f"{summary.get('duration_s', 0):.2f} s"),
        ("throughput", _rate(rate)),
    ]


def _details(summary: dict) -> list[tuple[str, str]]:
    """(label, already-escaped HTML) pairs: where, when and how the scan ran."""
    cluster = summary.get("cluster") or {}
    tool = summary.get("tool") or {}
    rows = [
        ("status", f"{_status(summary)[0]} (exit code {inert_html(summary.get('exit_code'))})"),
        ("cluster master", inert_html(cluster.get("master", "-"))),
        ("cluster admin", inert_html(cluster.get("admin", "-"))),
        ("started", inert_html(summary.get("started_at", "-"))),
        ("finished", inert_html(summary.get("finished_at", "-"))),
        ("keys selected", f"{summary.get('keys_selected', summary.get('keys_listed', 0)):,}"),
        ("keys not reached", f"{summary.get('keys_not_reached', 0):,}"),
        ("bytes scanned (exact)", f"{summary.get('bytes_scanned', 0):,}"),
        ("shared groups", f"{summary.get('shared_groups', 0):,}"),
        ("complete", _yes_no(summary.get("complete"))),
    ]
    chunks = summary.get("chunks")
    if chunks:
        rows.append(("chunks", f"{chunks.get('complete', 0):,} complete, {chunks.get('incomplete', 0):,} incomplete "
                               f"({chunks.get('members_missing', 0):,} members missing)"))
    if summary.get("interrupted"):
        rows.append(("interrupted", "yes: the report covers the keys read before the stop"))
    for name in ("read_mode", "device", "checker", "resumed_keys"):
        if name in summary:
            rows.append((name.replace("_", " "), inert_html(summary[name])))
    for name in ("filters", "sample"):
        if summary.get(name):
            rows.append((name, f'<span class="mono">{inert_html(json.dumps(summary[name]), 400)}</span>'))
    rows.append(("tool", f"{inert_html(tool.get('name', '-'))} {inert_html(tool.get('version', ''))}"))
    return rows


def _context_lines(summary: dict) -> list[str]:
    """Long lines (why a scan stopped, layouts, block tables): full width, below the grid."""
    lines = []
    if summary.get("aborted"):
        lines.append(f"<b>aborted:</b> {inert_html(summary['aborted'], 400)}")
    for layout in summary.get("layouts") or []:
        lines.append(f"<b>layout:</b> {inert_html(layout, 400)}")
    tables = summary.get("block_tables")
    if tables:
        lines.append(f"<b>block tables:</b> {len(tables.get('files') or [])} file(s), {tables.get('records', 0):,} "
                     f"records, {tables.get('keys', 0):,} keys, {tables.get('null_backed_keys', 0):,} null-backed, "
                     f"{inert_html(tables.get('keys_not_in_store'))} no longer in the store, "
                     f"{tables.get('skipped_lines', 0):,} lines skipped")
    return lines


def _summary_section(summary: dict) -> str:
    headline = "".join(f'<div><span class="figure">{value}</span>{label}</div>' for label, value in _headline(summary))
    details = "".join(f"<div><dt>{label}</dt><dd>{value}</dd></div>" for label, value in _details(summary))
    context = "".join(f'<p class="context">{line}</p>' for line in _context_lines(summary))
    return (f'<section id="summary"><h2>Summary</h2><div class="headline">{headline}</div>'
            f'<dl class="summary">{details}</dl>{context}</section>')


# --- heat map --------------------------------------------------------------------------------

def cell_state(regions: list[dict]) -> str:
    """The heat-map state of one segment from its regions: NaN/Inf anywhere but padding wins,
    then whether its state and KV regions are all, partly or not zero; padding is never judged
    (it is zero by design, or another group's leftovers in an `unused.<i>` segment)."""
    judged = [region for region in regions if region["kind"] != "padding"]
    if not judged:
        return "padding"
    if any(region["nan"] or region["inf"] for region in judged):
        return "nonfinite"
    zero = sum(1 for region in judged if region["zero"])
    if zero == len(judged):
        return "zero"
    return "partly_zero" if zero else "ok"


def _cell_title(segment: str, regions: list[dict]) -> str:
    parts = []
    for region in regions:
        detail = "zero" if region["zero"] else "non-zero"
        if region["nan"] or region["inf"]:
            detail += f", {region['nan']} NaN, {region['inf']} Inf"
        parts.append(f"{region['region']} {detail}")
    return f"{segment}: " + "; ".join(parts)


def _row_label(record: dict) -> str:
    """Short enough for the picture: vLLM keys by rank and chunk hash (their model and group are
    the map's), other keys by their start. The full name is the row's tooltip."""
    fields = record.get("fields") or {}
    if fields.get("scheme") == "vllm" and fields.get("chunk_hash"):
        return f"tp{fields.get('tp_rank', '?')} {str(fields['chunk_hash'])[:16]}"
    return printable(record["key"], 26)


def _heatmap_rows(records: list[dict]) -> list[dict]:
    """Rarest verdict combinations first, so the row cap never hides a kind of damage."""
    combination = Counter(tuple(record["verdicts"]) for record in records)
    return sorted(records, key=lambda r: (combination[tuple(r["verdicts"])], r["verdicts"], r["key"]))


def _columns(records: list[dict]) -> list[tuple[str, int]]:
    """(segment name, layer) of every segment the rows have, in byte order of the value."""
    first_offset: dict[str, int] = {}
    layer_of: dict[str, int] = {}
    for record in records:
        for region in record["regions"]:
            name = region["segment"]
            first_offset[name] = min(first_offset.get(name, region["offset"]), region["offset"])
            layer_of[name] = region["layer"]
    return [(name, layer_of[name]) for name in sorted(first_offset, key=first_offset.get)]


def _heatmap_svg(layout: str, records: list[dict], state_counts: Counter) -> str:
    columns = _columns(records)
    cell_w = max(8, min(28, 760 // max(len(columns), 1)))
    cell_h, label_w, header_h, verdict_w = 16, 190, 30, 260
    tick_every = -(-20 // cell_w)  # a layer number every n columns, so the numbers never overlap
    cells_end = label_w + cell_w * len(columns)
    width, height = cells_end + 10 + verdict_w, header_h + cell_h * len(records) + 4
    parts = [f'<svg class="heatmap" data-layout="{inert_html(layout, 400)}" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" role="img" aria-label="zero and non-finite regions per key and layer">',
             f'<text x="{label_w - 6}" y="{header_h - 8}" text-anchor="end">layer</text>']
    for index, (segment, layer) in enumerate(columns):
        hidden = "" if index % tick_every == 0 else ' visibility="hidden"'
        x = label_w + index * cell_w + cell_w / 2
        parts.append(f'<text class="column" data-segment="{inert_html(segment)}" x="{x}" y="{header_h - 8}" '
                     f'text-anchor="middle"{hidden}><title>{inert_html(segment)}</title>'
                     f'{inert_html(layer if layer >= 0 else "-")}</text>')
    for row, record in enumerate(records):
        y = header_h + row * cell_h
        key = inert_html(record["key"], 1024)
        by_segment: dict[str, list[dict]] = {}
        for region in record["regions"]:
            by_segment.setdefault(region["segment"], []).append(region)
        parts.append(f'<g class="row" data-key="{key}"><title>{key}</title><text x="{label_w - 6}" '
                     f'y="{y + cell_h - 4}" text-anchor="end">{inert_html(_row_label(record))}</text>')
        for index, (segment, _) in enumerate(columns):
            if segment not in by_segment:
                continue
            state = cell_state(by_segment[segment])
            state_counts[state] += 1
            parts.append(f'<rect class="cell" data-segment="{inert_html(segment)}" data-state="{state}" '
                         f'x="{label_w + index * cell_w}" y="{y}" width="{cell_w - 1}" height="{cell_h - 1}" '
                         f'fill="{STATE_COLOURS[state]}"><title>'
                         f"{inert_html(_cell_title(segment, by_segment[segment]), 400)}</title></rect>")
        parts.append(f'<text x="{cells_end + 10}" y="{y + cell_h - 4}">{inert_html(" ".join(record["verdicts"]), 60)}'
                     f"</text></g>")
    parts.append("</svg>")
    return "".join(parts)


def _heatmap_section(findings: list[dict]) -> str:
    with_regions = [record for record in findings if record.get("regions")]
    by_layout: dict[str, list[dict]] = {}
    for record in with_regions:
        by_layout.setdefault(record.get("layout") or "(layout not named)", []).append(record)
    body = []
    state_counts: Counter = Counter()
    for layout in sorted(by_layout):
        records = _heatmap_rows(by_layout[layout])
        shown = records[:HEATMAP_MAX_ROWS]
        body.append(f'<h3>layout <span class="mono">{inert_html(layout, 400)}</span>: {len(records):,} flagged key(s)</h3>')
        if len(records) > len(shown):
            body.append(f'<p class="note">Showing {len(shown):,} of {len(records):,} flagged keys with this layout '
                        f"(rarest verdict combinations first); the JSON report and the table below list them all.</p>")
        body.append(_heatmap_svg(layout, shown, state_counts))
    without = len(findings) - len(with_regions)
    if without:
        body.append(f'<p class="note">{without:,} flagged key(s) have no per-region results (no layout applied, or '
                    f"the size did not match the layout) and are not in the picture; see the table.</p>")
    if not with_regions:
        body.insert(0, '<p class="note">No flagged key has per-region results: nothing to draw.</p>')
    legend = "".join(f'<span><span class="swatch" style="background:{colour}"></span>{STATE_LABELS[state]}'
                     f" ({state_counts[state]:,} cells)</span>" for state, colour in STATE_COLOURS.items())
    return (f'<section id="heatmap"><h2>Zero and non-finite regions: flagged keys x layers</h2>'
            f'<p class="note">One row per flagged key, one column per segment of the value (its layer number '
            f"above; <code>-</code>: a segment no layer of this group owns). Hover a row for the full key, a cell "
            f'for its regions.</p><div class="legend">{legend}</div>{"".join(body)}</section>')


# --- bar charts ------------------------------------------------------------------------------

def _bar_chart(title: str, bars: list[tuple[str, int, str]], css_class: str) -> str:
    """Horizontal bars: (label, count, colour) each; labels are untrusted."""
    row_h, label_w, bar_w, top = 20, 200, 260, 6
    most = max((count for _, count, _ in bars), default=0) or 1
    height = top + row_h * len(bars) + 4
    width = label_w + bar_w + 70
    parts = [f'<figure><h3>{html.escape(title)}</h3><svg class="{css_class}" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" role="img" aria-label="{html.escape(title, quote=True)}">']
    for row, (label, count, colour) in enumerate(bars):
        y = top + row * row_h
        length = max(1, round(bar_w * count / most))
        parts.append(f'<g class="bar" data-label="{inert_html(label)}" data-count="{count}">'
                     f'<text x="{label_w - 6}" y="{y + 13}" text-anchor="end">{inert_html(label, 30)}</text>'
                     f'<rect x="{label_w}" y="{y + 2}" width="{length}" height="{row_h - 6}" fill="{colour}"/>'
                     f'<text x="{label_w + length + 6}" y="{y + 13}">{count:,}</text></g>')
    parts.append("</svg></figure>")
    return "".join(parts)


def _scope_counts(findings: list[dict]) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """Flagged keys per TP rank (in rank order) and per model/group (largest first); keys of
    other schemes carry no vLLM rank or group and are counted apart, by scheme."""
    ranks: Counter = Counter()
    groups: Counter = Counter()
    for record in findings:
        fields = record.get("fields") or {}
        if fields.get("scheme") != "vllm":
            other = f"not vLLM ({fields.get('scheme', '?')})"
            ranks[(1, other)] += 1
            groups[other] += 1
            continue
        rank = fields.get("tp_rank", "?")
        ranks[(0, str(rank).zfill(6), f"tp_rank {rank}")] += 1  # zfill: tp_rank 10 after tp_rank 9
        group = fields.get("group")
        groups[f"{fields.get('model', '?')} / group {'-' if group is None else group}"] += 1
    return [(order[-1], n) for order, n in sorted(ranks.items())], groups.most_common()


def _boundary_counts(findings: list[dict]) -> list[tuple[str, int]]:
    """Flagged keys per token boundary, where per-request block tables gave one (never guessed)."""
    counts = Counter(((r.get("evidence") or {}).get("block_table") or {}).get("boundary_tokens") for r in findings)
    counts.pop(None, None)
    return [(f"{boundary:,} tokens", n) for boundary, n in sorted(counts.items())]


def _boundary_note(summary: dict, known: int, flagged: int) -> str:
    """Why some or all findings have no boundary: keys name a chunk hash, not a token count; only
    per-request block tables (with block_size) give positions. Nothing is guessed."""
    if known:
        rest = flagged - known
        return ("Findings by boundary (token count) from per-request block tables"
                + (f"; flagged keys with no known boundary: {rest:,}." if rest else "."))
    if not summary.get("block_tables"):
        return ("Findings by boundary (token count): boundary unknown without block tables. A key names a chunk "
                "hash, not a token position.")
    return ("Findings by boundary (token count): boundary unknown. A key names a chunk hash, not a token position, "
            "and the block-table evidence in this report names requests and source lines, not positions.")


def _charts_section(summary: dict, findings: list[dict]) -> str:
    verdicts = sorted((summary.get("verdicts") or {}).items(), key=lambda item: (-item[1], item[0]))
    charts = []
    if verdicts:
        charts.append(_bar_chart("Verdicts (keys per verdict)",
                                 [(v, n, VERDICT_CLASS_COLOURS[_verdict_class(v)]) for v, n in verdicts],
                                 "verdict-chart"))
    ranks, groups = _scope_counts(findings)
    if findings:
        charts.append(_bar_chart("Flagged keys by TP rank",
                                 [(label, n, COUNT_BAR_COLOUR) for label, n in ranks], "rank-chart"))
        charts.append(_bar_chart("Flagged keys by model / group",
                                 [(label, n, COUNT_BAR_COLOUR) for label, n in groups[:CHART_MAX_BARS]],
                                 "group-chart"))
    boundaries = _boundary_counts(findings)
    if boundaries:
        charts.append(_bar_chart("Flagged keys by boundary",
                                 [(label, n, COUNT_BAR_COLOUR) for label, n in boundaries[:CHART_MAX_BARS]],
                                 "boundary-chart"))
    known = sum(n for _, n in boundaries)
    notes = [f'<p class="note">{_boundary_note(summary, known, len(findings))}</p>']
    if len(groups) > CHART_MAX_BARS:
        notes.append(f'<p class="note">Model/group chart: the {CHART_MAX_BARS} largest of {len(groups):,} '
                     f"groups.</p>")
    if not verdicts:
        notes.append('<p class="note">No key got a verdict.</p>')
    legend = "".join(f'<span><span class="swatch" style="background:{colour}"></span>{name}</span>'
                     for name, colour in VERDICT_CLASS_COLOURS.items())
    return (f'<section id="charts"><h2>Counts</h2><div class="legend">verdict class: {legend}</div>'
            f'<div class="charts">{"".join(charts)}</div>{"".join(notes)}</section>')


# --- tables ----------------------------------------------------------------------------------

def _evidence_summary(record: dict) -> str:
    """One line per kind of evidence, in words; evidence this renderer does not know is shown
    as compact JSON rather than dropped."""
    lines = []
    for name, evidence in (record.get("evidence") or {}).items():
        if name == "zero_state":
            line = f"all {evidence.get('state_regions')} state regions in {evidence.get('layers')} layers zero"
            if evidence.get("value_all_zero"):
                line += "; whole value zero"
        elif name == "partial_zero":
            layers = ", ".join(str(layer) for layer in evidence.get("zero_layers") or [])
            line = f"layers {layers} of {evidence.get('layers')} all zero"
        elif name == "nonfinite":
            where = [f"{r.get('segment')}/{r.get('region')}" for r in evidence.get("regions") or []]
            more = f" (+{len(where) - 3} more)" if len(where) > 3 else ""
            line = f"{evidence.get('nan')} NaN, {evidence.get('inf')} Inf in {', '.join(where[:3])}{more}"
        elif name == "size_mismatch":
            line = f"{evidence.get('actual')} bytes, the layout says {evidence.get('expected')}"
        elif name == "zero":
            line = "every byte zero"
        elif name == "shared_content":
            line = (f"same bytes as {(evidence.get('keys_in_group') or 1) - 1} other key(s) "
                    f"(shared group {evidence.get('group')})")
        elif name == "null_backed":
            line = (f"block table maps it to NULL block {evidence.get('null_block_id')}; bytes zero: "
                    f"{_yes_no(evidence.get('bytes_zero'))}, state zero: {_yes_no(evidence.get('state_zero'))}")
        elif name == "block_table":
            ids = evidence.get("block_ids") or []
            requests = ", ".join(str(r) for r in evidence.get("req_ids") or [])
            line = f"block table: blocks {ids[:8]}" + (f", request {requests}" if requests else "")
        elif name == "weights_mismatch":
            rows = evidence.get("rows") or []
            far = max((row.get("distance") or 0.0 for row in rows), default=0.0)
            line = (f"layer-{evidence.get('layer')} {evidence.get('region')} rows are no token's image under these "
                    f"weights: {len(rows)} rows, farthest {far:g} from its nearest image "
                    f"(tolerance {evidence.get('row_tolerance')})")
        elif name == "key_positions":
            line = (f"layer-0 K rows are not their tokens' keys at a block's positions: first row at position "
                    f"{evidence.get('decoded_start')} (block of {evidence.get('block_tokens')}), "
                    f"{evidence.get('rows_beyond_tolerance')} of {evidence.get('rows')} rows beyond tolerance, "
                    f"farthest {evidence.get('worst_distance')}")
        elif name == "prefix_mismatch":
            line = (f"layer-0 {evidence.get('region')} rows are tokens other than those chunk hash "
                    f"{str(evidence.get('chunk_hash'))[:16]} was recorded with: {evidence.get('window')} tokens, "
                    f"digest {evidence.get('decoded_digest')} against {evidence.get('recorded_digest')} recorded")
        else:
            line = f"{name}: {json.dumps(evidence)}"
        lines.append(inert_html(line, 300))
    error = record.get("error")
    if error:
        lines.append(inert_html(f"{error.get('name')} ({error.get('code')}): {error.get('message', '')}", 300))
    return "<br>".join(lines)


def _findings_section(findings: list[dict]) -> str:
    if not findings:
        return '<section id="findings"><h2>Findings</h2><p>No key was flagged.</p></section>'
    rows = sorted(findings, key=lambda r: r["key"])
    shown = rows[:TABLE_MAX_ROWS]
    body = []
    for record in shown:
        fields = record.get("fields") or {}
        size = record.get("size")
        body.append(
            f'<tr><td class="key">{inert_html(record["key"], KEY_SHOWN)}</td><td>{verdict_badges(record["verdicts"])}</td>'
            f'<td class="num">{"-" if size is None else f"{size:,}"}</td>'
            f'<td class="mono">{inert_html(record.get("xxh3") or "-")}</td><td>{inert_html(fields.get("model", "-"), 80)}</td>'
            f'<td class="num">{inert_html(fields.get("tp_rank", "-"))}</td>'
            f'<td class="evidence">{_evidence_summary(record)}</td></tr>')
    note = (f'<p class="note">Showing the first {len(shown):,} of {len(rows):,} flagged keys (by name); the JSON '
            f"report lists them all.</p>" if len(rows) > len(shown) else "")
    return (f'<section id="findings"><h2>Findings ({len(rows):,} keys)</h2>{note}<table class="findings"><thead><tr>'
            f"<th>key</th><th>verdicts</th><th>size (bytes)</th><th>xxh3</th><th>model</th><th>tp_rank</th>"
            f'<th>evidence</th></tr></thead><tbody>{"".join(body)}</tbody></table></section>')


def _shared_section(groups: list[dict]) -> str:
    if not groups:
        return ""
    body = "".join(
        f'<tr><td class="num">{inert_html(group["group"])}</td><td class="num">{group["size"]:,}</td>'
        f'<td class="mono">{inert_html(group["xxh3"])}</td><td class="num">{len(group["keys"]):,}</td>'
        f'<td class="key">{"<br>".join(inert_html(key, 200) for key in group["keys"][:5])}'
        f'{"<br>…" if len(group["keys"]) > 5 else ""}</td></tr>'
        for group in groups[:TABLE_MAX_ROWS])
    return (f'<section id="shared"><h2>Shared content ({len(groups):,} groups)</h2><p class="note">Distinct keys '
            f"holding identical non-zero bytes (same size and XXH3-64).</p><table><thead><tr><th>group</th>"
            f"<th>size (bytes)</th><th>xxh3</th><th>keys</th><th>first keys</th></tr></thead><tbody>{body}"
            f"</tbody></table></section>")


def _coverage_section(summary: dict) -> str:
    """What the master holds against what was audited, each gap with how to cover it (docs/coverage.md)."""
    coverage = summary.get("coverage")
    if coverage is None:
        return ""
    lines = gap_lines(coverage)
    gaps = "".join(f"<li>{inert_html(what, 400)}<br>{inert_html(how.strip(), 400)}</li>" for what, how in zip(lines[::2], lines[1::2]))
    rows = "".join(f"<tr><td>{inert_html(t['name'])}</td><td>{t['charged_bytes']:,}</td><td>{_yes_no(t['audited'])}</td>"
                   f"<td>{inert_html(t['keys_named'] if t['keys_named'] is not None else 'listed')}</td>"
                   f"<td>{t['keys_read']:,}</td></tr>" for t in coverage["tenants"] or [])
    tenants = (f"<h3>Tenants</h3><table><thead><tr><th>tenant</th><th>bytes charged</th><th>audited</th>"
               f"<th>keys named</th><th>keys read</th></tr></thead><tbody>{rows}</tbody></table>" if rows else "")
    return (f'<section id="coverage"><h2>Coverage</h2><p>{inert_html(coverage_headline(coverage), 400)}</p>'
            f"{f'<ul>{gaps}</ul>' if gaps else ''}{tenants}</section>")


OFFLOAD_NAMED = 20  # values named one by one in the SSD tier section (the JSON names up to 100)


def _offload_section(summary: dict) -> str:
    """The SSD tier read from the holders' offload directories (`--offload-dir`): disk copies
    compared with memory, values no master lists, and the copies no master lists of keys put again
    (docs/read-modes.md)."""
    offload = summary.get("offload")
    if offload is None:
        return ""
    parts = [f"<p>{offload['disk_copies_compared']:,} disk copies compared with memory, "
             f"{offload['disk_copies_divergent']:,} divergent"
             + (f", {offload['disk_copies_elsewhere']:,} on other hosts' disks, not compared"
                if offload["disk_copies_elsewhere"] else "") + "</p>"]
    unlisted = offload.get("unlisted")
    if unlisted and unlisted["values"]:
        rows = "".join(f'<tr><td class="key">{inert_html(value["key"], KEY_SHOWN)}</td><td>{inert_html(value.get("tenant") or "")}'
                       f'</td><td>{inert_html(value["file"], 200)}</td><td>{value["offset"]:,}</td><td>{value["size"]:,}</td></tr>'
                       for value in unlisted["named"][:OFFLOAD_NAMED])
        parts.append(f"<h3>On disk, listed by no master ({unlisted['values']:,})</h3><p>Removed keys whose SSD copy "
                     f"stays: a restart of the holder registers them again.</p><table><thead><tr><th>key</th>"
                     f"<th>tenant</th><th>file</th><th>offset</th><th>size</th></tr></thead><tbody>{rows}</tbody></table>")
    latent = offload.get("latent")
    if latent and latent["copies"]:
        rows = "".join(f'<tr><td class="key">{inert_html(row["key"], KEY_SHOWN)}'
                       f'{" (tenant " + inert_html(row["tenant"]) + ")" if row.get("tenant") else ""}'
                       f'</td><td>{inert_html(row["file"], 200)}'
                       f"</td><td>{row['offset']:,}</td><td>{inert_html(current_copy_place(row['current_copy']), 200) if 'current_copy' in row else ''}"
                       f"</td><td>{_yes_no(row['xxh3'] != row['memory_xxh3'])}</td>"
                       f'<td class="mono">{inert_html(row["xxh3"])}</td><td class="mono">{inert_html(row["memory_xxh3"])}</td></tr>'
                       for row in latent["named"][:OFFLOAD_NAMED])
        parts.append(f"<h3>On disk, not listed for their key ({latent['copies']:,}, "
                     f"{latent['unlike_memory']:,} unlike memory)</h3><p>Keys put again keep their first value's "
                     f"copy (Mooncake's bucket offload writes a key once), which a restart of the holder serves in "
                     f"place of the bytes in memory; put again on another holder, a key leaves its first copy beside "
                     f"its current one. Not findings.</p><table><thead><tr><th>key</th><th>file</th>"
                     f"<th>offset</th><th>key's current copy</th><th>unlike memory</th><th>disk xxh3</th><th>memory xxh3</th></tr></thead>"
                     f"<tbody>{rows}</tbody></table>")
    return f'<section id="offload"><h2>SSD tier</h2>{"".join(parts)}</section>'


def _unread_section(document: dict) -> str:
    """Why a scan is incomplete: the unread keys when the report lists every key (`--all`)."""
    unread_count = document["summary"].get("keys_unread", 0)
    if not unread_count:
        return ""
    if "keys" not in document:
        return (f'<section id="unread"><h2>Unread keys</h2><p>{unread_count:,} key(s) could not be read. Scan with '
                f"<code>--all</code> to list them in the report.</p></section>")
    unread = [record for record in document["keys"] if any(v in INCOMPLETE for v in record["verdicts"])]
    body = "".join(f'<tr><td class="key">{inert_html(record["key"], KEY_SHOWN)}</td>'
                   f'<td>{verdict_badges(record["verdicts"])}</td><td>{_evidence_summary(record)}</td></tr>'
                   for record in sorted(unread, key=lambda r: r["key"])[:TABLE_MAX_ROWS])
    return (f'<section id="unread"><h2>Unread keys ({len(unread):,})</h2><table><thead><tr><th>key</th>'
            f"<th>verdicts</th><th>error</th></tr></thead><tbody>{body}</tbody></table></section>")


# --- page ------------------------------------------------------------------------------------

def page(title: str, body: str) -> str:
    """A whole self-contained page: `title` (already escaped) and `body` (escaped HTML) with the
    inline style and a Content-Security-Policy that allows no script and no network load."""
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; style-src 'unsafe-inline'\">"
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{title}</title><style>{CSS}</style></head><body>{body}</body></html>\n")


def render_html(document: dict) -> str:
    """The page for one `--format json` report document (docs/html-report.md)."""
    summary = document["summary"]
    findings = document["findings"]
    word, sentence = _status(summary)
    master = (summary.get("cluster") or {}).get("master", "")
    return page(
        f"mooncake-audit: {word} - {inert_html(master, 80)}",
        f'<h1>mooncake-audit report <span class="mono">{inert_html(master, 80)}</span></h1>'
        f'<p class="lead"><span class="status status-{word}">{word.upper()}</span>{sentence}</p>'
        f"{_summary_section(summary)}{_coverage_section(summary)}{_offload_section(summary)}{_heatmap_section(findings)}"
        f"{_charts_section(summary, findings)}"
        f"{_findings_section(findings)}{_shared_section(document.get('shared_groups') or [])}"
        f"{_unread_section(document)}")


def _read_report(path: Path) -> dict:
    shown = printable(str(path), 200)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as error:
        raise AuditError(f"cannot read report {shown}: {error.strerror}") from None
    except UnicodeDecodeError:
        raise AuditError(f"cannot read report {shown}: not UTF-8 text") from None
    try:
        document = json.loads(text)
    except json.JSONDecodeError as error:
        if text.lstrip().startswith('{"type": "header"'):
            raise AuditError(f"report {shown} is JSON Lines (--format jsonl); render a --format json report") from None
        raise AuditError(f"report {shown} is not JSON: {error.msg} at line {error.lineno}") from None
    if not isinstance(document, dict) or document.get("schema") != REPORT_SCHEMA:
        raise AuditError(f"{shown} is not a mooncake-audit report (no \"schema\": \"{REPORT_SCHEMA}\")")
    if document.get("version") != 1:
        raise AuditError(f"report {shown} has version {printable(str(document.get('version')), 20)}; "
                         f"this tool reads version 1")
    if not isinstance(document.get("summary"), dict) or not isinstance(document.get("findings"), list):
        raise AuditError(f"report {shown} is malformed: it needs a summary object and a findings list")
    return document


def write_html(report_path: Path, out_path: Path) -> None:
    """Render the report at `report_path` into `out_path`, replaced atomically (a reader never
    sees half a page). AuditError, one line, for a report that cannot be read or is malformed."""
    document = _read_report(report_path)
    try:
        rendered = render_html(document)
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise AuditError(f"report {printable(str(report_path), 200)} is malformed: "
                         f"{type(error).__name__} {printable(str(error), 120)}") from None
    out = ReportOutput(out_path)
    out.write(rendered)
    out.close()
