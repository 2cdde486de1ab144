"""`mooncake-audit purge`: remove flagged keys, their bytes saved first."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Annotated, Optional

import typer

from audit.commands.common import fail, resolve_settings, scan_report
from audit.commands.options import (OffloadDir, block_table_options, connection_options, key_options, model_options,
                                    offload_directories, pick, takes)
from audit.errors import AuditError
from audit.report.inert import printable


@takes(connection_options, key_options, model_options, block_table_options)
def purge(
    report_path: Annotated[Optional[Path], typer.Argument(
        metavar="[REPORT]", help="A JSON/JSONL report whose findings to remove; omit it to scan the live cluster.")] = None,
    verdict: Annotated[Optional[list[str]], typer.Option("--verdict", help="Only keys with this verdict. Repeatable.")] = None,
    yes: Annotated[bool, typer.Option("--yes", help="Really remove (default: a dry run that lists what would go).")] = False,
    force: Annotated[bool, typer.Option("--force", help="Remove keys a reader holds a lease on, without waiting.")] = False,
    evidence: Annotated[Optional[Path], typer.Option("--evidence", help="Where the removed keys' bytes are saved first.",
                                                     show_default="./mooncake-audit-evidence-<time>")] = None,
    log: Annotated[Optional[Path], typer.Option("--log", help="Append every outcome here (JSONL).",
                                                show_default="purge-log.jsonl beside the evidence")] = None,
    offload_dir: OffloadDir = None,
    stale_disk_copies: Annotated[bool, typer.Option(
        "--stale-disk-copies", help="Instead of removing keys, take out of --offload-dir the SSD copies the report "
        "names as listed for no key and unlike the bytes in memory (a key put again keeps its first copy, which a "
        "holder restart serves); the keys stay.")] = False,
    **options,
) -> None:
    """Remove flagged keys: dry run unless --yes; evidence saved first; keys changed since the scan
    are never removed. With --offload-dir (a holder's SSD tier on this host), disk-only keys are read
    from its files and a removed key's disk copies are taken out of them, so that a holder restart
    does not bring the key back; with --stale-disk-copies, only the report's stale SSD copies are.
    Exit codes: 0 done, 2 could not run, 3 some keys (or copies) were not removed, or a removed
    key's disk copy remains."""
    from datetime import datetime, timezone

    from audit.forensics.purge import purge as run_purge
    from audit.forensics.purge import targets_from_report, write_log
    from audit.forensics.stale_copies import stale_copies_of_report, take_out_stale_copies
    from audit.report.json_report import JsonSink

    if report_path is None and (stale_disk_copies or not verdict):
        raise fail("give a REPORT" + ("" if stale_disk_copies else ", or --verdict V to purge what a scan of the live "
                                                                    "cluster flags"))
    connection = pick(dict(options), connection_options)
    try:
        with tempfile.TemporaryDirectory(prefix="mooncake-audit-purge-") as work:
            if report_path is None:
                report_path = Path(work) / "scan.json"
                scan_report(options, False, None, lambda: JsonSink(report_path), **pick(options, key_options),
                            device="cpu", read_mode="peek")  # no leases: the removals that follow are not refused
            stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
            evidence = evidence or Path(f"mooncake-audit-evidence-{stamp}")
            log = log or evidence / "purge-log.jsonl"
            if stale_disk_copies:
                outcomes = take_out_stale_copies(resolve_settings(**connection), stale_copies_of_report(report_path),
                                                 offload_directories(offload_dir), execute=yes,
                                                 evidence_dir=evidence if yes else None, on_outcome=_print_outcome)
            else:
                outcomes = run_purge(resolve_settings(**connection), targets_from_report(report_path, verdict or ()),
                                     execute=yes, force=force, evidence_dir=evidence if yes else None,
                                     offload_dirs=offload_directories(offload_dir), on_outcome=_print_outcome)
            if yes:
                write_log(log, outcomes)
    except AuditError as error:
        raise fail(str(error)) from None
    counts = {action: sum(1 for o in outcomes if o.action == action) for action in sorted({o.action for o in outcomes})}
    summary = ", ".join(f"{action} {n}" for action, n in counts.items()) or "nothing to purge"
    typer.echo(f"{'purge' if yes else 'dry run (add --yes to remove)'}: {summary}"
               + (f"; evidence in {printable(str(evidence))}, log {printable(str(log))}" if yes else ""), err=True)
    remains = [o for o in outcomes if o.disk_copy_remains]
    if remains:
        typer.echo(f"{len(remains)} removed key(s) keep a disk copy that a holder restart brings back; on each "
                   f"holder's host run this purge again with --offload-dir (its MOONCAKE_OFFLOAD_FILE_STORAGE_PATH)",
                   err=True)
    done = {"would-remove", "removed", "gone", "would-take-out", "taken-out", "listed"}
    raise typer.Exit(0 if set(counts) <= done and not remains else 3)


def _print_outcome(outcome) -> None:
    """One line a key; one more a disk copy taken out, or left on a holder this purge cannot reach."""
    typer.echo(f"{outcome.action:12} {printable(outcome.key)}")
    for copy in outcome.disk_copies or ():
        if copy["how"] == "remains":
            typer.echo(f"{'disk-copy':12} {printable(outcome.key)}: remains on holder {printable(copy['endpoint'])}'s "
                       f"SSD (run purge on that host with --offload-dir)", err=True)
        else:
            typer.echo(f"{'disk-copy':12} {printable(outcome.key)}: {copy['how']} {printable(copy['file'])} "
                       f"(bytes in {printable(copy['evidence'])})")
