"""`mooncake-audit demo`: the first thing a new user runs.

Starts an embedded cluster, publishes what a vLLM producer with bug #53084 would have published
for state-spaces/mamba-130m-hf at TP 2 (real Mamba states, align-mode block tables with
null-backed boundaries such as 2112 tokens), scans it exactly as `scan` scans a live cluster with
the model's layout and the producer's block tables, prints the report, stops the cluster.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from audit.blocktables import read_block_tables
from audit.cluster import ClusterError, LocalCluster
from audit.connection import Settings
from audit.errors import AuditError
from audit.run.orchestrator import ScanOptions, run_scan
from audit.judge.plan import CheckPlan
from audit.run.progress import ScanProgress
from audit.records import Report
from audit.simulate import MAMBA_130M, SimulationOptions, simulate

DEMO_WORKLOAD = SimulationOptions(requests=2, tokens=2200, block_size=176, tp_size=2, seed=0,
                                  null_boundaries=(2112,))


@dataclass
class DemoResult:
    report: Report
    exact: bool   # the scan flagged exactly the keys the simulator made bad
    score: str


def _score(report: Report, labels) -> DemoResult:
    flagged = {record.key for record in report.records if record.is_finding}
    bad = {label.key for label in labels if label.expected_with_tables}
    score = (f"ground truth: {len(bad)} of {len(labels)} keys are bad; the scan flagged {len(flagged)}, "
             f"{len(flagged & bad)} of them bad (precision {len(flagged & bad) / max(len(flagged), 1):.2f}, "
             f"recall {len(flagged & bad) / max(len(bad), 1):.2f})")
    return DemoResult(report, flagged == bad and report.summary["complete"], score)


def run_demo(sink, progress: ScanProgress, log: Callable[[str], None]) -> DemoResult:
    """The scan's report, and whether it found exactly the planted bad keys."""
    log("starting an embedded Mooncake cluster on 127.0.0.1 (master + 1 holder)...")
    try:
        with LocalCluster(holders=1, segment_mb=256) as cluster, tempfile.TemporaryDirectory() as work:
            settings = Settings(master=cluster.master_address, metadata=cluster.metadata_url,
                                admin=cluster.admin_url, local_hostname="127.0.0.1")
            log("simulating vLLM + MooncakeStoreConnector with bug #53084: mamba-130m-hf, TP 2, "
                "2 requests x 2200 tokens, real Mamba states...")
            result = simulate(settings, model_config=MAMBA_130M, model="mamba-130m-hf", out_dir=work,
                              options=DEMO_WORKLOAD)
            log(f"published {len(result.labels)} keys of {result.layout.size:,} bytes; "
                f"scanning with the model's layout and the producer's block tables...")
            plan = CheckPlan(layouts=[result.layout], tables=read_block_tables([Path(result.block_tables_path)]))
            report = run_scan(settings, ScanOptions(plan=plan), sink, progress)
            outcome = _score(report, result.labels)
            log(outcome.score)
            return outcome
    except ClusterError as error:
        raise AuditError(str(error)) from None
