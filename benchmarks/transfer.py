"""Sections 1-3: fetch-only ceiling, the scan (core and full run), the naive get+sha256 loop.

Each workload gets its own embedded cluster (one holder whose segment holds the workload with
headroom: a nearly full segment evicts silently), published with `batch_put_from` from a
registered buffer. The methods are then timed in alternating rounds, each round starting with a
different method, so drift (other jobs on the machine, page cache, leases) spreads evenly.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from contextlib import nullcontext
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from audit.blocktables import read_block_tables
from audit.checks.host import HostChecker
from audit.cluster import LocalCluster
from audit.connection import AdminClient, Settings, open_store
from audit.readers.buffers import ALIGNMENT, RegisteredBuffer, plan_batches
from audit.readers.lease import LeaseReader
from audit.keys import vllm_key
from audit.layouts import Layout, layouts_from_hf_config
from audit.run.orchestrator import ScanOptions, run_scan
from audit.judge.plan import CheckPlan
from audit.records import Verdict
from audit.run.scan import check_batch, scan_keys
from audit.sources.listing import AdminListing, KeyFilter
from benchmarks.common import (MAMBA_130M, MAMBA_130M_NAME, TINY_4K, TINY_4K_NAME, ZERO_EVERY, BenchmarkError, Row,
                               cpu_seconds, own_cpu_seconds, stamp, state_like, timed)
from benchmarks.reference_checker import ReferenceChecker

PUT_BUFFER_BYTES = 64 << 20
PUT_MAX_KEYS = 1000          # like reads, TCP batches above ~1,000 keys per peer overflow a queue


@dataclass(frozen=True)
class Workload:
    name: str
    model: str
    config: dict
    tp_size: int
    count: int

    @property
    def layout(self) -> Layout:
        return layouts_from_hf_config(self.config, model=self.model, tp_size=self.tp_size)[0]

    @property
    def prefix(self) -> str:
        return f"bench-{self.name}@"

    def key(self, index: int) -> str:
        chunk, rank = divmod(index, self.tp_size)  # TP ranks of one chunk share its hash
        chunk_hash = f"{(chunk * 0x9E3779B97F4A7C15) & (2**64 - 1):016x}{chunk:016x}"
        return vllm_key(self.model, chunk_hash, tp_rank=rank, cache_prefix=self.prefix[:-1])

    @staticmethod
    def is_zero(index: int) -> bool:
        return index % ZERO_EVERY == ZERO_EVERY - 1


def workloads(sizes) -> list[Workload]:
    return [
        Workload("tp2", MAMBA_130M_NAME, MAMBA_130M, 2, sizes.tp2_keys),
        Workload("tp1", MAMBA_130M_NAME, MAMBA_130M, 1, sizes.tp1_keys),
        Workload("4k", TINY_4K_NAME, TINY_4K, 1, sizes.small_keys),
    ]


def segment_mb(count: int, value_bytes: int) -> int:
    return int(count * (value_bytes + ALIGNMENT) * 1.3 / (1 << 20)) + 64


def scan_buffer_bytes(keys, buffer_mb: int = 256) -> int:
    """The read buffers run_scan registers by default (`--buffer-mb 256`: two halves, each no
    larger than the whole scan), so fetch-only and the scan core read in the same batches."""
    total = sum(ALIGNMENT + (key.size or 0) for key in keys)
    return 2 * min(buffer_mb << 19, max(total, ALIGNMENT))


def settings_of(cluster: LocalCluster) -> Settings:
    return Settings(master=cluster.master_address, metadata=cluster.metadata_url, admin=cluster.admin_url,
                    local_hostname="127.0.0.1")


def publish(store, workload: Workload, seed: int = 0) -> None:
    """Every key of the workload, in batches of `batch_put_from` from one registered buffer."""
    size = workload.layout.size
    per_batch = max(1, min(PUT_MAX_KEYS, PUT_BUFFER_BYTES // size, workload.count))
    buffer = RegisteredBuffer(store, per_batch * size)
    try:
        rng = np.random.default_rng(seed)
        pool = np.concatenate([state_like(rng, size) for _ in range(min(per_batch, 16))])
        for slot in range(per_batch):  # the registered buffer cycles through the pool's values
            source = slot % (pool.nbytes // size)
            buffer.array[slot * size:(slot + 1) * size] = pool[source * size:(source + 1) * size]
        base = buffer.array.ctypes.data
        for start in range(0, workload.count, per_batch):
            indices = range(start, min(start + per_batch, workload.count))
            zeroed = []
            for slot, index in enumerate(indices):
                view = buffer.array[slot * size:(slot + 1) * size]
                if workload.is_zero(index):
                    view[:] = 0
                    zeroed.append(slot)
                else:
                    stamp(view, index)
            keys = [workload.key(index) for index in indices]
            codes = store.batch_put_from(keys, [base + slot * size for slot in range(len(keys))],
                                         [size] * len(keys))
            failed = [code for code in codes if code != 0]
            if failed:
                raise BenchmarkError(f"publishing {workload.name}: {len(failed)} puts failed (first {failed[0]})")
            for slot in zeroed:
                source = slot % (pool.nbytes // size)
                buffer.array[slot * size:(slot + 1) * size] = pool[source * size:(source + 1) * size]
    finally:
        buffer.release()


def write_block_tables(workload: Workload, directory: Path) -> Path:
    """The producer's block table: zero values came from NULL_BLOCK_ID (0), the rest from real blocks."""
    path = directory / f"{workload.name}.jsonl"
    with open(path, "w") as handle:
        for index in range(workload.count):
            block = 0 if workload.is_zero(index) else index + 1
            handle.write(json.dumps({"key": workload.key(index), "block_id": block}) + "\n")
    return path


class NullSink:
    """A report sink that discards: the output format is not what is measured."""

    def record(self, record) -> None:
        """Discarded."""

    def finish(self, report) -> None:
        """Discarded: the benchmark reads the report `run_scan` returns."""


def _expect(condition: bool, message: str) -> None:
    if not condition:
        raise BenchmarkError(message)


def own_cluster(shared: LocalCluster | None, nbytes_mb: int):
    """The shared cluster when given (quick runs), else a cluster of this section's own."""
    return nullcontext(shared) if shared is not None else LocalCluster(holders=1, segment_mb=nbytes_mb)


def run_workload(workload: Workload, runs: int, log: Callable[[str], None], fixed_costs: bool = False,
                 cluster: LocalCluster | None = None) -> list[Row]:
    layout = workload.layout
    size = layout.size
    total = workload.count * size
    zeros = sum(1 for index in range(workload.count) if workload.is_zero(index))
    with own_cluster(cluster, segment_mb(workload.count, size)) as cluster, \
            tempfile.TemporaryDirectory(prefix="mooncake-bench-") as scratch:
        settings = settings_of(cluster)
        # One store client publishes (as a producer would) and then reads (as the auditor).
        store = open_store(settings)
        seconds, _ = timed(lambda: publish(store, workload))
        log(f"  published {workload.count:,} x {size:,} B in {seconds:.1f} s "
            f"({total / seconds / 1e9:.2f} GB/s)")
        tables_path = write_block_tables(workload, Path(scratch))
        admin = AdminClient(settings.admin)
        listing = AdminListing(admin, KeyFilter(workload.prefix)).list()
        keys = sorted(listing.keys, key=lambda info: info.name)
        _expect(len(keys) == workload.count and not listing.vanished,
                f"{workload.name}: {len(keys)} of {workload.count} keys listed (evicted? segment too small)")
        names = [key.name for key in keys]
        reader = LeaseReader(store, scan_buffer_bytes(keys))
        batches = list(plan_batches(keys, reader.capacity))
        checker = HostChecker()
        plan_core = CheckPlan(layouts=[layout], tables=read_block_tables([tables_path]))
        zero_sha = {size: hashlib.sha256(bytes(size)).digest()}
        # Zero values are null-backed zero states; every other value is clean.
        expected = Counter({Verdict.ZERO_STATE: zeros, Verdict.NULL_BACKED: zeros}) if zeros else Counter()

        def fetch_only():
            failed = 0
            for turn, batch in enumerate(batches):
                fetched = reader.fetch(batch, turn)
                failed += sum(1 for code, slot in zip(fetched.results, batch) if code != slot.key.size)
                fetched.release()
            _expect(failed == 0, f"fetch-only: {failed} reads failed")

        def scan_core(with_checker=checker):
            records = list(scan_keys(keys, reader, with_checker, plan_core))
            verdicts = Counter(verdict for record in records for verdict in record.verdicts)
            _expect(len(records) == workload.count and verdicts == expected,
                    f"scan core: {len(records)} records, verdicts {dict(verdicts)} (expected {dict(expected)})")

        def serial():
            """The scan core's work without its overlap: fetch a batch, then check it."""
            records = []
            for turn, batch in enumerate(batches):
                records += check_batch(reader.fetch(batch, turn), checker, plan_core)
            _expect(len(records) == workload.count, f"serial: {len(records)} records")

        def scan_full():
            plan = CheckPlan(layouts=[layout], tables=read_block_tables([tables_path]))
            report = run_scan(settings, ScanOptions(prefix=workload.prefix, plan=plan), NullSink())
            _expect(report.summary["keys_scanned"] == workload.count
                    and Counter(report.summary["verdicts"]) == expected and report.summary["findings"] == zeros,
                    f"run_scan: verdicts {report.summary['verdicts']} (expected {dict(expected)})")

        def naive():
            found = 0
            for name in names:
                value = store.get(name)
                digest = hashlib.sha256(value).digest()
                if digest == zero_sha.get(len(value)):
                    found += 1
            _expect(found == zeros, f"naive: {found} zero values (expected {zeros})")

        methods = [
            ("fetch-only: batch_get_into, no checks", fetch_only),
            ("scan core: scan_keys + layout + tables", scan_core),
            ("scan full: run_scan (open, list, scan, merge)", scan_full),
            ("naive: get() + sha256 per key", naive),
            ("before: scan core, checker as of cf1bf69", lambda: scan_core(ReferenceChecker())),
            ("serial: fetch, then check, batch by batch (no overlap)", serial),
        ]
        rows = [Row(f"transfer {workload.name}", name, workload.count, total) for name, _ in methods]
        daemons = [cluster.master.pid, *(holder.process.pid for holder in cluster.running_holders)]
        try:
            for turn in range(runs):
                for offset in range(len(methods)):
                    which = (turn + offset) % len(methods)
                    mine, theirs = own_cpu_seconds(), cpu_seconds(daemons)
                    seconds, _ = timed(methods[which][1])
                    rows[which].seconds.append(seconds)
                    rows[which].cpu_self.append(own_cpu_seconds() - mine)
                    rows[which].cpu_daemons.append(cpu_seconds(daemons) - theirs)
                log(f"  round {turn + 1}/{runs}: " + ", ".join(
                    f"{row.name.split(':')[0]} {row.seconds[-1]:.2f}s" for row in rows))
            probe = gil_probe(f"transfer {workload.name}", fetch_only, workload.count, total,
                              min(runs, 3)) if fixed_costs else None
        finally:
            reader.close()
            store.close()
        rows[2].note = "block tables read, store opened, keys listed, store closed: all timed"
        rows.append(scan_in_subprocess(settings, workload, tables_path))
        if fixed_costs:
            rows.append(probe)
            rows.append(Row("transfer fixed costs", "open_store() + store.close() (part of scan full)", 0, 0,
                            [timed(lambda: open_store(settings).close())[0] for _ in range(min(runs, 3))]))
        return rows


def _spin(until: Callable[[], bool]) -> tuple[int, float]:
    count, started = 0, time.perf_counter()
    while not until():
        count += 1
    return count, time.perf_counter() - started


def gil_probe(section: str, fetch_only: Callable[[], None], keys: int, nbytes: int, runs: int) -> Row:
    """Does the fetch leave the interpreter to the checking thread? fetch-only runs in a thread
    while the main thread counts loop turns; its rate is compared with its rate alone."""
    row = Row(section, "GIL probe: fetch-only in a thread while the main thread spins", keys, nbytes)
    shares = []
    for _ in range(runs):
        deadline = time.perf_counter() + 0.3
        alone, alone_s = _spin(lambda: time.perf_counter() >= deadline)
        worker = threading.Thread(target=fetch_only)
        started = time.perf_counter()
        worker.start()
        during, during_s = _spin(lambda: not worker.is_alive())
        worker.join()
        row.seconds.append(time.perf_counter() - started)
        shares.append((during / during_s) / (alone / alone_s))
    row.note = (f"main thread kept {statistics.median(shares):.2f} of its solo loop rate "
                f"(batch_get_into releases the GIL; below 1.0 = cores shared)")
    return row


def run_worker(command: list[str]) -> dict:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-15:])
        raise BenchmarkError(f"{' '.join(command[1:4])} exited {done.returncode}:\n{tail}")
    return json.loads(done.stdout)


def scan_in_subprocess(settings: Settings, workload: Workload, tables_path: Path) -> Row:
    """One run_scan in a fresh interpreter: its peak RSS is the auditor's alone."""
    command = [sys.executable, "-m", "benchmarks.worker", "scan", "--master", settings.master,
               "--metadata", settings.metadata, "--admin", settings.admin, "--prefix", workload.prefix,
               "--config", json.dumps(workload.config), "--model", workload.model,
               "--tp", str(workload.tp_size), "--tables", str(tables_path)]
    result = run_worker(command)
    _expect(result["keys_scanned"] == workload.count, f"worker scan: {result}")
    size = workload.layout.size
    return Row(f"transfer {workload.name}", "scan full, fresh process (peak RSS)", workload.count,
               workload.count * size, [result["seconds"]], rss_mib=result["rss_peak_mib"],
               note=f"RSS after imports {result['rss_start_mib']:.0f} MiB")
