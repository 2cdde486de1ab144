"""`mooncake-audit report`: a JSON report as one self-contained HTML page."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from audit.commands.common import fail
from audit.errors import AuditError


def report(
    report_path: Annotated[Path, typer.Argument(metavar="REPORT", help="A JSON report (best written with --all).")],
    html: Annotated[Path, typer.Option("--html", help="Write one self-contained HTML page here.")],
) -> None:
    """Render a JSON report as one self-contained HTML page: summary, findings, heat map, charts."""
    from audit.report.html import write_html

    try:
        write_html(report_path, html)
    except AuditError as error:
        raise fail(str(error)) from None
