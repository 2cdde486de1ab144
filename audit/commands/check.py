"""`mooncake-audit check`: the scan tuned for cron."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from audit.commands.common import scan_and_exit
from audit.commands.options import (SCANNING, CheckpointOpt, EvidenceDir, FailOn, MaxBandwidth, OffloadDir, PurgedLog,
                                    ReadMode, Resume, Sample, Seed, Verbose, offload_directories, progress_option,
                                    report_options, takes)

StateDirOpt = Annotated[Optional[Path], typer.Option("--state-dir", envvar="MOONCAKE_AUDIT_STATE_DIR",
                                                     help="Lock against overlapping runs; remembers keys seen, "
                                                          "so a sampled run also reads every new key.")]
Deadline = Annotated[Optional[float], typer.Option("--deadline", envvar="MOONCAKE_AUDIT_DEADLINE", min=0.001,
                                                   help="Stop cleanly after this many seconds.")]
PromFile = Annotated[Optional[Path], typer.Option("--prom-file", envvar="MOONCAKE_AUDIT_PROM_FILE",
                                                  help="node_exporter textfile to write (atomically).")]
Pushgateway = Annotated[Optional[str], typer.Option("--pushgateway", envvar="MOONCAKE_AUDIT_PUSHGATEWAY",
                                                    help="Prometheus Pushgateway URL.")]


@takes(*SCANNING, after=(report_options, progress_option))
def check(*, sample: Sample = None, seed: Seed = 0, state_dir: StateDirOpt = None, deadline: Deadline = None,
          max_bandwidth: MaxBandwidth = None, checkpoint: CheckpointOpt = None, resume: Resume = False,
          prom_file: PromFile = None, pushgateway: Pushgateway = None, evidence: EvidenceDir = None,
          read_mode: ReadMode = "peek", offload_dir: OffloadDir = None, purged: PurgedLog = None,
          fail_on: FailOn = "error", verbose: Verbose = False, **options) -> None:
    """The scan tuned for cron: sampling, a deadline, a bandwidth limit, a lock, metrics.

    Exit codes: 0 clean (warnings allowed unless --fail-on warning), 1 errors, 2 could not run (or
    another check holds the lock), 3 incomplete.
    """
    scan_and_exit(options, verbose, sample=sample, seed=seed, state_dir=state_dir, deadline_s=deadline,
                  max_bandwidth=max_bandwidth, checkpoint=checkpoint, resume=resume, prom_file=prom_file,
                  pushgateway=pushgateway, evidence_dir=evidence, read_mode=read_mode,
                  offload_dirs=offload_directories(offload_dir), purge_logs=tuple(purged or ()),
                  fail_on=fail_on)
