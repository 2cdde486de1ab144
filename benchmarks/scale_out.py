"""`--ray` throughput with 1, 2 and 4 task slots, beside the same scan in one process.

    python -m benchmarks.scale_out                          # 1,200 keys (0.84 GB), 3 runs each (~3 min on 2 cores)
    python -m benchmarks.scale_out --keys 2400 --runs 5     # the run in docs/scale-out.md (~4 min)
    python -m benchmarks.scale_out --keys 120 --runs 1      # a smoke run
    python -m benchmarks.scale_out --markdown results.md --json results.json

One embedded cluster (`audit.cluster.LocalCluster`: a master and 3 holders, TCP on loopback) holds
`--keys` mamba-130m TP 2 sized values (700,416 random bytes, one in 50 all zero). Every row runs
`audit.run.orchestrator.run_scan` as the CLI does, with a sink that discards: listing, sizing,
reading, checking and merging. The Ray rows start a local Ray instance with N CPUs (N task slots:
N shards read at once; the CPU count is logical, so 4 slots on 2 cores oversubscribe them), with
shards of about total / max(N, 3) bytes so that every slot has a shard of each holder's. Ray's own
start-up (`ray.init`, seconds) is outside the timed runs; a task's start-up (a worker process, a
store client of its own, registered buffers) is inside. Each run is verified: every key read,
exactly the zero values flagged.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

import numpy as np  # noqa: E402

from benchmarks.common import (ZERO_EVERY, BenchmarkError, Row, cpu_seconds, fmt, machine,  # noqa: E402
                               markdown_table, own_cpu_seconds, text_table)

SECTION = "scale-out"
VALUE_BYTES = 700_416         # mamba-130m at TP 2
HOLDERS = 3
SLOTS = (1, 2, 4)


class NullSink:
    def record(self, record) -> None:
        """Records are kept by the report; the benchmark writes none."""

    def finish(self, report) -> None:
        """Nothing to write."""


def _publish(settings, keys: int) -> None:
    from audit.workload import Publisher

    rng = np.random.default_rng(5)
    publisher = Publisher(settings)
    try:
        for i in range(keys):
            value = bytes(VALUE_BYTES) if i % ZERO_EVERY == 0 else rng.integers(0, 256, VALUE_BYTES, np.uint8).tobytes()
            publisher.put(f"bench/{i:06d}", value)
    finally:
        publisher.close()


def _scan(settings, keys: int, **options) -> tuple[float, dict]:
    """The wall time of run_scan, which ends with the driver's store.close() (up to a second before
    `audit.listeners`, a few hundredths since)."""
    from audit.run.orchestrator import ScanOptions, run_scan

    started = time.perf_counter()
    report = run_scan(settings, ScanOptions(prefix="bench/", **options), NullSink())
    seconds = time.perf_counter() - started
    summary = report.summary
    zeros = math.ceil(keys / ZERO_EVERY)
    if summary["keys_scanned"] != keys or summary["verdicts"] != {"ZERO_VALUE": zeros}:
        raise BenchmarkError(f"scan read {summary['keys_scanned']} of {keys} keys, verdicts {summary['verdicts']}")
    return seconds, summary


def _ray_workers() -> dict[int, float]:
    """CPU seconds so far of every Ray worker process (titled `ray::...`)."""
    workers = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/cmdline", "rb") as handle:
                    if handle.read(5) == b"ray::":
                        workers[int(entry.name)] = cpu_seconds([int(entry.name)])
            except OSError:
                continue  # ended meanwhile
    return workers


def _measure(row: Row, run, daemons: list[int], workers: list[float], wall: list[float]) -> dict:
    """One run, timed by the report's `duration_s` (listing to merged report: the scan itself);
    CPU of the driver (this process), the cluster's daemons and the Ray workers."""
    before_self, before_daemons, before_workers = own_cpu_seconds(), cpu_seconds(daemons), _ray_workers()
    seconds, summary = run()
    wall.append(seconds)
    row.seconds.append(summary["duration_s"])
    row.cpu_self.append(own_cpu_seconds() - before_self)
    row.cpu_daemons.append(cpu_seconds(daemons) - before_daemons)
    workers.append(sum(cpu - before_workers.get(pid, 0.0) for pid, cpu in _ray_workers().items()))
    return summary


def measure(keys: int, runs: int) -> tuple[list[Row], dict]:
    import ray

    from audit.cluster import LocalCluster
    from audit.connection import Settings

    total = keys * VALUE_BYTES
    rows: list[Row] = []
    placement: dict = {}
    with LocalCluster(holders=HOLDERS, segment_mb=max(256, math.ceil(total * 1.5 / HOLDERS / 2**20))) as cluster:
        settings = Settings(master=cluster.master_address, metadata=cluster.metadata_url, admin=cluster.admin_url,
                            local_hostname="127.0.0.1")
        daemons = [cluster.master.pid, *(holder.process.pid for holder in cluster.running_holders)]
        print(f"publishing {keys} values of {VALUE_BYTES:,} B on {HOLDERS} holders", file=sys.stderr)
        _publish(settings, keys)
        alone = Row(SECTION, "one process (no Ray)", keys, total)
        wall: list[float] = []
        for run in range(runs):
            print(f"one process, run {run + 1}/{runs}", file=sys.stderr)
            _measure(alone, lambda: _scan(settings, keys), daemons, [], wall)
        alone.note = f"wall s median {statistics.median(wall):.2f}"
        rows.append(alone)
        for slots in SLOTS:
            shard_mb = max(1, math.ceil(total / max(slots, HOLDERS) / 2**20))
            ray.init(num_cpus=slots, include_dashboard=False, object_store_memory=128 << 20, log_to_driver=False,
                     logging_level="WARNING")
            try:
                row = Row(SECTION, f"--ray, {slots} task slot{'s' * (slots > 1)}", keys, total)
                workers: list[float] = []
                wall = []
                for run in range(runs):
                    print(f"ray, {slots} slots, run {run + 1}/{runs}", file=sys.stderr)
                    summary = _measure(row, lambda: _scan(settings, keys, ray="local", shard_mb=shard_mb), daemons,
                                       workers, wall)
                placement[slots] = summary["ray"]
                row.note = (f"wall s median {statistics.median(wall):.2f}; {summary['ray']['shards']} shards of "
                            f"<= {shard_mb} MiB; Ray workers {sum(workers) / sum(row.seconds):.2f} cores")
                rows.append(row)
            finally:
                ray.shutdown()
    return rows, placement


HEADER = ["measurement", "runs", "s min", "s median", "s max", "GB/s median", "GB/s per slot (median)", "note",
          "cores busy"]


def table(rows: list[Row], slots: list[int]) -> list[list[str]]:
    return [[row.name, str(len(row.seconds)), fmt(row.best), fmt(row.median), fmt(row.worst),
             fmt(row.gbps(row.median)), fmt(row.gbps(row.median) / n), row.note, row.cpu_note()]
            for row, n in zip(rows, slots)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=1200)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--markdown", help="also write the table here")
    parser.add_argument("--json", help="also write the rows and the machine here")
    args = parser.parse_args(argv)
    facts = machine()
    rows, placement = measure(args.keys, args.runs)
    facts["loadavg_end"] = os.getloadavg()
    lines = table(rows, [1, *SLOTS])
    print(text_table(HEADER, lines))
    print(json.dumps({"machine": facts, "ray": placement}, indent=1))
    if args.markdown:
        with open(args.markdown, "w") as handle:
            handle.write(markdown_table(HEADER, lines) + "\n")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"machine": facts, "ray": placement,
                       "rows": [{"name": row.name, "keys": row.keys, "bytes": row.nbytes, "seconds": row.seconds,
                                 "cpu_self": row.cpu_self, "cpu_daemons": row.cpu_daemons, "note": row.note}
                                for row in rows]}, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
