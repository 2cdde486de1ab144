"""The disk tier's read rate, whole process (issue #41): `check --read-mode peek --offload-dir DIR`
on a store whose keys are all disk-only, against `cat` reading the same bucket files raw on the same
host, run in turn (A B, B A, ...), each timed from spawn to reaped exit.

    python -m benchmarks.disk_tier [--keys 1024] [--value-kib 1024] [--bucket-keys 1] [--runs 5]
                                   [--cold] [--segment-mb N] [--both-tiers]

The store: one `LocalCluster` holder offloading eagerly (bucket backend, `--bucket-keys` per bucket),
`--keys` values put (one in 50 all zero) and waited for on disk; then the holder restarts, and at
start-up registers every key from its buckets: every key is disk-only, its bytes only in the files.
Rates are bytes per wall second: the values' bytes for `check`, the bucket files' for `cat` (the
stored keys too); the ratio is check's rate over cat's, pair by pair, and its median is quoted. The
page cache holds the files for both (the warm-up reads them), so this is the read path's cost, not
the SSD's. Every `check` report is verified: every key read from its bucket file, exactly the zero
values flagged.

`--both-tiers` keeps every key in memory too (no restart): `check` then reads memory (peek) and reads
and compares every key's disk copy from its bucket file, and a third arm, the same `check` without
`--offload-dir`, reads memory alone; the disk copies' cost is the difference between the two.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

from audit.cluster import LocalCluster  # noqa: E402
from audit.connection import Settings, open_store  # noqa: E402
from benchmarks.common import machine, text_table  # noqa: E402
from benchmarks.paired import ROOT, checkout_before, child_env, connection_flags, run  # noqa: E402

PREFIX = "disk-tier/"
FILLER_PREFIX = "disk-tier-filler/"  # completes the last bucket when a bucket holds several keys
ZERO_EVERY = 50
PUT_RETRY_S = 0.05
NO_SPACE = -200
PART_BYTES = 32 << 20  # put between waits for the disk: faster, the holder's 64 MiB staging buffer drops offloads


def build_store(cluster: LocalCluster, keys: int, value_bytes: int, bucket_keys: int = 1,
                both_tiers: bool = False) -> set[str]:
    """`keys` values put on the holder, a part at a time, each part waited for on disk (put back to
    back, 1,024 values of 1 MiB left 825 MB on disk and the rest never offloaded), then the holder
    restarted: every key disk-only. The zero keys' names.

    The holder writes a bucket only once `bucket_keys` keys wait for one (fewer wait in its ungrouped
    pool for the next put), so up to `bucket_keys - 1` keys of a part may wait for the next part, and
    the last ones for a few tiny filler keys (outside `PREFIX`, so no check reads them)."""
    settings = Settings(master=cluster.master_address, metadata=cluster.metadata_url, admin=cluster.admin_url,
                        local_hostname="127.0.0.1")
    store = open_store(settings)
    names, zero = [f"{PREFIX}{index:06d}" for index in range(keys)], set()
    part = max(PART_BYTES // value_bytes, 1)
    try:
        for first in range(0, keys, part):
            for index in range(first, min(first + part, keys)):
                value = bytes(value_bytes) if index % ZERO_EVERY == 0 else os.urandom(value_bytes)
                while (code := store.put(names[index], value)) == NO_SPACE:
                    time.sleep(PUT_RETRY_S)
                if code != 0:
                    raise RuntimeError(f"put {names[index]}: {code}")
                if index % ZERO_EVERY == 0:
                    zero.add(names[index])
            put = names[:first + part]
            _wait_on_disk(cluster, put, len(put) - (bucket_keys - 1))
        if bucket_keys > 1:
            for index in range(bucket_keys - 1):
                if store.put(f"{FILLER_PREFIX}{index:06d}", b"f") != 0:
                    raise RuntimeError(f"put filler {index}")
            cluster.wait_held(names, "local_disk", timeout_s=60)
    finally:
        store.close()
    expected = {"memory", "local_disk"} if both_tiers else {"local_disk"}
    if not both_tiers:
        cluster.restart_holder(cluster.running_holders[0], timeout_s=120)
    cluster.wait_held(names, "local_disk", timeout_s=120)
    tiers = cluster.tiers(names)
    if tiers != {name: expected for name in names}:
        raise RuntimeError(f"{sum(held != expected for held in tiers.values())} keys not in {sorted(expected)}")
    return zero


def _wait_on_disk(cluster: LocalCluster, names: list[str], count: int, timeout_s: float = 60) -> None:
    """Until at least `count` keys of `names` have a replica on the holder's disk."""
    deadline = time.monotonic() + timeout_s
    while (found := sum("local_disk" in held for held in cluster.tiers(names).values())) < count:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{found} of {len(names)} keys on disk after {timeout_s} s, not {count}")
        time.sleep(0.1)


def dropped_from_cache(paths: list[str]) -> int:
    """The files' pages dropped from the page cache (written back first: the kernel drops clean pages
    only); the bytes still resident after, by `fincore` (-1 where it is not installed)."""
    for path in paths:
        descriptor = os.open(path, os.O_RDONLY)
        try:
            os.fsync(descriptor)
            os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(descriptor)
    if shutil.which("fincore") is None:
        return -1
    resident = subprocess.run(["fincore", "--bytes", "--noheadings", "--raw", "--output", "RES", *paths],
                              capture_output=True, text=True, check=True).stdout.split()
    return sum(int(size) for size in resident)


def verified(report: Path, keys: int, zero: set[str], offload_dir: Path | None, both_tiers: bool = False) -> None:
    """The check read every key from its bucket file (both tiers: every key's disk copy compared, or
    with no `offload_dir` none) and flagged exactly the zero values."""
    document = json.loads(report.read_text())
    summary = document["summary"]
    flagged = {record["key"] for record in document["findings"]}
    if both_tiers:
        compared = summary.get("offload", {}).get("disk_copies_compared", 0)
        from_files = compared == (keys if offload_dir is not None else 0)
    else:
        from_files = all(row["file"].startswith(str(offload_dir)) for record in document["keys"]
                         for row in record["evidence"]["replicas"])
    if summary["keys_scanned"] != keys or flagged != zero or summary["verdicts"] != {"ZERO_VALUE": len(zero)} \
            or not from_files:
        raise RuntimeError(f"check's report is not the store's: {summary['keys_scanned']} keys, {len(flagged)} flagged")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.disk_tier", description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=1024)
    parser.add_argument("--value-kib", type=int, default=1024)
    parser.add_argument("--bucket-keys", type=int, default=1,
                        help="keys per bucket (Mooncake's default: up to 500 or 256 MiB; 1 and 32 tried here)")
    parser.add_argument("--cold", action="store_true",
                        help="drop the bucket files from the page cache before every process: both read the device")
    parser.add_argument("--segment-mb", type=int,
                        help="the holder's segment (default: twice the store); smaller builds a store larger than memory")
    parser.add_argument("--before", action="store_true",
                        help="also run HEAD's check (exported with git archive) in turn on the same store")
    parser.add_argument("--both-tiers", action="store_true",
                        help="keep every key in memory too: check compares each disk copy (and a memory-only arm)")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--output", type=Path, help="also write the results here (JSON)")
    args = parser.parse_args(argv)
    value_bytes = args.value_kib << 10
    segment_mb = args.segment_mb or 2 * (args.keys * value_bytes >> 20) + 256
    with tempfile.TemporaryDirectory(prefix="disk-tier-") as scratch, \
            LocalCluster(holders=1, segment_mb=segment_mb, offload=True, bucket_keys=args.bucket_keys,
                         client_ttl_s=3, log_dir=Path(scratch)) as cluster:
        started = time.perf_counter()
        zero = build_store(cluster, args.keys, value_bytes, args.bucket_keys, args.both_tiers)
        print(f"store: {args.keys} disk-only keys of {args.value_kib} KiB in {time.perf_counter() - started:.0f} s",
              file=sys.stderr)
        offload_dir = cluster.running_holders[0].offload_dir
        buckets = sorted(str(path) for path in offload_dir.glob("*.bucket"))
        bucket_bytes = sum(os.path.getsize(path) for path in buckets)
        report = Path(scratch) / "check.json"
        check = [sys.executable, "-m", "cli", "check", *connection_flags(cluster), "--local-hostname", "127.0.0.1",
                 "--prefix", PREFIX, "--read-mode", "peek", "--offload-dir", str(offload_dir), "--all",
                 "--format", "json", "--output", str(report), "--no-progress", "--verbose"]
        arms = {"check": (check, ROOT), "cat": (["cat", *buckets], ROOT)}
        if args.both_tiers:
            at = check.index("--offload-dir")
            arms["check, memory only"] = (check[:at] + check[at + 2:], ROOT)
        if args.before:
            arms["check, before"] = (check, checkout_before(None, Path(scratch)))
        env = child_env()
        walls: dict[str, list[float]] = {name: [] for name in arms}
        resident: list[int] = []
        phases = ""
        for turn in range(args.warmup + args.runs):
            order = list(arms) if turn % 2 == 0 else list(reversed(arms))
            for name in order:
                command, cwd = arms[name]
                if args.cold:
                    resident.append(dropped_from_cache(buckets))
                result = run(command, env, cwd)
                if name.startswith("check"):
                    verified(report, args.keys, zero, None if name == "check, memory only" else offload_dir,
                             args.both_tiers)
                if name == "check":
                    phases = result["stderr"]
                if turn >= args.warmup:
                    walls[name].append(result["wall"])
    value_total = args.keys * value_bytes
    rates = {name: [(bucket_bytes if name == "cat" else value_total) / wall for wall in walls[name]] for name in walls}
    ratios = [check / cat for check, cat in zip(rates["check"], rates["cat"])]
    lines = [[name, f"{statistics.median(walls[name]):.3f}", f"{min(walls[name]):.3f}", f"{max(walls[name]):.3f}",
              f"{statistics.median(rates[name]) / 1e9:.2f}"] for name in walls]
    print(text_table(["process", "wall s (median)", "min", "max", "GB/s (median)"], lines))
    print(f"check / cat read rate, pair by pair: median {statistics.median(ratios):.3f} "
          f"(min {min(ratios):.3f}, max {max(ratios):.3f}); goal 0.9")
    if args.before:
        before = [old / cat for old, cat in zip(rates["check, before"], rates["cat"])]
        print(f"HEAD's check / cat: median {statistics.median(before):.3f} (min {min(before):.3f}, max {max(before):.3f})")
    if args.both_tiers:
        costs = [with_disk - memory for with_disk, memory in zip(walls["check"], walls["check, memory only"])]
        compared = [(value_total / cost) / (bucket_bytes / cat) if cost > 0 else float("inf")
                    for cost, cat in zip(costs, walls["cat"])]
        print(f"the disk copies' cost (check - memory only), pair by pair: median {statistics.median(costs):.3f} s; "
              f"its read rate / cat's: median {statistics.median(compared):.3f} "
              f"(min {min(compared):.3f}, max {max(compared):.3f})")
    if args.cold:
        print(f"bucket bytes left in the page cache before a process: at most {max(resident)} of {bucket_bytes}")
    print("check --verbose, last run:\n" + "\n".join(line for line in phases.splitlines() if "s " in line or ":" in line))
    if args.output:
        args.output.write_text(json.dumps({"machine": machine(), "keys": args.keys, "value_bytes": value_bytes,
                                           "bucket_keys": args.bucket_keys, "bucket_bytes": bucket_bytes,
                                           "cold": args.cold, "segment_mb": segment_mb, "resident_before": resident,
                                           "walls": walls, "ratios": ratios, "check_stderr": phases}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
