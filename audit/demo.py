"""`mooncake-audit demo`: the first thing a new user runs.

Starts an embedded cluster, publishes a small vLLM-style workload with a few all-zero values,
scans it exactly as `scan` would scan a live cluster, prints the report, stops the cluster.
"""

from __future__ import annotations

from collections.abc import Callable

from audit.cluster import ClusterError, LocalCluster
from audit.connection import Settings
from audit.errors import AuditError
from audit.orchestrator import ScanOptions, run_scan
from audit.progress import ScanProgress
from audit.records import Report
from audit.workload import Publisher, vllm_demo_workload


def run_demo(sink, progress: ScanProgress, log: Callable[[str], None]) -> Report:
    log("starting an embedded Mooncake cluster on 127.0.0.1 (master + 1 holder)...")
    try:
        with LocalCluster(holders=1, segment_mb=256) as cluster:
            settings = Settings(master=cluster.master_address, metadata=cluster.metadata_url,
                                admin=cluster.admin_url, local_hostname="127.0.0.1")
            publisher = Publisher(settings)
            try:
                workload = list(vllm_demo_workload())
                publisher.put_many((key, value) for key, value, _ in workload)
            finally:
                publisher.close()
            zeros = sum(1 for *_, zero in workload if zero)
            log(f"published {len(workload)} vLLM-style keys ({zeros} all-zero); scanning...")
            return run_scan(settings, ScanOptions(), sink, progress)
    except ClusterError as error:
        raise AuditError(str(error)) from None
