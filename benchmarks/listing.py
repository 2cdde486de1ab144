"""Section 5: enumeration at scale. Many small vLLM-style keys are published with
`batch_put_from`; the auditor (a fresh process, `benchmarks.worker list`) lists, parses and sizes
them through `AdminListing` (`/get_all_keys` + lease-free `/batch_query_keys`) several times."""

from __future__ import annotations

import sys
from collections.abc import Callable

from audit.cluster import LocalCluster
from audit.connection import open_store
from audit.readers.buffers import RegisteredBuffer
from audit.keys import vllm_key
from benchmarks.common import MAMBA_130M_NAME, BenchmarkError, Row, timed
from benchmarks.transfer import PUT_MAX_KEYS, own_cluster, run_worker, settings_of

VALUE_BYTES = 64
PREFIX = "bench-enum@"


def _key(index: int) -> str:
    chunk, rank = divmod(index, 2)
    chunk_hash = f"{(chunk * 0x9E3779B97F4A7C15) & (2**64 - 1):016x}{chunk:016x}"
    return vllm_key(MAMBA_130M_NAME, chunk_hash, tp_rank=rank, cache_prefix=PREFIX[:-1])


def publish(settings, count: int) -> None:
    store = open_store(settings)
    buffer = RegisteredBuffer(store, PUT_MAX_KEYS * VALUE_BYTES)
    try:
        buffer.array[:] = 0x3C  # non-zero bytes: the listing does not read values anyway
        base = buffer.array.ctypes.data
        for start in range(0, count, PUT_MAX_KEYS):
            keys = [_key(index) for index in range(start, min(start + PUT_MAX_KEYS, count))]
            codes = store.batch_put_from(keys, [base + slot * VALUE_BYTES for slot in range(len(keys))],
                                         [VALUE_BYTES] * len(keys))
            failed = [code for code in codes if code != 0]
            if failed:
                raise BenchmarkError(f"publishing listing keys: {len(failed)} puts failed (first {failed[0]})")
    finally:
        buffer.release()
        store.close()


def segment_mb(count: int) -> int:
    # Per-object overhead in the holder's allocator dwarfs 64 bytes: leave plenty of room.
    return max(256, count * 1024 // (1 << 20) + 64)


def run_listing(count: int, runs: int, log: Callable[[str], None], cluster: LocalCluster | None = None) -> list[Row]:
    with own_cluster(cluster, segment_mb(count)) as cluster:
        settings = settings_of(cluster)
        seconds, _ = timed(lambda: publish(settings, count))
        log(f"  published {count:,} keys of {VALUE_BYTES} B in {seconds:.1f} s ({count / seconds:,.0f} keys/s)")
        command = [sys.executable, "-m", "benchmarks.worker", "list", "--admin", settings.admin,
                   "--prefix", PREFIX, "--runs", str(runs), "--value-bytes", str(VALUE_BYTES)]
        result = run_worker(command)
        if result["keys"] != count:
            raise BenchmarkError(f"listing found {result['keys']} of {count} keys (evicted? segment too small)")
        log("  listing runs: " + ", ".join(f"{s:.2f}s" for s in result["seconds"]))
        return [Row("enumeration", "AdminListing.list(): list, filter, size (own process)", count, 0,
                    result["seconds"], rss_mib=result["rss_peak_mib"],
                    note=f"RSS after imports {result['rss_start_mib']:.0f} MiB; {result['lines']:,} lines listed"),
                Row("enumeration", "parse every listed key (parse_key), same process", count, 0,
                    result["parse_seconds"], note="timed apart from list(), which may defer parsing")]
