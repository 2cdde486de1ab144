"""The default format: a summary and a table of findings (every key with `--all`)."""

from __future__ import annotations

from collections import Counter

from rich.console import Console
from rich.table import Table

from audit.blocktables import DEFAULT_TENANT
from audit.records import KeyRecord, Report
from audit.report.coverage import coverage_headline, gap_lines, missed_keys
from audit.report.inert import human_bytes, inert, inert_key, printable
from audit.report.output import ReportOutput, WholeReportSink


def _verdict_line(summary: dict) -> str:
    """The headline, in step with the exit code: errors fail the run, warnings only under
    --fail-on warning; what was not audited, or not judged fully, makes it incomplete."""
    if summary["exit_code"] == 1:
        return f"FINDINGS: {summary['findings']} key(s) flagged"
    none = "no errors" if summary["findings"] else "no findings"
    warned = (f"; {summary['findings']} key(s) with warnings only (they fail the run with --fail-on warning)"
              if summary["findings"] else "")
    coverage = summary.get("coverage")
    if coverage is not None and not coverage["complete"]:
        missed = missed_keys(coverage)
        return (f"INCOMPLETE: {none}, but {'some' if missed is None else f'{missed:,}'} key(s) the master "
                f"holds were not audited (see below){warned}")
    if summary.get("keys_not_fully_judged") and not summary["keys_unread"]:
        return (f"INCOMPLETE: {none}, but {summary['keys_not_fully_judged']} key(s) not judged fully: "
                f"their layout is ambiguous (see below){warned}")
    if not summary["complete"]:
        return f"INCOMPLETE: {none}, but not every key could be read{warned}"
    if summary["findings"]:
        return f"NO ERRORS: every key read{warned}"
    return "CLEAN: every key read, no findings"


def _ambiguous_layouts(summary: dict) -> list[str]:
    """Groups whose value size fits several readings the bytes could not tell apart, and the flags
    that would settle each."""
    return [f"layout ambiguous: {printable(row['model'], 60)} group {row['group']}: {len(row['candidates'])} "
            f"readings fit {row['dominant_size']:,} B; settle with {' or '.join(row['settle_with'])}"
            for row in summary.get("layout_inference") or () if row.get("status") == "ambiguous"]


def _binding_line(binding: dict) -> str:
    """Which models' states were bound to their weights at layer 0, and why the others were not."""
    bound = ", ".join(printable(model, 60) for model in binding["bound"]) or "none"
    not_bound = "; ".join(f"{printable(model, 60)}: {printable(reason, 160)}"
                          for model, reason in binding["not_bound"].items())
    line = f"layer-0 binding: {bound}" + (f"; not bound: {not_bound}" if not_bound else "")
    compared = Counter(row["status"] if row["status"] in ("other weights", "same weights") else "nothing claimed"
                       for row in binding.get("fingerprints") or ())
    if compared:  # per manifest: its producer's checkpoint against the one given
        line += "; producers' checkpoints: " + ", ".join(f"{count} {status}" for status, count in
                                                         sorted(compared.items()))
    supplied = binding.get("supplied_rows") or {}
    if any(supplied.values()):  # no token's image, and not flagged: rows of embeddings given to vLLM?
        line += (f"; not flagged, rows of no token that may be embeddings given to vLLM: {supplied['recorded']} "
                 f"as their producers recorded, {supplied['unrecorded']} of a model taking an encoder's "
                 f"embeddings with no record (give --block-tables)")
    for model in supplied.get("no_key_bound") or ():
        line += (f"; no key of {printable(model, 60)} bound to a token: of other weights, unless every key read "
                 f"is of an image")
    return line


def _scope(findings: list[KeyRecord]) -> list[str]:
    """Where the findings are, for the operator deciding what to purge: per vLLM model and rank."""
    parsed = [r.parsed_fields() for r in findings]
    counts = Counter((f.get("model"), f.get("tp_rank")) for f in parsed if f.get("scheme") == "vllm")
    return [f"{printable(model, 60)} tp{rank}: {n}" for (model, rank), n in sorted(counts.items(), key=str)]


def _by_design(summary: dict) -> str | None:
    """What the producers write on purpose: counted, never flagged (docs/producers.md)."""
    verdicts = summary["verdicts"]
    duplicates, warmups = verdicts.get("EXPECTED_DUPLICATE", 0), verdicts.get("WARMUP_KEY", 0)
    if not duplicates and not warmups:
        return None
    return (f"by design, not findings: {duplicates} key(s) in {summary.get('expected_duplicate_groups', 0)} "
            f"expected duplicate group(s), {warmups} warm-up key(s)")


def _offload_lines(offload: dict) -> list[str]:
    """The SSD tier read from offload directories: disk copies compared, values no master lists."""
    lines = [f"disk copies (--offload-dir): {offload['disk_copies_compared']} compared with memory, "
             f"{offload['disk_copies_divergent']} divergent"
             + (f", {offload['disk_copies_elsewhere']} on other hosts' disks, not compared"
                if offload["disk_copies_elsewhere"] else "")]
    split = {directory: holder for directory, holder in (offload.get("holders") or {}).items()
             if holder["known"] == "learnt" and holder["naming"] < holder["asked"]}
    for directory, holder in split.items():  # (the other keys asked are listed elsewhere: put again there?)
        lines.append(f"holder of {printable(directory, 120)} learnt from the master: {printable(holder['endpoint'], 80)}, "
                     f"named by {holder['naming']} of the {holder['asked']} newest keys asked; if another holder owns "
                     f"it, give it as --offload-dir DIR=ENDPOINT")
    unlisted = offload.get("unlisted")
    if unlisted and unlisted["values"]:
        shown = ", ".join(printable(value["key"], 80) + (f" (tenant {printable(value['tenant'], 40)})"
                                                           if value.get("tenant") else "")
                          for value in unlisted["named"][:5])
        lines.append(f"on disk but listed by no master: {unlisted['values']} value(s), which a holder restart "
                     f"registers again: {shown}{', ...' if unlisted['values'] > 5 else ''}")
    latent = offload.get("latent")
    if latent and latent["copies"]:
        shown = ", ".join(printable(row["key"], 80) + (f" (tenant {printable(row['tenant'], 40)})"
                                                       if row.get("tenant") else "") for row in latent["named"][:5])
        superseded = latent.get("superseded", 0)
        lines.append(f"on disk but not listed for its key: {latent['copies']} copy(ies), {latent['unlike_memory']} "
                     f"unlike the bytes in memory, which a restart of the holder registers again in their place"
                     + (f" ({superseded} beside the key's current copy on another holder: served again if their holder "
                        f"restarts once the key has left the store)" if superseded else "")
                     + f": {shown}{', ...' if latent['copies'] > 5 else ''}")
    return lines


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
        for line in _ambiguous_layouts(summary):
            console.print(line, markup=False)
        if "binding" in summary:
            console.print(_binding_line(summary["binding"]), markup=False)
        if "coverage" in summary:
            for line in [coverage_headline(summary["coverage"]), *gap_lines(summary["coverage"])]:
                console.print(line, markup=False)
        for line in _offload_lines(summary["offload"]) if "offload" in summary else ():
            console.print(line, markup=False)
        by_design = _by_design(summary)
        if by_design:
            console.print(by_design, markup=False)
        scope = _scope(report.findings)
        if scope:
            console.print("findings by model and TP rank: " + ", ".join(scope), markup=False)
        rows = sorted(report.records if self.include_all else report.findings, key=lambda r: r.key)
        if rows:
            table = Table(title=None, show_lines=False)
            tenants = any(record.tenant is not None for record in rows)
            table.add_column("key", no_wrap=True)  # one line a key: its hash's middle elided (JSON has it whole)
            for column in (*(("tenant",) if tenants else ()), "verdicts", "size", "xxh3"):
                table.add_column(column, overflow="fold")
            for record in rows:
                table.add_row(inert_key(record.key), *((inert(record.tenant or DEFAULT_TENANT),) if tenants else ()),
                              inert(",".join(record.verdicts) or "OK"),
                              str(record.size if record.size is not None else "-"),
                              f"{record.xxh3:016x}" if record.xxh3 is not None else "-")
            console.print(table)
        out.close()
