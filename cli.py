"""`mooncake-audit`: the command line. Parses options, calls `audit`, picks the output; nothing else."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from audit.connection import Settings
from audit.errors import AuditError
from audit.orchestrator import ScanOptions, run_scan
from audit.progress import ScanProgress
from audit.report import FORMATS, make_sink
from audit.report.inert import printable

app = typer.Typer(help="Byte-level audit of the values published into Mooncake Store.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)

Master = Annotated[Optional[str], typer.Option("--master", envvar="MOONCAKE_AUDIT_MASTER",
                                              help="Master RPC address HOST:PORT.", show_default="127.0.0.1:50051")]
Metadata = Annotated[Optional[str], typer.Option("--metadata", envvar="MOONCAKE_AUDIT_METADATA",
                                                help="Metadata server URL.", show_default="http://<master host>:8080/metadata")]
Admin = Annotated[Optional[str], typer.Option("--admin", envvar="MOONCAKE_AUDIT_ADMIN",
                                             help="Master admin HTTP URL.", show_default="http://<master host>:9003")]
Protocol = Annotated[Optional[str], typer.Option("--protocol", envvar="MOONCAKE_AUDIT_PROTOCOL",
                                                help="Transfer protocol: tcp or rdma.", show_default="tcp")]
DeviceName = Annotated[Optional[str], typer.Option("--device-name", envvar="MOONCAKE_AUDIT_DEVICE_NAME",
                                                  help="RDMA device name(s).")]
LocalHostname = Annotated[Optional[str], typer.Option("--local-hostname", envvar="MOONCAKE_AUDIT_LOCAL_HOSTNAME",
                                                     help="This host's address for transfers.",
                                                     show_default="the address that routes to the master")]
Config = Annotated[Optional[Path], typer.Option("--config", envvar="MOONCAKE_CONFIG_PATH",
                                               help="Mooncake JSON config, as vLLM's connector reads it.")]
Prefix = Annotated[str, typer.Option("--prefix", envvar="MOONCAKE_AUDIT_PREFIX", help="Only keys starting with this.")]
Match = Annotated[Optional[str], typer.Option("--match", envvar="MOONCAKE_AUDIT_MATCH",
                                             help="Only keys matching this regular expression (search).")]
BufferMb = Annotated[int, typer.Option("--buffer-mb", envvar="MOONCAKE_AUDIT_BUFFER_MB", min=1,
                                      help="Registered read buffer, MiB (two halves, double-buffered).")]
Format = Annotated[str, typer.Option("--format", envvar="MOONCAKE_AUDIT_FORMAT",
                                    help="Report format: human, json or jsonl.")]
Output = Annotated[Optional[Path], typer.Option("--output", "-o", envvar="MOONCAKE_AUDIT_OUTPUT",
                                               help="Write the report here (atomically) instead of stdout.")]
All = Annotated[bool, typer.Option("--all", help="Every key's record, not only findings.")]
ShowProgress = Annotated[Optional[bool], typer.Option("--progress/--no-progress", envvar="MOONCAKE_AUDIT_PROGRESS",
                                                     help="Progress on stderr.", show_default="on a terminal")]


def fail(message: str, code: int = 2) -> typer.Exit:
    """One line on stderr, no traceback."""
    typer.echo(f"mooncake-audit: error: {printable(message, 400)}", err=True)
    return typer.Exit(code)


def _check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise fail(f"--format must be one of {', '.join(FORMATS)}, not {fmt!r}")


@app.command()
def scan(
    master: Master = None, metadata: Metadata = None, admin: Admin = None, protocol: Protocol = None,
    device_name: DeviceName = None, local_hostname: LocalHostname = None, config: Config = None,
    prefix: Prefix = "", match: Match = None, buffer_mb: BufferMb = 256,
    fmt: Format = "human", output: Output = None, include_all: All = False, progress: ShowProgress = None,
) -> None:
    """List every key, read every value, report digests, zero values and shared content.

    Exit codes: 0 clean, 1 findings, 2 could not run, 3 incomplete.
    """
    _check_format(fmt)
    if protocol is not None and protocol not in ("tcp", "rdma"):
        raise fail(f"--protocol must be tcp or rdma, not {protocol!r}")
    try:
        settings = Settings.resolve(master=master, metadata=metadata, admin=admin, protocol=protocol,
                                    device_name=device_name, local_hostname=local_hostname, config=config)
        report = run_scan(settings, ScanOptions(prefix=prefix, match=match, buffer_mb=buffer_mb),
                          make_sink(fmt, output, include_all=include_all), ScanProgress(progress))
    except AuditError as error:
        raise fail(str(error)) from None
    raise typer.Exit(report.exit_code)


@app.command()
def demo(
    fmt: Format = "human", output: Output = None, include_all: All = False, progress: ShowProgress = None,
) -> None:
    """Start an embedded local cluster, publish a small vLLM-style workload, scan it, stop the cluster."""
    from audit.demo import run_demo

    _check_format(fmt)
    try:
        report = run_demo(make_sink(fmt, output, include_all=include_all), ScanProgress(progress),
                          log=lambda line: typer.echo(line, err=True))
    except AuditError as error:
        raise fail(str(error)) from None
    raise typer.Exit(report.exit_code)


def main() -> None:
    # Mooncake's C++ client logs every connection step at INFO on stderr; keep stderr for us.
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    try:
        app()
    except KeyboardInterrupt:
        typer.echo("mooncake-audit: interrupted", err=True)
        sys.exit(130)


if __name__ == "__main__":
    main()
