"""`mooncake-audit diff`: what changed between two snapshots, or a snapshot and the live cluster."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from audit.commands.common import check_choice, fail, scan_report
from audit.commands.options import Output, connection_options, model_options, takes
from audit.errors import AuditError


@takes(connection_options, model_options)
def diff(
    a: Annotated[Path, typer.Argument(help="A snapshot (the earlier one).")],
    b: Annotated[Optional[Path], typer.Argument(help="A later snapshot; omit it with --live.")] = None,
    live: Annotated[bool, typer.Option("--live", help="Compare A with the cluster as it is now.")] = False, *,
    fmt: Annotated[str, typer.Option("--format", help="human or json")] = "human", output: Output = None,
    **options,
) -> None:
    """Keys added, removed and changed between two snapshots, or a snapshot and the live cluster.

    Exit codes: 0 no difference is a finding, 1 differences that are findings, 2 could not run,
    3 a snapshot is incomplete or sampled (some differences may be keys it never read).
    """
    import tempfile

    from rich.console import Console

    from audit.forensics.diff import diff_document, diff_snapshots, print_diff
    from audit.forensics.snapshot import SnapshotSink, open_snapshot
    from audit.report.output import ReportOutput

    check_choice("--format", fmt, ("human", "json"))
    if (b is None) == (not live):
        raise fail("give two snapshots, or one snapshot and --live")
    try:
        with tempfile.TemporaryDirectory(prefix="mooncake-audit-diff-") as work:
            if live:
                with open_snapshot(a) as earlier:
                    filters = (earlier.meta.get("summary") or {}).get("filters") or {}
                b = Path(work) / "live.db"
                with SnapshotSink(b) as sink:
                    scan_report(options, True, False, lambda: sink, prefix=filters.get("prefix") or "",
                                match=filters.get("match"), device="cpu", read_mode="peek")
            result = diff_snapshots(a, b)
            out = ReportOutput(output)
            if fmt == "json":
                out.write(json.dumps(diff_document(result)) + "\n")
            else:
                print_diff(result, Console(file=out.stream, width=160, highlight=False,
                                           force_terminal=None if output is None else False))
            out.close()
    except AuditError as error:
        raise fail(str(error)) from None
    raise typer.Exit(result.exit_code)
