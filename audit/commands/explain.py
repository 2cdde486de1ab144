"""`mooncake-audit explain`: everything about one key."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from audit.commands.common import check_choice, check_plan, fail, resolve_settings
from audit.commands.options import block_table_options, connection_options, model_options, pick, takes
from audit.errors import AuditError


@takes(connection_options, model_options, block_table_options)
def explain(key: Annotated[str, typer.Argument(help="The exact key name.")], *,
            fmt: Annotated[str, typer.Option("--format", help="human or json")] = "human", **options) -> None:
    """Everything about one key: per region zero, NaN/Inf, digest, min/max/mean, first bytes, and
    the block-table records that name it."""
    from audit.explain import explain_key
    from audit.report.views import print_explain

    check_choice("--format", fmt, ("human", "json"))
    try:
        settings = resolve_settings(**pick(options, connection_options))
        plan = check_plan(**pick(options, model_options, block_table_options), include_all=True)
        document = explain_key(settings, key, plan)
    except AuditError as error:
        raise fail(str(error)) from None
    if fmt == "json":
        typer.echo(json.dumps(document, indent=1))
    else:
        print_explain(document)
    findings = any(v not in ("VANISHED", "MOVED", "UNREACHABLE", "READ_ERROR") for v in document["verdicts"])
    raise typer.Exit(1 if findings else 0)
