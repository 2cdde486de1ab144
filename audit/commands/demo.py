"""`mooncake-audit demo`: an embedded cluster, a simulated bad producer, a scan, a verdict."""

from __future__ import annotations

import typer

from audit.commands.common import check_choice, fail
from audit.commands.options import All, Format, Output, ShowProgress
from audit.errors import AuditError
from audit.report import FORMATS, make_sink
from audit.run.progress import ScanProgress


def demo(
    fmt: Format = "human", output: Output = None, include_all: All = False, progress: ShowProgress = None,
) -> None:
    """Start an embedded local cluster, publish what vLLM with bug #53084 would, scan it, stop the cluster.

    Exit codes: 0 when the scan flagged exactly the keys the simulated producer made bad, 1 when it
    did not, 2 when the demo could not run.
    """
    from audit.demo import run_demo

    check_choice("--format", fmt, FORMATS)
    try:
        outcome = run_demo(make_sink(fmt, output, include_all=include_all), ScanProgress(progress),
                           log=lambda line: typer.echo(line, err=True))
    except AuditError as error:
        raise fail(str(error)) from None
    raise typer.Exit(0 if outcome.exact else 1)
