"""`mooncake-audit crossref`: NULL_BACKED verdicts added to a report written earlier."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from audit.commands.common import check_choice, fail
from audit.commands.options import All, BlockTablesOpt, Format, Lenient, Output
from audit.errors import AuditError
from audit.report import FORMATS, make_sink


def crossref(
    report: Annotated[Path, typer.Argument(help="A JSON (best with --all) or JSONL report of a scan.")],
    block_tables: BlockTablesOpt = None, lenient: Lenient = False,
    fmt: Format = "human", output: Output = None, include_all: All = False,
) -> None:
    """Add NULL_BACKED verdicts to a report written earlier, from producer block tables."""
    from audit.blocktables import read_block_tables
    from audit.judge.crossref import crossref_report

    check_choice("--format", fmt, FORMATS)
    if not block_tables:
        raise fail("give --block-tables PATH (a JSONL file or a directory of them)")
    try:
        sink = make_sink(fmt, output, include_all=include_all)
        result = crossref_report(report, read_block_tables(block_tables, lenient=lenient))
    except AuditError as error:
        raise fail(str(error)) from None
    for record in result.records:
        sink.record(record)
    sink.finish(result)
    raise typer.Exit(result.exit_code)
