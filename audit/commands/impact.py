"""`mooncake-audit impact REPORT --block-tables DIR`: which requests were served the flagged keys
of a report (docs/forensics.md#2-scope)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from audit.commands.common import check_choice, fail
from audit.errors import AuditError
from audit.report.impact import IMPACT_FORMATS

# As options.py declares them for the other commands (same flags, same environment variables), with
# help that speaks of the recorder's records.
RecordDirs = Annotated[Optional[list[Path]], typer.Option(
    "--block-tables", envvar="MOONCAKE_AUDIT_BLOCK_TABLES",
    help="The recorder's directory (put records, load records, manifests), or its files. Repeatable.")]
Lenient = Annotated[bool, typer.Option("--lenient", help="Skip (and count) malformed record lines.")]
Format = Annotated[str, typer.Option("--format", envvar="MOONCAKE_AUDIT_FORMAT", help="human, json or html.")]
Output = Annotated[Optional[Path], typer.Option("--output", "-o", envvar="MOONCAKE_AUDIT_OUTPUT",
                                               help="Write the result here (atomically) instead of stdout.")]


def impact_command(
    report: Annotated[Path, typer.Argument(metavar="REPORT", help="A JSON (best with --all) or JSONL scan report.")],
    block_tables: RecordDirs = None, lenient: Lenient = False, fmt: Format = "human", output: Output = None,
) -> None:
    """Which requests were served a flagged key: the report's findings (and NULL_BACKED from the put
    records) joined with the consumers' load records.

    Exit codes: 1 when a flagged key was served to a request, 0 when none was (a load the guard
    refused is listed, but kept the key from its request), 2 when it could not run.
    """
    from audit.forensics.impact import impact_of_report
    from audit.report.impact import write_impact
    from audit.report.output import check_writable

    check_choice("--format", fmt, IMPACT_FORMATS)
    if not block_tables:
        raise fail("give --block-tables DIR (the recorder's directory, with its loads-*.jsonl files)")
    try:
        check_writable(output)  # before the records are read, not after
        result = impact_of_report(report, block_tables, lenient=lenient)
        write_impact(result.to_json(), result.timeline, fmt, output)
    except AuditError as error:
        raise fail(str(error)) from None
    raise typer.Exit(result.exit_code)
