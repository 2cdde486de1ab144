"""`mooncake-audit`: the command line. Builds the typer app from the commands in audit/commands/ and runs it."""

from __future__ import annotations

# First: importing audit.commands takes the CLI's earliest timestamp (--verbose counts the imports from it).
from audit.commands import (check, crossref, demo, diff, explain, impact, layout, purge, report, scan, simulate,
                            snapshot, verify, watch)

import os
import signal
import sys
from typing import Annotated

import typer

from audit.run.collector import tune_for_scanning

app = typer.Typer(help="Byte-level audit of the values published into Mooncake Store.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)


def _version(value: bool) -> None:
    if value:
        from audit import __version__

        typer.echo(f"mooncake-audit {__version__}")
        raise typer.Exit(0)


@app.callback()
def _options(version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                                   help="Print the version and exit.")] = False) -> None:
    """Byte-level audit of the values published into Mooncake Store."""


# In the order --help lists them.
app.command("scan")(scan.scan)
app.command("check")(check.check)
app.command("watch")(watch.watch)
app.command("snapshot")(snapshot.snapshot)
app.command("diff")(diff.diff)
app.command("purge")(purge.purge)
app.command("verify")(verify.verify)
app.command("layout")(layout.layout_command)
app.command("crossref")(crossref.crossref)
app.command("impact")(impact.impact_command)
app.command("report")(report.report)
app.command("explain")(explain.explain)
app.command("simulate")(simulate.simulate)
app.command("demo")(demo.demo)


def _terminate(signum, frame) -> None:
    raise KeyboardInterrupt


def _only_named_command(first: list[str]) -> None:
    """Keep only the command the command line names: typer builds every registered command's
    options when the app starts (about 40 ms for the 14 here), and a scan from cron runs one. The
    top-level help, `--version` and an unknown name still see every command."""
    named = [info for info in app.registered_commands if first and info.name == first[0]]
    if named:
        app.registered_commands = named


def main() -> None:
    # Mooncake's C++ client logs every connection step at INFO on stderr; keep stderr for us.
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    # SIGTERM ends a command as Ctrl-C does; scans stop between batches and write their report instead.
    signal.signal(signal.SIGTERM, _terminate)
    tune_for_scanning()
    try:
        _only_named_command(sys.argv[1:2])
        app()
    except KeyboardInterrupt:
        typer.echo("mooncake-audit: interrupted", err=True)
        sys.exit(130)


if __name__ == "__main__":
    main()
