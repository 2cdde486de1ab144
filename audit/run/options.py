"""What one scan is asked to do: every option of `scan`, `check` and `snapshot`, in one place for
the orchestrator and the Ray driver alike."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from audit.connection import Settings
from audit.errors import AuditError
from audit.judge.plan import CheckPlan
from audit.run.device import Placement
from audit.sources.listing import KeyFilter


@dataclass
class ScanOptions:
    prefix: str = ""
    match: str | None = None
    buffer_mb: int = 256
    plan: CheckPlan = field(default_factory=CheckPlan)
    placement: Placement = field(default_factory=lambda: Placement("cpu", "numpy"))
    # Cron-friendly bounds (see docs/cron.md)
    sample: int | float | None = None         # keys, or a fraction of the listing
    seed: int = 0
    state_dir: Path | None = None             # lock + keys seen before (sampled runs read every new key)
    deadline_s: float | None = None
    max_bandwidth: float | None = None        # bytes per second
    checkpoint: Path | None = None
    resume: bool = False
    prom_file: Path | None = None
    pushgateway: str | None = None
    evidence_dir: Path | None = None          # flagged keys' bytes and sidecars
    read_mode: str = "lease"                  # lease: batch_get_into; peek: lease-free raw reads (docs/read-modes.md)
    offload_dirs: tuple[Path, ...] = ()       # holders' SSD offload directories here: disk copies read from their files
    purge_logs: tuple[Path, ...] = ()         # purge logs: a key they removed, listed again with its bytes, is flagged
    verify_writer_checksum: bool = False      # Mooncake verifies the writer's CRC-64 on read (docs/verdicts.md)
    ray: str | None = None                    # a Ray address: shards read by Ray tasks (docs/scale-out.md)
    shard_mb: int = 1024                      # bytes per Ray task
    tenants: tuple[str, ...] = ()             # other tenants to audit, or "all" (docs/coverage.md)
    key_files: tuple[Path, ...] = ()          # key sources naming their keys: key lists, reports, snapshots
    fail_on: str = "error"                    # the least severity that exits 1 (docs/verdicts.md#severity)

    def scope(self, settings: Settings) -> dict:
        """What a checkpoint belongs to: resuming another scan's checkpoint would mix reports."""
        return {"master": settings.master, "admin": settings.admin, "prefix": self.prefix, "match": self.match,
                "sample": self.sample, "seed": self.seed}

    def key_filter(self) -> KeyFilter:
        try:
            pattern = re.compile(self.match) if self.match else None
        except re.error as error:
            raise AuditError(f"--match is not a valid regular expression: {error}") from None
        return KeyFilter(self.prefix, pattern)
