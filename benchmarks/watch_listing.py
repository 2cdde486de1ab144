"""`watch`'s listing feed (issue #31): what one listing of a large store costs a round, before and
after the listing sizes only names it has not listed before.

    python -m benchmarks.watch_listing                         # 100,000 keys: in-process, then watchers
    python -m benchmarks.watch_listing --keys 20000 --runs 3   # smoke
    python -m benchmarks.watch_listing --repo-before /tmp/base # the watcher of another checkout as "before"

One embedded cluster (`audit.cluster.LocalCluster`, one holder, loopback) holds `--keys` values of
256 B under vLLM keys (`benchmarks.processes.key_of`), put by `benchmarks.scale`'s producer processes.

in-process  `AdminListing.list(index=True)` (every key sized by `/batch_query_keys`, as every round
            listed before) and `list(known=KnownKeys(last), index=True)` (only names the last listing
            did not hold are sized: what a round lists now), alternating, `--runs` times each.
watchers    whole `watch` processes (`python -m cli watch --interval 1 --period 24h`, peek reads) of the
            `--repo-before` checkout (default: the code of HEAD, exported to a temporary directory with
            `git archive`) and of this working tree, one after the other, `--runs` times each: after the
            first round has verified every key, the `mooncake_audit_watch_listing_seconds` of the next
            `--listings` listings is read from `/metrics` (each new `_listings_total`), and the interval
            the watcher set from them (`mooncake_audit_watch_interval_seconds`).

Prints one table: per way of listing, the median, min and max seconds, and the interval.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

from benchmarks.common import machine, text_table  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def _metrics(port: int) -> dict[str, float]:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    values = {}
    for line in body.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            try:
                values[name] = float(value)
            except ValueError:
                continue
    return values


def in_process(cluster, runs: int, log) -> dict[str, list[float]]:
    from audit.connection import AdminClient
    from audit.sources.listing import AdminListing, KnownKeys

    admin = AdminClient(cluster.admin_url)
    listing = AdminListing(admin)
    last = listing.list(index=True)
    seconds: dict[str, list[float]] = {"full listing (every key sized)": [], "listing knowing the last one": []}
    for run in range(runs):
        for name in (list(seconds) if run % 2 == 0 else list(seconds)[::-1]):
            started = time.perf_counter()
            if name.startswith("full"):
                listing.list(index=True)
            else:
                last = listing.list(known=KnownKeys(last), index=True)
            seconds[name].append(time.perf_counter() - started)
        log(f"  in-process run {run + 1}/{runs}: " + ", ".join(f"{n} {s[-1]:.2f} s" for n, s in seconds.items()))
    return seconds


def watcher(repo: Path, cluster, keys: int, listings: int, state: Path, log, timeout_s: float = 900.0) -> dict:
    from audit.cluster import free_port

    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOONCAKE_AUDIT_")}
    env["PYTHONPATH"] = str(repo)
    argv = [sys.executable, "-m", "cli", "watch", "--master", cluster.master_address, "--metadata",
            cluster.metadata_url, "--admin", cluster.admin_url, "--state-dir", str(state), "--interval", "1",
            "--period", "24h", "--listen", f"127.0.0.1:{port}"]
    process = subprocess.Popen(argv, cwd=tempfile.gettempdir(), env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE)
    deadline = time.monotonic() + timeout_s
    seen: dict[float, float] = {}
    intervals = []
    try:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"watch of {repo} exited {process.returncode}: {process.stderr.read()[-800:]!r}")
            time.sleep(0.2)
            try:
                metrics = _metrics(port)
            except OSError:
                continue
            if metrics.get("mooncake_audit_watch_keys_verified_within_period", 0) < keys:
                continue
            total = metrics.get("mooncake_audit_watch_listings_total", 0)
            if total >= 2 and total not in seen:  # listing 1 was the first round's
                seen[total] = metrics["mooncake_audit_watch_listing_seconds"]
                intervals.append(metrics["mooncake_audit_watch_interval_seconds"])
            if len(seen) >= listings:
                break
        else:
            raise RuntimeError(f"watch of {repo}: {len(seen)} listings in {timeout_s:.0f} s")
    finally:
        process.terminate()
        process.wait(timeout=60)
        process.stderr.close()
    log(f"  watcher {repo}: listings {', '.join(f'{s:.2f}' for s in seen.values())} s; "
        f"interval {intervals[-1]:.1f} s")
    return {"seconds": list(seen.values()), "interval": intervals[-1]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.watch_listing", description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=100_000)
    parser.add_argument("--runs", type=int, default=5, help="in-process listings of each kind; watchers of each code")
    parser.add_argument("--listings", type=int, default=5, help="listings read from each watcher")
    parser.add_argument("--repo-before", type=Path, default=None, help="checkout of the code before (default HEAD)")
    parser.add_argument("--repo-after", type=Path, default=ROOT, help="checkout of the code after (default this tree)")
    parser.add_argument("--no-watchers", action="store_true")
    args = parser.parse_args(argv)

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    from audit.cluster import LocalCluster
    from benchmarks.scale import _populate, _segment_mb

    info = machine()
    log(f"watch_listing: {args.keys:,} keys, {info['nproc']} CPUs, load {info['loadavg_start']}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="mooncake-bench-watch-listing-") as scratch_name, \
            LocalCluster(holders=1, segment_mb=_segment_mb(args.keys)) as cluster:
        scratch = Path(scratch_name)
        env = {**os.environ, "BENCH_ROOT": str(ROOT)}
        _populate(cluster, sys.executable, scratch, env, args.keys, 2, log)
        for name, seconds in in_process(cluster, args.runs, log).items():
            rows.append([f"in-process: {name}", str(len(seconds)), f"{min(seconds):.2f}",
                         f"{statistics.median(seconds):.2f}", f"{max(seconds):.2f}", "-"])
        if not args.no_watchers:
            before = args.repo_before
            if before is None:
                before = scratch / "before"
                before.mkdir()
                archive = subprocess.run(["git", "-C", str(ROOT), "archive", "HEAD"], capture_output=True, check=True)
                subprocess.run(["tar", "-x", "-C", str(before)], input=archive.stdout, check=True)
            results: dict[str, list[dict]] = {"before": [], "after": []}
            for run in range(args.runs):
                for label in (("before", "after") if run % 2 == 0 else ("after", "before")):
                    state = scratch / f"state-{label}-{run}"
                    results[label].append(watcher(before if label == "before" else args.repo_after, cluster, args.keys,
                                                  args.listings, state, log))
                log(f"  watcher run {run + 1}/{args.runs} done, load {os.getloadavg()[0]:.2f}")
            for label, outcomes in results.items():
                seconds = [s for outcome in outcomes for s in outcome["seconds"]]
                rows.append([f"watch ({label}): listing seconds", str(len(seconds)), f"{min(seconds):.2f}",
                             f"{statistics.median(seconds):.2f}", f"{max(seconds):.2f}",
                             f"{statistics.median(o['interval'] for o in outcomes):.1f}"])
    print(f"# {args.keys:,} keys x 256 B; load average at the end {os.getloadavg()[0]:.2f}")
    print(text_table(["listing", "n", "s min", "s median", "s max", "interval s (median)"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
