"""`mooncake-audit watch` (issue #23): time to detect a bad key, and what watching costs.

    .venv/bin/python -m benchmarks.watch_detect                       # 100,000 keys (the documented run)
    .venv/bin/python -m benchmarks.watch_detect --quick               # under a minute, a smoke run
    .venv/bin/python -m benchmarks.watch_detect --keys 100000 --samples 40 --json detect.json
    .venv/bin/python -m benchmarks.watch_detect --samples 10 --feeds restart   # the first round after a start

One `LocalCluster` (master + one holder) holds `--keys` clean vLLM-style keys (TP 1, random bytes,
`--value-bytes` each). The watcher is a whole process (`.venv/bin/mooncake-audit watch`), started on
that store, and measured only once it has verified all of it. Meanwhile a producer thread puts
`--clean-rate` clean keys a second, and the main thread, at random moments (uniform over 0 to 1.5
intervals after the last detection), puts one all-zero key and polls `/metrics` every 0.1 s until
`mooncake_audit_findings` counts it: the seconds from just before the put to that scrape are one
sample of the time to detect.

  listing feed  `watch --interval I`: the bad key is found by the listing's difference
  record feed   `watch --interval I --block-tables DIR`: the same, and DIR holds the recorder's
                records (one JSONL line per put, the shape of audit/recorder/records.py): a record
                for each of the store's keys written before the watcher starts, one for each clean
                put, and for each bad key a null-block record (`block_ids: [0]`) appended right after
                its put, as the recorder does; the key should be judged NULL_BACKED
  restart       (only when named in --feeds) `--samples` times: the watcher stopped and started again on
                the verified state (`watch --interval I`), and once its first round is over one bad key
                as above: the first listing after a start sizes every key and costs several times the
                next ones, so this times the first round after a restart (the interval that listing
                set is reported per sample, `first_interval_s`)
  cost          the same store, the watcher on the verified state again with `--period` short
                enough that every key is due, under each `--max-bandwidth`, and once with the default
                24 h period (nothing due: listing and new keys only): bytes read per second (from
                `mooncake_audit_bytes_scanned_total`) and CPU seconds per hour (utime + stime of
                /proc/<pid>/stat), over `--cost-seconds` after a warm-up

Reported with each: p50 and p99 (nearest rank) of the samples, the listing seconds and the interval
(stretched or not) the watcher's metrics show at that store size, and its RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

from audit.cluster import LocalCluster, free_port  # noqa: E402
from benchmarks.common import machine  # noqa: E402
from benchmarks.watch_harness import (Producer, WatchProcess, bad_key, clean_items, percentile,  # noqa: E402
                                      write_record)

FINDINGS = "mooncake_audit_findings"
ROUNDS = "mooncake_audit_watch_rounds_total"
WATCH_GAUGES = ("listing_seconds", "listing_seconds_median", "interval_seconds", "interval_stretched", "keys_known",
                "bytes_read_per_second", "oldest_verification_age_seconds", "listings_total", "record_rounds_total")


class CleanProducer(threading.Thread):
    """Clean keys at a steady rate, each with a record when `records` is set."""

    def __init__(self, cluster, start_index: int, rate: float, size: int):
        super().__init__(daemon=True)
        self.producer = Producer(cluster)
        self.next = start_index
        self.rate = rate
        self.size = size
        self.records: Path | None = None
        self.stopped = threading.Event()
        self.failures = 0

    def run(self) -> None:
        period = 1.0 / self.rate
        while not self.stopped.wait(period):
            items = clean_items(self.next, 1, self.size)
            self.next += 1
            self.failures += self.producer.put_many(items)
            if self.records is not None:
                write_record(self.records, items[0][0], [1 + self.next % 1000])

    def stop(self) -> None:
        self.stopped.set()
        self.join()
        self.producer.close()


def watch_gauges(metrics: dict[str, float]) -> dict[str, float | None]:
    return {name: metrics.get(f"mooncake_audit_watch_{name}") for name in WATCH_GAUGES}


def measure_feed(name: str, watcher: WatchProcess, producer: Producer, samples: int, interval: float, first_bad: int,
                 size: int, rng: random.Random, log, records: Path | None = None, timeout_s: float = 120.0) -> dict:
    """`samples` bad keys one after another; seconds from put to the scrape that shows each."""
    latencies, gauges, rounds, listings, missed = [], [], [], [], 0
    round_ends: list[tuple[float, float]] = []  # (rounds, when a scrape first showed it), while polling
    last_round = (watcher.metrics().get(ROUNDS, 0), time.perf_counter())
    found = watcher.metrics().get(FINDINGS, 0)
    for n in range(samples):
        time.sleep(rng.uniform(0, 1.5 * interval))
        key = bad_key(first_bad + n)
        before = watcher.metrics()
        rounds_before = before.get(ROUNDS, 0)
        listings_before = before.get("mooncake_audit_watch_listings_total", 0)
        put_at = time.perf_counter()
        if producer.put(key, bytes(size)) != 0:
            raise RuntimeError(f"putting {key} failed")
        if records is not None:
            write_record(records, key, [0])
        deadline = put_at + timeout_s
        while True:
            metrics = watcher.try_metrics() or {}
            if metrics.get(ROUNDS, 0) > last_round[0]:
                last_round = (metrics[ROUNDS], time.perf_counter())
                round_ends.append(last_round)
            if metrics.get(FINDINGS, 0) >= found + 1:
                latencies.append(time.perf_counter() - put_at)
                found = metrics[FINDINGS]
                gauges.append(watch_gauges(metrics))
                rounds.append(metrics.get(ROUNDS, 0) - rounds_before)
                listings.append(metrics.get("mooncake_audit_watch_listings_total", 0) - listings_before)
                break
            if time.perf_counter() > deadline:
                missed += 1
                found = metrics.get(FINDINGS, found)
                break
            time.sleep(0.1)
        log(f"  {name} {n + 1}/{samples}: {latencies[-1] if latencies else float('nan'):.2f} s "
            f"(listing {gauges[-1]['listing_seconds'] if gauges else '-'}, interval "
            f"{gauges[-1]['interval_seconds'] if gauges else '-'}, rounds {rounds[-1] if rounds else '-'})")
    metrics = watcher.metrics()
    gaps = [b[1] - a[1] for a, b in zip(round_ends, round_ends[1:]) if b[0] - a[0] == 1]  # round to round
    listing = [g["listing_seconds"] for g in gauges if g["listing_seconds"] is not None]
    intervals = [g["interval_seconds"] for g in gauges if g["interval_seconds"] is not None]
    return {
        "feed": name, "samples": len(latencies), "missed": missed, "seconds": [round(s, 3) for s in latencies],
        "rounds_to_detect": rounds,  # rounds completed between the put and the scrape that showed it
        "listings_to_detect": listings,  # listings completed in that time (0: the record round found it)
        "p50_s": percentile(latencies, 50), "p99_s": percentile(latencies, 99), "max_s": max(latencies, default=None),
        "listing_s_median": percentile(listing, 50), "listing_s_max": max(listing, default=None),
        "interval_s_median": percentile(intervals, 50), "interval_s_max": max(intervals, default=None),
        "round_gap_s_median": percentile(gaps, 50), "round_gap_s_p99": percentile(gaps, 99),
        "round_gap_s_max": max(gaps, default=None),
        "stretched_share": sum(1 for g in gauges if g["interval_stretched"]) / len(gauges) if gauges else None,
        "keys_known_end": metrics.get("mooncake_audit_watch_keys_known"),
        "null_backed_end": metrics.get("mooncake_audit_verdict_keys{severity=error,verdict=NULL_BACKED}"),
        "zero_value_end": metrics.get("mooncake_audit_verdict_keys{severity=error,verdict=ZERO_VALUE}"),
        "findings_end": metrics.get(FINDINGS), "rss_mib": watcher.rss_mib(),
    }


def measure_restarts(cluster, state_dir: Path, base: list[str], log_path: Path, producer: Producer, samples: int,
                     interval: float, first_bad: int, size: int, rng: random.Random, log) -> dict:
    """`samples` times a watcher started again on the verified state, and after its first round one bad
    key, timed as measure_feed times it."""
    latencies, first_intervals, rounds, missed = [], [], [], 0
    for n in range(samples):
        watcher = WatchProcess(cluster, state_dir, free_port(), base, log_path)
        try:
            # the round counter moves before the state's gauges and the interval are set: wait for them too
            first = watcher.wait_for(lambda m: m.get(ROUNDS, 0) >= 1 and m.get(FINDINGS, 0) >= first_bad + n
                                     and m.get("mooncake_audit_watch_interval_seconds", 0) > 0, 600,
                                     "the first round after a start")
            first_intervals.append(first.get("mooncake_audit_watch_interval_seconds"))
            one = measure_feed(f"restart {n + 1}/{samples}, 1st sample", watcher, producer, 1, interval,
                               first_bad + n, size, rng, log)
        finally:
            watcher.stop()
        latencies += one["seconds"]
        rounds += one["rounds_to_detect"]
        missed += one["missed"]
    return {"feed": "restart", "samples": len(latencies), "missed": missed, "seconds": latencies,
            "rounds_to_detect": rounds, "first_interval_s": first_intervals,  # the interval after each first round
            "p50_s": percentile(latencies, 50), "p99_s": percentile(latencies, 99),
            "max_s": max(latencies, default=None)}


def measure_cost(name: str, watcher: WatchProcess, warmup_s: float, seconds: float, log) -> dict:
    time.sleep(warmup_s)
    first, cpu0, t0 = watcher.metrics(), watcher.cpu_seconds(), time.monotonic()
    time.sleep(seconds)
    last, cpu1, t1 = watcher.metrics(), watcher.cpu_seconds(), time.monotonic()
    elapsed = t1 - t0
    read = last["mooncake_audit_bytes_scanned_total"] - first["mooncake_audit_bytes_scanned_total"]
    result = {"setting": name, "seconds": round(elapsed, 1), "bytes_read_per_s": read / elapsed,
              "cpu_s_per_hour": (cpu1 - cpu0) / elapsed * 3600, "cores_busy": (cpu1 - cpu0) / elapsed,
              "rounds": last["mooncake_audit_watch_rounds_total"] - first["mooncake_audit_watch_rounds_total"],
              "rss_mib": watcher.rss_mib(), **watch_gauges(last)}
    log(f"  cost {name}: {result['bytes_read_per_s'] / 1e3:.1f} kB/s read, {result['cpu_s_per_hour']:.0f} CPU s/h, "
        f"listing {result['listing_seconds']}, interval {result['interval_seconds']}")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.watch_detect", description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=100_000)
    parser.add_argument("--value-bytes", type=int, default=1024)
    parser.add_argument("--samples", type=int, default=30, help="bad keys per feed")
    parser.add_argument("--interval", type=float, default=5.0, help="the watcher's --interval (its default: 5)")
    parser.add_argument("--clean-rate", type=float, default=20.0, help="clean puts per second meanwhile")
    parser.add_argument("--bandwidths", default="262144,1048576", help="--max-bandwidth settings of the cost runs")
    parser.add_argument("--cost-seconds", type=float, default=120.0)
    parser.add_argument("--feeds", default="listing,records,cost")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 5,000 keys, 3 samples, 2 s interval")
    parser.add_argument("--json", default=None)
    parser.add_argument("--seed", type=int, default=23)
    args = parser.parse_args(argv)
    if args.quick:
        args.keys, args.samples, args.interval, args.cost_seconds = min(args.keys, 5000), 3, 2.0, 5.0
    rng = random.Random(args.seed)
    feeds = set(args.feeds.split(","))

    def log(message: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)

    command = "python -m benchmarks.watch_detect " + " ".join(argv if argv is not None else sys.argv[1:])
    result: dict = {"command": command.strip(), "machine": machine(), "options": vars(args),
                    "started": datetime.now(timezone.utc).isoformat(), "feeds": [], "cost": []}
    scratch = Path(tempfile.mkdtemp(prefix="watch-detect-"))
    (scratch / "cluster").mkdir()
    state_dir, tables = scratch / "state", scratch / "tables"
    tables.mkdir()
    segment_mb = int(args.keys * (args.value_bytes + 1024) * 1.5 / (1 << 20)) + 256
    base = ["--interval", f"{args.interval:g}"]
    with LocalCluster(holders=1, segment_mb=segment_mb, log_dir=scratch / "cluster") as cluster:
        producer = Producer(cluster)
        started = time.perf_counter()
        with open(tables / "blocks-initial.jsonl", "w", encoding="utf-8") as records:
            for start in range(0, args.keys, 10_000):
                items = clean_items(start, min(10_000, args.keys - start), args.value_bytes)
                if producer.put_many(items):
                    raise SystemExit("the initial puts failed")
                records.writelines(json.dumps({"key": key, "block_ids": [1 + (start + i) % 1000], "rc": 0,
                                               "time": time.time(), "pid": os.getpid(), "segments": 1}) + "\n"
                                   for i, (key, _) in enumerate(items))
        log(f"put {args.keys:,} x {args.value_bytes} B in {time.perf_counter() - started:.1f} s; scratch {scratch}")
        watcher = WatchProcess(cluster, state_dir, free_port(), base, scratch / "watch.log")
        started = time.perf_counter()
        # every key verified, and the round that verified them over (its last commits and merge included):
        # a bad key put while that round still ends would time the first round's tail, not detection
        metrics = watcher.wait_for(lambda m: m.get("mooncake_audit_watch_keys_verified_within_period", 0) >= args.keys
                                   and m.get(ROUNDS, 0) >= 1, 1800, "the first verification of the store")
        result["first_verification_s"] = time.perf_counter() - started
        result["first_verification_gauges"] = watch_gauges(metrics)
        log(f"first verification of {args.keys:,} keys: {result['first_verification_s']:.1f} s, "
            f"{watch_gauges(metrics)}")
        clean = CleanProducer(cluster, args.keys, args.clean_rate, args.value_bytes)
        clean.start()
        bad_used = 0
        try:
            if "listing" in feeds:
                result["feeds"].append(measure_feed("listing", watcher, producer, args.samples, args.interval,
                                                    bad_used, args.value_bytes, rng, log))
                bad_used += args.samples
            watcher.stop()
            if "records" in feeds:
                clean.records = tables / "blocks-clean.jsonl"
                time.sleep(0.5)
                watcher = WatchProcess(cluster, state_dir, free_port(), [*base, "--block-tables", str(tables)],
                                       scratch / "watch.log")
                watcher.wait_for(lambda m: m.get("mooncake_audit_watch_rounds_total", 0) >= 2, 600,
                                 "two rounds with the records")
                result["feeds"].append(measure_feed("records", watcher, producer, args.samples, args.interval,
                                                    bad_used, args.value_bytes, rng, log,
                                                    records=tables / "blocks-bad.jsonl"))
                bad_used += args.samples
                watcher.stop()
                clean.records = None
            if "restart" in feeds:
                result["feeds"].append(measure_restarts(cluster, state_dir, base, scratch / "watch.log", producer,
                                                        args.samples, args.interval, bad_used, args.value_bytes,
                                                        rng, log))
                bad_used += args.samples
            if "cost" in feeds:
                settings = [("period 24h (nothing due)", [])]
                settings += [(f"--max-bandwidth {bw}, period 60s", ["--period", "60s", "--max-bandwidth", bw])
                             for bw in args.bandwidths.split(",") if bw]
                for name, extra in settings:
                    watcher = WatchProcess(cluster, state_dir, free_port(), [*base, *extra], scratch / "watch.log")
                    watcher.wait_for(lambda m: m.get("mooncake_audit_watch_rounds_total", 0) >= 1, 600, "a round")
                    result["cost"].append({**measure_cost(name, watcher, min(20.0, args.cost_seconds / 2),
                                                          args.cost_seconds, log), "options": extra})
                    watcher.stop()
        finally:
            clean.stop()
            if watcher.process.poll() is None:
                watcher.stop()
            producer.close()
        result["clean_put_failures"] = clean.failures
        result["clean_keys_put"] = clean.next - args.keys
    found = state_dir / "findings.jsonl"
    flagged = {json.loads(line)["key"] for line in found.read_text().splitlines()} if found.exists() else set()
    expected = {bad_key(n) for n in range(bad_used)}
    result["false_findings"] = sorted(flagged - expected)
    result["missed"] = sorted(expected - flagged)
    result["finished"] = datetime.now(timezone.utc).isoformat()
    print(json.dumps({k: v for k, v in result.items() if k not in ("machine",)}, indent=1, default=str))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))
    return 0 if not result["false_findings"] and not result["missed"] else 1


if __name__ == "__main__":
    sys.exit(main())
