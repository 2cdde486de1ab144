"""`impact`'s result (audit.forensics.impact) in each format: `human` (a summary line, one flagged
key per line, requests by host and hour), `json` (the versioned document, docs/report-schema.md)
and `html` (one self-contained page: a timeline of the flagged keys' loads and the tables).

Renderers take the JSON document (and, for the page, each key's load times): keys, hosts and
request ids are the consumers' and the producers' strings, untrusted; in a terminal they go
through `printable`, in the page through `inert_html`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path

from audit.report.html import VERDICT_CLASS_COLOURS, inert_html, page, verdict_badges
from audit.report.inert import inert, inert_key, printable, short_key
from audit.report.output import ReportOutput, check_writable

IMPACT_FORMATS = ("human", "json", "html")
HUMAN_MAX_REQUESTS = 50     # request ids listed in the terminal; the JSON lists them all
HUMAN_MAX_GONE = 20
TIMELINE_MAX_ROWS = 200     # keys drawn, earliest first; the tables list them all
TABLE_MAX_ROWS = 5000
LABEL_CHARS, CHAR_W = 80, 6.7  # a timeline row's label, and the width of a character of its 11 px mono font
SERVED_COLOUR, REFUSED_COLOUR = VERDICT_CLASS_COLOURS["finding"], VERDICT_CLASS_COLOURS["recorded"]

Timeline = Mapping[str, Sequence[tuple[float, bool]]]  # key -> (unix time, served) of its loads


def status(summary: dict) -> tuple[str, str]:
    """AFFECTED or NOT AFFECTED, in step with the exit code, and the sentence that says how much."""
    loaded = (f"{summary['flagged_keys_loaded']:,} of {summary['flagged_keys']:,} flagged key(s) loaded, "
              f"{summary['served_loads_of_flagged']:,} load(s) served, "
              f"{summary['refused_loads_of_flagged']:,} refused by the guard")
    if summary["exit_code"] == 1:
        unnamed = summary.get("served_without_request_id") or 0
        return "AFFECTED", (f"{summary['requests_affected']:,} request(s) served a flagged key ({loaded}"
                            + (f"; {unnamed:,} served load(s) name no request" if unnamed else "") + ")")
    return "NOT AFFECTED", f"no request was served a flagged key ({loaded})"


def _short_time(iso: str | None) -> str:
    """2026-05-01T12:34:56.789+00:00 -> 2026-05-01 12:34:56Z."""
    return "-" if not iso else f"{iso[:10]} {iso[11:19]}Z"


def _table_time(iso: str | None) -> str:
    """2026-05-01T12:34:56.789+00:00 -> 05-01 12:34:56 (UTC; the year is in the lines above)."""
    return "-" if not iso else f"{iso[5:10]} {iso[11:19]}"


def _context_lines(summary: dict) -> list[str]:
    report = summary.get("report") or {}
    files = summary.get("files") or []
    lines = [f"load records: {summary['load_records']:,} in {len(files):,} file(s), {summary['keys_loaded']:,} "
             f"key(s), {summary['skipped_lines']:,} line(s) skipped, {summary['refused_loads']:,} refused and "
             f"{summary['failed_loads']:,} failed load(s); from {_short_time(summary['first_load'])} "
             f"to {_short_time(summary['last_load'])}; times in UTC"]
    if report:
        lines.append(printable(f"report: {report.get('path')}, {report.get('keys', 0):,} key record(s), "
                               f"finished {report.get('finished_at') or '-'}; "
                               + ("it lists every key" if summary["report_complete"] else
                                  "findings only (scan with --all, or JSONL, to see loaded keys the store "
                                  "no longer held)"), 400))
    if summary.get("null_backed_from_block_tables"):
        lines.append(f"NULL_BACKED from the put records: {summary['null_backed_from_block_tables']:,} key(s)")
    return lines


def _counts(label: str, counts: dict[str, int]) -> str:
    return f"{label}: " + (", ".join(f"{printable(name, 80)} {n:,}" for name, n in counts.items()) or "none")


def print_human(document: dict, stream) -> None:
    from rich import box  # imported here: every command imports this module (`impact`'s options), few print it
    from rich.console import Console
    from rich.table import Table

    console = Console(file=stream, highlight=False, soft_wrap=False, width=180, force_terminal=False)
    summary = document["summary"]
    console.print(": ".join(status(summary)), markup=False)
    for line in _context_lines(summary):
        console.print(line, markup=False)
    if document["affected"]:
        table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, collapse_padding=True)
        table.add_column("key", no_wrap=True)
        table.add_column("verdicts", no_wrap=True, overflow="ellipsis", min_width=11)
        for column in ("served", "refused", "requests"):
            table.add_column(column, no_wrap=True, justify="right")
        table.add_column("hosts", no_wrap=True, overflow="ellipsis", min_width=8)
        for column in ("first load", "last load"):
            table.add_column(column, no_wrap=True)
        for row in document["affected"]:
            hosts = row["hosts"]
            table.add_row(inert_key(row["key"]), inert(",".join(row["verdicts"])), f"{row['loads']:,}",
                          f"{row['refused']:,}", f"{row['requests']:,}",
                          inert(hosts[0] + (f" +{len(hosts) - 1}" if len(hosts) > 1 else ""), 40),
                          _table_time(row["first_load"]), _table_time(row["last_load"]))
        console.print(table)
    console.print(_counts("requests by host", document["by_host"]), markup=False)
    console.print(_counts("requests by hour (UTC)", document["by_hour"]), markup=False)
    requests = document.get("requests") or []
    if requests:
        names = ", ".join(printable(row["request"], 80) for row in requests[:HUMAN_MAX_REQUESTS])
        more = len(requests) - HUMAN_MAX_REQUESTS
        console.print(f"requests affected: {names}" + (f" (+{more:,} more: --format json lists them all)"
                                                        if more > 0 else ""), markup=False, soft_wrap=True)
    gone = document.get("loaded_gone") or []
    if gone:
        console.print(f"loaded, not in the report (gone before the scan, or published after it): {len(gone):,} key(s)",
                      markup=False)
        table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, collapse_padding=True)
        table.add_column("key", no_wrap=True)
        for column in ("loads", "served", "flagged", "last load"):
            table.add_column(column, no_wrap=True, justify="right" if column in ("loads", "served") else "left")
        for row in gone[:HUMAN_MAX_GONE]:
            table.add_row(inert_key(row["key"]), f"{row['loads']:,}", f"{row['served']:,}",
                          "yes" if row["flagged"] else "no", _table_time(row["last_load"]))
        console.print(table)
        if len(gone) > HUMAN_MAX_GONE:
            console.print(f"(+{len(gone) - HUMAN_MAX_GONE:,} more: --format json lists them all)", markup=False)


# --- the page --------------------------------------------------------------------------------

def _tick_label(unix: float, span: float) -> str:
    when = datetime.fromtimestamp(unix, timezone.utc)
    return when.strftime("%H:%M:%S" if span < 86400 else "%m-%d %H:%M")


def _row_label(key: str) -> str:
    """A key as `short_key` shows it; a long one keeps its end (what tells a model's keys apart)."""
    label = short_key(key, 10 * LABEL_CHARS)
    return label if len(label) <= LABEL_CHARS else "…" + label[-(LABEL_CHARS - 1):]


def timeline_svg(affected: list[dict], timeline: Timeline) -> str:
    """One row per flagged key (earliest first load on top), one tick per load at its time: served
    loads in the finding colour, refused ones grey. Ticks a pixel apart are drawn once (a key
    loaded a million times is still a row of at most the picture's width)."""
    rows = [row for row in affected if timeline.get(row["key"])][:TIMELINE_MAX_ROWS]
    if not rows:
        return '<p class="note">No flagged key was loaded: nothing to draw.</p>'
    times = [when for row in rows for when, _ in timeline[row["key"]]]
    start, end = min(times), max(times)
    span = max(end - start, 1.0)
    labels = [_row_label(row["key"]) for row in rows]
    row_h, plot_w, top, axis_h = 16, 760, 6, 34
    label_w = round(max(len(label) for label in labels) * CHAR_W) + 12
    width, height = label_w + plot_w + 20, top + row_h * len(rows) + axis_h
    parts = [f'<svg class="timeline" width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img" '
             f'aria-label="loads of flagged keys over time">']
    for row_index, row in enumerate(rows):
        y = top + row_index * row_h
        key = inert_html(row["key"], 1024)
        parts.append(f'<g class="row" data-key="{key}" data-loads="{row["loads"]}" data-refused="{row["refused"]}">'
                     f'<title>{key}</title><text x="{label_w - 6}" y="{y + row_h - 4}" text-anchor="end">'
                     f"{inert_html(labels[row_index], LABEL_CHARS + 1)}</text>"
                     f'<line x1="{label_w}" x2="{label_w + plot_w}" y1="{y + row_h / 2}" y2="{y + row_h / 2}" '
                     f'stroke="#e6e6e6"/>')
        drawn: set[tuple[int, bool]] = set()
        for when, served in timeline[row["key"]]:
            x = label_w + round((when - start) / span * plot_w)
            if (x, served) in drawn:
                continue
            drawn.add((x, served))
            parts.append(f'<rect class="{"served" if served else "refused"}" x="{x - 1}" y="{y + 2}" width="2" '
                         f'height="{row_h - 4}" fill="{SERVED_COLOUR if served else REFUSED_COLOUR}"/>')
        parts.append("</g>")
    axis_y = top + row_h * len(rows) + 4
    parts.append(f'<line x1="{label_w}" x2="{label_w + plot_w}" y1="{axis_y}" y2="{axis_y}" stroke="#888"/>')
    for tick in range(5):
        when = start + span * tick / 4
        x = label_w + plot_w * tick / 4
        anchor = "start" if tick == 0 else "end" if tick == 4 else "middle"
        parts.append(f'<text x="{x}" y="{axis_y + 16}" text-anchor="{anchor}">{_tick_label(when, span)}</text>')
    parts.append(f'<text x="{label_w - 6}" y="{axis_y + 16}" text-anchor="end">UTC</text></svg>')
    note = (f'<p class="note">The first {len(rows):,} of {len(affected):,} loaded flagged keys; the table lists '
            f"them all.</p>" if len(affected) > len(rows) else "")
    return note + "".join(parts)


def _table(css_class: str, headers: Sequence[str], rows: list[str], total: int) -> str:
    note = (f'<p class="note">The first {len(rows):,} of {total:,}; the JSON lists them all.</p>'
            if total > len(rows) else "")
    head = "".join(f"<th>{header}</th>" for header in headers)
    return f'{note}<table class="{css_class}"><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table>'


def _ids(values: Sequence[str], shown: int = 5) -> str:
    text = "<br>".join(inert_html(value, 200) for value in values[:shown])
    return text + (f"<br>+{len(values) - shown:,} more" if len(values) > shown else "")


def render_impact_html(document: dict, timeline: Timeline) -> str:
    summary = document["summary"]
    affected = document["affected"]
    word, sentence = status(summary)
    css = "findings" if summary["exit_code"] == 1 else "clean"
    figures = [("requests affected", summary["requests_affected"]),
               ("flagged keys served", summary["flagged_keys_served"]),
               ("flagged keys loaded", summary["flagged_keys_loaded"]),
               ("flagged keys", summary["flagged_keys"]),
               ("served loads of flagged keys", summary["served_loads_of_flagged"]),
               ("refused loads of flagged keys", summary["refused_loads_of_flagged"]),
               ("load records", summary["load_records"])]
    figures_html = "".join(f'<div><span class="figure">{value:,}</span>{label}</div>' for label, value in figures)
    context = "".join(f'<p class="context">{inert_html(line, 600)}</p>' for line in _context_lines(summary))
    legend = (f'<div class="legend"><span><span class="swatch" style="background:{SERVED_COLOUR}"></span>served '
              f'(the request used the bytes)</span><span><span class="swatch" style="background:{REFUSED_COLOUR}">'
              f"</span>refused by the load guard</span></div>")
    affected_rows = [
        f'<tr><td class="key">{inert_html(row["key"], 1024)}</td><td>{verdict_badges(row["verdicts"])}</td>'
        f'<td class="num">{row["loads"]:,}</td><td class="num">{row["refused"]:,}</td>'
        f'<td class="num">{row["requests"]:,}</td><td class="mono">{_ids(row["request_ids"] or row["vllm_request_ids"])}'
        f'</td><td>{_ids(row["hosts"])}</td><td class="mono">{inert_html(_short_time(row["first_load"]))}</td>'
        f'<td class="mono">{inert_html(_short_time(row["last_load"]))}</td></tr>' for row in affected[:TABLE_MAX_ROWS]]
    requests = document.get("requests") or []
    request_rows = [
        f'<tr><td class="mono">{inert_html(row["request"], 200)}</td><td class="mono">{_ids(row["vllm_request_ids"])}'
        f'</td><td>{_ids(row["hosts"])}</td><td class="num">{row["keys"]:,}</td>'
        f'<td class="mono">{inert_html(_short_time(row["first_load"]))}</td>'
        f'<td class="mono">{inert_html(_short_time(row["last_load"]))}</td></tr>' for row in requests[:TABLE_MAX_ROWS]]
    counts = "".join(
        f"<figure><h3>{title}</h3>" + _table(f"{name}-counts", (column, "requests affected"),
                                              [f'<tr><td class="mono">{inert_html(label, 200)}</td>'
                                               f'<td class="num">{n:,}</td></tr>' for label, n in document[name].items()],
                                              len(document[name])) + "</figure>"
        for name, title, column in (("by_host", "By host", "host"), ("by_hour", "By hour (UTC)", "hour")))
    gone = document.get("loaded_gone") or []
    gone_rows = [f'<tr><td class="key">{inert_html(row["key"], 1024)}</td><td class="num">{row["loads"]:,}</td>'
                 f'<td class="num">{row["served"]:,}</td><td>{"yes" if row["flagged"] else "no"}</td>'
                 f'<td class="mono">{inert_html(_short_time(row["last_load"]))}</td></tr>' for row in gone[:TABLE_MAX_ROWS]]
    gone_section = (f'<section id="loaded-gone"><h2>Loaded, not in the report ({len(gone):,} keys)</h2>'
                    f'<p class="note">Keys consumers loaded that the scan did not find in the store.</p>'
                    + _table("loaded-gone", ("key", "loads", "served", "flagged", "last load"), gone_rows, len(gone))
                    + "</section>" if gone else "")
    body = (
        f"<h1>mooncake-audit impact</h1>"
        f'<p class="lead"><span class="status status-{css}">{word}</span>{inert_html(sentence, 600)}</p>'
        f'<section id="summary"><h2>Summary</h2><div class="headline">{figures_html}</div>{context}</section>'
        f'<section id="timeline"><h2>Loads of flagged keys over time</h2>{legend}{timeline_svg(affected, timeline)}'
        f"</section>"
        f'<section id="affected"><h2>Flagged keys loaded ({len(affected):,})</h2>'
        + (_table("affected", ("key", "verdicts", "served", "refused", "requests", "request ids", "hosts",
                               "first load", "last load"), affected_rows, len(affected))
           if affected else "<p>No flagged key was loaded.</p>") + "</section>"
        f'<section id="requests"><h2>Requests served a flagged key ({len(requests):,})</h2>'
        + (_table("requests", ("request", "vLLM request ids", "hosts", "flagged keys", "first load", "last load"),
                  request_rows, len(requests)) if requests else "<p>None.</p>")
        + f'<div class="charts">{counts}</div></section>{gone_section}')
    return page(f"mooncake-audit impact: {word.lower()}", body)


def write_impact(document: dict, timeline: Timeline, fmt: str, output: Path | None) -> None:
    """`document` (and `timeline`, for the page) in `fmt`, to stdout or replacing `output` atomically."""
    check_writable(output)
    out = ReportOutput(output)
    if fmt == "json":
        out.write(json.dumps(document) + "\n")
    elif fmt == "html":
        out.write(render_impact_html(document, timeline))
    else:
        print_human(document, out.stream)
    out.close()
