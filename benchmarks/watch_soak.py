"""Soak of `mooncake-audit watch` (issue #23): a long run through holder kills and restarts, a kill -9
of the watcher and a master restart, on an embedded loopback cluster.

    .venv/bin/python -m benchmarks.watch_soak                 # 30 minutes (the documented run)
    .venv/bin/python -m benchmarks.watch_soak --quick         # under a minute, a smoke run
    .venv/bin/python -m benchmarks.watch_soak --minutes 10 --json soak.json

One `LocalCluster` (master + 2 holders). A producer puts `--keys` clean vLLM-style keys (random
bytes, `--value-bytes` each), then two more a second for the whole run, and an all-zero key every
90 s (the only keys that may be flagged). The watcher is a whole process (`.venv/bin/mooncake-audit
watch --period 60s --interval 2 --max-bandwidth 262144`). Faults, at fixed shares of the run:

  holder kill   SIGKILL one of the two holders (the master drops its keys after its client TTL),
                a new holder added 30 s later; five times
  watcher kill  SIGKILL the watcher, start it again on the same --state-dir; once
  master kill   SIGKILL the master and start a new one on the same ports (LocalCluster has no
                restart: `start()` with `holders=0`, see watch_harness.restart_master); the
                holders mount their segments again, every key is gone, and the producer puts
                every key it published again; once

The last 15 % of the run is calm. What it reports and checks:

  RSS           the watcher's VmRSS once the store is first verified, at the end, and the max
                (per watcher process: the kill -9 starts a new one)
  lost state    after the watcher's kill -9: watch.sqlite opens, its keys are the listed ones,
                and (from snapshots of the database every 15 s) no key's last verification moved
                forward less than --period (less its read-ahead, at most a fifth) after the one
                before, across every restart
  false finding every key in findings.jsonl and every key flagged in the state is a zero key
  missed        every zero key the store still holds at the end is flagged
  period        keys verified within the period against keys known, every 5 s; at the end of the
                calm phase all of them
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sqlite3
import sys
import tempfile
import time
import urllib.request
from datetime import datetime, timezone
from pathlib import Path

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

from audit.cluster import LocalCluster, free_port  # noqa: E402
from audit.run.watch import READ_AHEAD_SHARE  # noqa: E402
from benchmarks.common import machine  # noqa: E402
from benchmarks.watch_harness import (Producer, WatchProcess, bad_key, clean_items,  # noqa: E402
                                      restart_master)

HOLDER_KILLS = (0.08, 0.24, 0.40, 0.62, 0.78)
WATCHER_KILL = 0.32
MASTER_RESTART = 0.50
CALM_AFTER = 0.85
BAD_EVERY_S = 90.0
SAMPLE_S = 5.0
SNAPSHOT_S = 15.0


def listed(cluster) -> set[str]:
    with urllib.request.urlopen(cluster.admin_url + "/get_all_keys", timeout=60) as answer:
        return {line for line in answer.read().decode().splitlines() if line}


def snapshot(state_dir: Path) -> dict[str, tuple[float, float | None, int]]:
    """name -> (first_seen, last_verified, finding), read-only."""
    db = sqlite3.connect(f"file:{state_dir / 'watch.sqlite'}?mode=ro", uri=True, timeout=10)
    try:
        return {name: (seen, verified, finding) for name, seen, verified, finding in
                db.execute("SELECT name, first_seen, last_verified, finding FROM keys")}
    finally:
        db.close()


class StampCheck:
    """From successive snapshots: a key whose last verification moved forward sooner than the period
    after its previous one was read again early (lost state, or a pacing bug)."""

    def __init__(self, period_s: float, slack_s: float):
        self.period_s = period_s
        self.slack_s = slack_s
        self.last: dict[str, tuple[float, float | None]] = {}
        self.early: list[dict] = []
        self.rereads = 0

    def add(self, snap: dict[str, tuple[float, float | None, int]]) -> None:
        for name, (seen, verified, _) in snap.items():
            before = self.last.get(name)
            if before is not None and before[0] == seen and before[1] is not None and verified is not None \
                    and verified > before[1]:
                self.rereads += 1
                if verified - before[1] < self.period_s - self.slack_s:
                    self.early.append({"key": name, "gap_s": round(verified - before[1], 2)})
            self.last[name] = (seen, verified)
        for name in set(self.last) - set(snap):
            del self.last[name]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.watch_soak", description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--keys", type=int, default=3000, help="clean keys put before the watcher starts")
    parser.add_argument("--value-bytes", type=int, default=1024)
    parser.add_argument("--period", type=float, default=60.0, help="the watcher's --period, seconds")
    parser.add_argument("--interval", type=float, default=2.0)
    parser.add_argument("--max-bandwidth", type=int, default=262144)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 1 minute, 500 keys, period 15 s")
    parser.add_argument("--json", default=None, help="write the result here")
    parser.add_argument("--seed", type=int, default=23)
    args = parser.parse_args(argv)
    if args.quick:
        args.minutes, args.keys, args.period, args.interval = min(args.minutes, 0.9), min(args.keys, 500), 15.0, 1.0
    rng = random.Random(args.seed)
    duration = args.minutes * 60
    restart_delay = min(30.0, duration * 0.06)
    bad_every = min(BAD_EVERY_S, duration / 6)

    def log(message: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)

    info = machine()
    command = "python -m benchmarks.watch_soak " + " ".join(argv if argv is not None else sys.argv[1:])
    result: dict = {"command": command.strip(), "machine": info, "started": datetime.now(timezone.utc).isoformat(),
                    "options": vars(args), "events": [], "samples": []}
    scratch = Path(tempfile.mkdtemp(prefix="watch-soak-"))
    state_dir = scratch / "state"
    (scratch / "cluster").mkdir()
    extra = ["--period", f"{args.period:g}s", "--interval", f"{args.interval:g}", "--max-bandwidth",
             str(args.max_bandwidth)]
    with LocalCluster(holders=2, segment_mb=256, log_dir=scratch / "cluster") as cluster:
        producer = Producer(cluster)
        published: list[tuple[str, bytes]] = clean_items(0, args.keys, args.value_bytes)
        bad: list[str] = []
        if producer.put_many(published):
            raise SystemExit("the initial puts failed")
        log(f"put {args.keys} keys; logs and state in {scratch}")
        watcher = WatchProcess(cluster, state_dir, free_port(), extra, scratch / "watch.log")
        watchers = [{"pid": watcher.pid, "rss_mib": []}]
        watcher.wait_for(lambda m: m.get("mooncake_audit_watch_keys_verified_within_period", 0) >= args.keys,
                         120, "the first verification of the store")
        log("store verified once")
        # watch reads a key ahead of its period by at most READ_AHEAD_SHARE of it (audit/run/watch.py)
        stamps = StampCheck(args.period, slack_s=1.0 + READ_AHEAD_SHARE * args.period)
        started = time.monotonic()
        events = sorted([(share * duration, "holder_kill") for share in HOLDER_KILLS]
                        + [(share * duration + restart_delay, "holder_add") for share in HOLDER_KILLS]
                        + [(WATCHER_KILL * duration, "watcher_kill"), (MASTER_RESTART * duration, "master_restart")])
        next_clean, next_bad_at, next_sample, next_snap = args.keys, bad_every * rng.uniform(0.3, 1.0), 0.0, 0.0
        put_failures = 0
        pending: list[tuple[str, bytes]] = []
        try:
            while (now := time.monotonic() - started) < duration:
                while events and events[0][0] <= now:
                    _, kind = events.pop(0)
                    stamp = {"t_s": round(now, 1), "event": kind}
                    if kind == "holder_kill" and len(cluster.running_holders) > 1:
                        victim = rng.choice(cluster.running_holders)
                        cluster.kill_holder(victim)
                        stamp["holder"] = victim.segment
                    elif kind == "holder_add":
                        stamp["holder"] = cluster.add_holder().segment
                    elif kind == "watcher_kill":
                        before = snapshot(state_dir)
                        watcher.stop(signal.SIGKILL)
                        watcher = WatchProcess(cluster, state_dir, free_port(), extra, scratch / "watch.log")
                        watchers.append({"pid": watcher.pid, "rss_mib": []})
                        after = snapshot(state_dir)
                        stamp["state_keys_before"], stamp["state_keys_after"] = len(before), len(after)
                        stamp["state_intact"] = before == after
                    elif kind == "master_restart":
                        restart_master(cluster)
                        deadline = time.monotonic() + 60
                        while len(cluster.segments()) < len(cluster.running_holders) and time.monotonic() < deadline:
                            time.sleep(0.2)
                        producer.reopen()
                        again = published + [(name, bytes(args.value_bytes)) for name in bad]
                        stamp["republished"] = len(again)
                        stamp["republish_failures"] = producer.put_many(again)
                    result["events"].append(stamp)
                    log(f"event {stamp}")
                if now >= next_bad_at:
                    name = bad_key(len(bad))
                    if producer.put(name, bytes(args.value_bytes)) == 0:
                        bad.append(name)
                    next_bad_at = now + bad_every * rng.uniform(0.5, 1.5)
                items = pending + clean_items(next_clean, 1, args.value_bytes)
                next_clean += 1
                failed = producer.put_many(items)
                if failed:
                    put_failures += failed
                    pending = items[-50:]  # retried next tick (the master may be down)
                else:
                    published.extend(items)
                    pending = []
                if now >= next_sample:
                    metrics = watcher.try_metrics() or {}
                    rss = watcher.rss_mib()
                    if rss is not None:
                        watchers[-1]["rss_mib"].append(round(rss, 1))
                    result["samples"].append({
                        "t_s": round(now, 1), "rss_mib": rss, "cpu_s": watcher.cpu_seconds(),
                        "known": metrics.get("mooncake_audit_watch_keys_known"),
                        "within": metrics.get("mooncake_audit_watch_keys_verified_within_period"),
                        "never": metrics.get("mooncake_audit_watch_keys_not_yet_verified"),
                        "oldest_s": metrics.get("mooncake_audit_watch_oldest_verification_age_seconds"),
                        "findings": metrics.get("mooncake_audit_findings"),
                        "unreachable": metrics.get("mooncake_audit_watch_keys_unreachable"),
                        "master_up": metrics.get("mooncake_audit_watch_master_up"),
                        "interval_s": metrics.get("mooncake_audit_watch_interval_seconds")})
                    next_sample = now + SAMPLE_S
                if now >= next_snap:
                    stamps.add(snapshot(state_dir))
                    next_snap = now + SNAPSHOT_S
                time.sleep(0.5)
            # the end: everything the store holds must be verified within the period and judged right
            time.sleep(1.0)
            store_keys = listed(cluster)
            final = watcher.wait_for(
                lambda m: m.get("mooncake_audit_watch_keys_known", -1) == len(store_keys)
                == m.get("mooncake_audit_watch_keys_verified_within_period"), 2 * args.period, "the final state")
            stamps.add(snapshot(state_dir))
            snap = snapshot(state_dir)
            watchers[-1]["rss_mib"].append(round(watcher.rss_mib() or 0, 1))
            exit_code = watcher.stop()
        finally:
            if watcher.process.poll() is None:
                watcher.stop(signal.SIGKILL)
            producer.close()
    findings_file = state_dir / "findings.jsonl"
    found = {json.loads(line)["key"] for line in findings_file.read_text().splitlines()} if findings_file.exists() else set()
    flagged = {name for name, (_, _, finding) in snap.items() if finding}
    bad_set = set(bad)
    calm = [s for s in result["samples"] if s["t_s"] >= CALM_AFTER * duration and s["known"] is not None]
    result.update({
        "finished": datetime.now(timezone.utc).isoformat(),
        "watch_exit_code": exit_code,
        "watchers": [{"pid": w["pid"], "rss_first_mib": w["rss_mib"][0] if w["rss_mib"] else None,
                      "rss_last_mib": w["rss_mib"][-1] if w["rss_mib"] else None,
                      "rss_max_mib": max(w["rss_mib"]) if w["rss_mib"] else None} for w in watchers],
        "keys_published": len(published), "bad_published": len(bad), "put_failures": put_failures,
        "store_keys_end": len(store_keys),
        "state_keys_end": len(snap), "state_matches_store": set(snap) == store_keys,
        "false_findings": sorted((found | flagged) - bad_set),
        "missed_bad": sorted((bad_set & store_keys) - flagged),
        "bad_in_store_end": len(bad_set & store_keys),
        "rereads_seen": stamps.rereads, "early_rereads": stamps.early[:20], "early_reread_count": len(stamps.early),
        "final_known": final.get("mooncake_audit_watch_keys_known"),
        "final_within": final.get("mooncake_audit_watch_keys_verified_within_period"),
        "final_oldest_s": final.get("mooncake_audit_watch_oldest_verification_age_seconds"),
        "calm_samples_all_within": sum(1 for s in calm if s["within"] == s["known"]), "calm_samples": len(calm),
        "max_oldest_s": max((s["oldest_s"] or 0) for s in result["samples"]) if result["samples"] else None,
        "watcher_cpu_s_last_process": result["samples"][-1]["cpu_s"] if result["samples"] else None,
    })
    ok = (not result["false_findings"] and not result["missed_bad"] and not result["early_reread_count"]
          and result["state_matches_store"] and exit_code == 0
          and all(e.get("state_intact", True) for e in result["events"]))
    result["ok"] = ok
    summary = {k: v for k, v in result.items() if k not in ("samples", "machine", "options")}
    print(json.dumps(summary, indent=1, default=str))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))
    log(f"{'OK' if ok else 'FAILED'}; scratch {scratch}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
