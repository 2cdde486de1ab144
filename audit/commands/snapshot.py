"""`mooncake-audit snapshot`: every key's digests into SQLite, for `diff`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from audit.commands.common import fail, scan_report
from audit.commands.options import SCANNING, key_options, pick, progress_option, read_options, takes
from audit.errors import AuditError
from audit.report.inert import printable


@takes(*SCANNING, after=(progress_option,))
def snapshot(output: Annotated[Path, typer.Option("--output", "-o", help="The snapshot file (SQLite) to write.")],
             **options) -> None:
    """Digests of every key and region, with parsed fields, sizes and time, streamed into SQLite."""
    from audit.forensics.snapshot import SnapshotSink

    progress = options.pop("progress")
    try:
        with SnapshotSink(output) as sink:
            report = scan_report(options, True, progress, lambda: sink, **pick(options, key_options, read_options))
    except AuditError as error:
        raise fail(str(error)) from None
    typer.echo(f"snapshot of {report.summary['keys_scanned']} keys written to {printable(str(output))}", err=True)
    raise typer.Exit(report.exit_code)
