"""`mooncake-audit watch`: the scrubber that runs until stopped."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from audit.commands.common import check_choice, check_plan, fail, resolve_settings
from audit.commands.options import (MaxBandwidth, PurgedLog, ReadMode, block_table_options, connection_options,
                                    HOLDER_HELP, key_options, model_options, offload_directories, pick, read_options,
                                    takes)
from audit.errors import AuditError
from audit.report.inert import printable

WatchOffloadDir = Annotated[Optional[list[Path]], typer.Option(
    "--offload-dir", envvar="MOONCAKE_AUDIT_OFFLOAD_DIR", metavar="DIR[=ENDPOINT]",
    help="A holder's SSD offload directory on this host (its MOONCAKE_OFFLOAD_FILE_STORAGE_PATH): with --read-mode "
         "peek, disk-only keys are read from its files (bucket or file-per-key backend), with no lease and no "
         "promotion; a key in memory and on disk has its disk copy compared with memory when it is read or its "
         "copies change (REPLICA_DIVERGENT). " + HOLDER_HELP + " Repeatable.")]


@takes(connection_options, key_options, read_options, model_options, block_table_options)
def watch(*, state_dir: Annotated[Optional[Path], typer.Option(
              "--state-dir", envvar="MOONCAKE_AUDIT_STATE_DIR",
              help="Its state (SQLite), findings.jsonl and lock. Required.")] = None,
          interval: Annotated[float, typer.Option(
              "--interval", envvar="MOONCAKE_AUDIT_INTERVAL", min=0.1,
              help="Seconds between listings (new keys first); stretched while the listing takes over a "
                   "tenth of it.")] = 5.0,
          period: Annotated[str, typer.Option(
              "--period", envvar="MOONCAKE_AUDIT_PERIOD", help="Re-read every key at least this often "
                                                               "(3600, 30m, 24h, 7d), oldest first.")] = "24h",
          window: Annotated[Optional[str], typer.Option(
              "--window", envvar="MOONCAKE_AUDIT_WINDOW", metavar="HH:MM-HH:MM",
              help="Re-read old keys only inside this local-time window (new keys are read at once).")] = None,
          listen: Annotated[str, typer.Option(
              "--listen", envvar="MOONCAKE_AUDIT_LISTEN", help="HOST:PORT for /metrics and /healthz.")]
          = "127.0.0.1:9310",
          max_bandwidth: MaxBandwidth = None, read_mode: ReadMode = "peek", offload_dir: WatchOffloadDir = None,
          purged: PurgedLog = None, **options) -> None:
    """Scrub continuously: every new key within seconds of its listing, every key once per period.

    Runs until SIGTERM or SIGINT (exit 0, state flushed); exit 2 if it cannot start.
    """
    from audit.run.device import resolve_placement
    from audit.run.options import ScanOptions
    from audit.run.watch import Watcher, WatchOptions, parse_duration, parse_window

    check_choice("--read-mode", read_mode, ("lease", "peek"))
    if state_dir is None:
        raise fail("give --state-dir DIR: where watch keeps its state")
    try:
        settings = resolve_settings(**pick(options, connection_options))
        block_options = pick(dict(options), block_table_options)
        plan = check_plan(**pick(options, model_options, block_table_options))
        read = pick(options, read_options)
        placement = resolve_placement(read.pop("device"), read.pop("checker"), read_mode)
        scan_options = ScanOptions(plan=plan, placement=placement, read_mode=read_mode, max_bandwidth=max_bandwidth,
                                   offload_dirs=offload_directories(offload_dir), purge_logs=tuple(purged or ()),
                                   **pick(options, key_options), **read)
        watch_options = WatchOptions(state_dir=state_dir, interval_s=interval, period_s=parse_duration(period),
                                     window=None if window is None else parse_window(window), listen=listen,
                                     block_tables=tuple(block_options["block_tables"] or ()),
                                     lenient=block_options["lenient"], scan=scan_options)
        stopped_by = Watcher(settings, watch_options, log=lambda line: typer.echo(printable(line, 400), err=True)).run()
    except AuditError as error:
        raise fail(str(error)) from None
    typer.echo(f"watch: stopped ({stopped_by}); state in {printable(str(state_dir))}", err=True)
    raise typer.Exit(0)
