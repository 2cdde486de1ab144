"""The auditor side of a measurement, alone in a fresh interpreter, so its peak RSS is its own
(the publisher, the cluster and the benchmark driver are other processes).

    python -m benchmarks.worker list --admin URL --prefix P --runs N --value-bytes B
    python -m benchmarks.worker scan --master H:P --metadata URL --admin URL --prefix P \
        --config JSON --model NAME --tp N --tables PATH

Prints one JSON object on stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")


def _rss_mib() -> float:
    """Peak RSS of this process's own address space (VmHWM).

    Not `ru_maxrss`: Linux carries the parent's peak across fork+exec into the child's
    `ru_maxrss`, so a worker started by a benchmark holding a 256 MiB buffer would report at
    least that. VmHWM belongs to the address space that exec created."""
    with contextlib.suppress(OSError):  # not Linux: fall back to ru_maxrss below
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _list(args) -> dict:
    from audit.connection import AdminClient
    from audit.keys import parse_key
    from audit.sources.listing import AdminListing, KeyFilter

    admin = AdminClient(args.admin, timeout_s=120)
    start_rss = _rss_mib()
    seconds, parse_seconds, keys, lines = [], [], 0, 0
    for _ in range(args.runs):
        started = time.perf_counter()
        listing = AdminListing(admin, KeyFilter(args.prefix)).list()
        seconds.append(time.perf_counter() - started)
        keys, lines = len(listing.keys), listing.listed_lines
        # Parsing: the listing may defer it (fields derived when a key needs them); time it apart.
        started = time.perf_counter()
        parsed = [key.fields if key.fields is not None else parse_key(key.name) for key in listing.keys]
        parse_seconds.append(time.perf_counter() - started)
        good = sum(1 for key, fields in zip(listing.keys, parsed)
                   if key.size == args.value_bytes and fields.get("scheme") == "vllm")
        if good != keys or listing.vanished:
            raise SystemExit(f"listing: {good} of {keys} keys sized and parsed as expected, "
                             f"{len(listing.vanished)} vanished")
        del listing, parsed
    return {"seconds": seconds, "parse_seconds": parse_seconds, "keys": keys, "lines": lines,
            "rss_start_mib": start_rss, "rss_peak_mib": _rss_mib()}


def _scan(args) -> dict:
    from audit.blocktables import read_block_tables
    from audit.connection import Settings
    from audit.layouts import layouts_from_hf_config
    from audit.run.orchestrator import ScanOptions, run_scan
    from audit.judge.plan import CheckPlan
    from benchmarks.transfer import NullSink

    start_rss = _rss_mib()
    settings = Settings(master=args.master, metadata=args.metadata, admin=args.admin, local_hostname="127.0.0.1")
    started = time.perf_counter()
    layouts = layouts_from_hf_config(json.loads(args.config), model=args.model, tp_size=args.tp)
    plan = CheckPlan(layouts=layouts, tables=read_block_tables([args.tables]))
    report = run_scan(settings, ScanOptions(prefix=args.prefix, plan=plan), NullSink())
    return {"seconds": time.perf_counter() - started, "keys_scanned": report.summary["keys_scanned"],
            "findings": report.summary["findings"], "rss_start_mib": start_rss, "rss_peak_mib": _rss_mib()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="benchmarks.worker")
    sub = parser.add_subparsers(dest="what", required=True)
    listing = sub.add_parser("list")
    listing.add_argument("--admin", required=True)
    listing.add_argument("--prefix", default="")
    listing.add_argument("--runs", type=int, default=1)
    listing.add_argument("--value-bytes", type=int, required=True)
    scan = sub.add_parser("scan")
    for name in ("--master", "--metadata", "--admin", "--prefix", "--config", "--model", "--tables"):
        scan.add_argument(name, required=True)
    scan.add_argument("--tp", type=int, default=1)
    args = parser.parse_args(argv)
    result = _list(args) if args.what == "list" else _scan(args)
    json.dump(result, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
