"""`mooncake-audit scan`: every key, every value, once."""

from __future__ import annotations

from audit.commands.common import scan_and_exit
from audit.commands.options import (SCANNING, CheckpointOpt, EvidenceDir, FailOn, OffloadDir, PurgedLog, ReadMode,
                                    Resume, Verbose, offload_directories, progress_option, report_options,
                                    takes)


@takes(*SCANNING, after=(report_options, progress_option))
def scan(*, checkpoint: CheckpointOpt = None, resume: Resume = False, evidence: EvidenceDir = None,
         read_mode: ReadMode = "lease", offload_dir: OffloadDir = None, purged: PurgedLog = None,
         fail_on: FailOn = "error", verbose: Verbose = False, **options) -> None:
    """List every key, read every value, report digests, zero values, shared content and, with a
    layout or block tables, the vLLM #53084 verdicts.

    Exit codes: 0 clean (warnings allowed unless --fail-on warning), 1 errors, 2 could not run, 3 incomplete.
    """
    scan_and_exit(options, verbose, checkpoint=checkpoint, resume=resume, evidence_dir=evidence, read_mode=read_mode,
                  offload_dirs=offload_directories(offload_dir), purge_logs=tuple(purged or ()),
                  fail_on=fail_on)
