"""The default format: a summary and a table of findings (every key with `--all`)."""

from __future__ import annotations

from collections import Counter

from rich.console import Console
from rich.table import Table

from audit.records import KeyRecord, Report
from audit.report.inert import human_bytes, inert, printable
from audit.report.output import ReportOutput, WholeReportSink



def _verdict_line(summary: dict) -> str:
    if summary["findings"]:
        return f"FINDINGS: {summary['findings']} key(s) flagged"
    if not summary["complete"]:
        return "INCOMPLETE: no findings, but not every key could be read"
    return "CLEAN: every key read, no findings"


def _scope(findings: list[KeyRecord]) -> list[str]:
    """Where the findings are, for the operator deciding what to purge: per vLLM model and rank."""
    parsed = [r.parsed_fields() for r in findings]
    counts = Counter((f.get("model"), f.get("tp_rank")) for f in parsed if f.get("scheme") == "vllm")
    return [f"{printable(model, 60)} tp{rank}: {n}" for (model, rank), n in sorted(counts.items(), key=str)]


class HumanSink(WholeReportSink):
    def finish(self, report: Report) -> None:
        out = ReportOutput(self.output)
        console = Console(file=out.stream, highlight=False, soft_wrap=False, width=160,
                          force_terminal=None if self.output is None else False)
        summary = report.summary
        console.print(_verdict_line(summary), markup=False)
        rate = summary.get("bytes_per_s")
        console.print(
            f"{summary['keys_scanned']}/{summary['keys_listed']} keys, {human_bytes(summary['bytes_scanned'])} "
            f"in {summary['duration_s']:.2f} s ({human_bytes(rate)}/s)" if rate else
            f"{summary['keys_scanned']}/{summary['keys_listed']} keys, {human_bytes(summary['bytes_scanned'])}",
            markup=False)
        if summary["verdicts"]:
            console.print("verdicts: " + ", ".join(f"{v}={n}" for v, n in summary["verdicts"].items()),
                          markup=False)
        scope = _scope(report.findings)
        if scope:
            console.print("findings by model and TP rank: " + ", ".join(scope), markup=False)
        rows = sorted(report.records if self.include_all else report.findings, key=lambda r: r.key)
        if rows:
            table = Table(title=None, show_lines=False)
            for column in ("key", "verdicts", "size", "xxh3"):
                table.add_column(column, overflow="fold")
            for record in rows:
                table.add_row(inert(record.key), inert(",".join(record.verdicts) or "OK"),
                              str(record.size if record.size is not None else "-"),
                              f"{record.xxh3:016x}" if record.xxh3 is not None else "-")
            console.print(table)
        out.close()
