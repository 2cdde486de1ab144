"""Every benchmark of mooncake-audit in one command; results in docs/benchmarks.md.

    python -m benchmarks.run            # the documented run (about 5-8 minutes on 2 cores)
    python -m benchmarks.run --quick    # a smoke run (1-2 minutes)

Sections (each on its own embedded cluster, torn down afterwards):
  transfer  fetch-only ceiling vs scan (core and full run_scan) vs naive get()+sha256, for
            mamba-130m values at TP 2 and TP 1 and for 4 KiB values
  kernels   the CPU region check alone vs raw xxh3 over the same bytes
  listing   enumeration of many keys: seconds and peak RSS of the auditor process
  processes whole processes as cron pays for them (fetch-only script, naive script, the CLI);
            opt-in: `--sections processes` (also `python -m benchmarks.processes`)

Prints the raw table, the ratios and the targets of issue #5; `--markdown PATH` also writes them
as Markdown, `--json PATH` as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from contextlib import nullcontext
from datetime import datetime, timezone

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

from benchmarks.common import HEADER, MODES, Row, machine, markdown_table, table, text_table  # noqa: E402

SECTIONS = ("kernels", "transfer", "listing", "processes")
DEFAULT_SECTIONS = ("kernels", "transfer", "listing")  # processes: opt-in (its own cluster, ~3 min)


def _row(rows: list[Row], section: str, prefix: str) -> Row | None:
    for row in rows:
        if row.section == section and row.name.startswith(prefix):
            return row
    return None


def ratios(rows: list[Row]) -> list[list[str]]:
    """[what, median ratio, best ratio, target, met] lines."""
    out = []

    def add(what, num: Row | None, den: Row | None, target: float | None, higher_is_faster=True):
        if num is None or den is None:
            return
        median = den.median / num.median if higher_is_faster else num.median / den.median
        best = den.best / num.best if higher_is_faster else num.best / den.best
        met = "-" if target is None else ("met" if median >= target else
                                          "met on best only" if best >= target else "MISSED")
        out.append([what, f"{median:.2f}", f"{best:.2f}", "-" if target is None else f">= {target}", met])

    sections = sorted({row.section for row in rows if row.section.startswith("transfer")})
    for section in sections:
        fetch = _row(rows, section, "fetch-only")
        core, full, naive = (_row(rows, section, p) for p in ("scan core", "scan full:", "naive"))
        name = section.removeprefix("transfer ")
        add(f"{name}: scan core / fetch-only (throughput)", core, fetch, 0.9)
        add(f"{name}: scan full / fetch-only", full, fetch, None)
        add(f"{name}: scan core / naive", core, naive, 3.0)
        add(f"{name}: scan full / naive", full, naive, None)
        add(f"{name}: before (checker as of cf1bf69): scan core / fetch-only", _row(rows, section, "before"), fetch, None)
        add(f"{name}: serial (no overlap) / fetch-only", _row(rows, section, "serial"), fetch, None)
    for section in sorted({row.section for row in rows if row.section.startswith("check")}):
        raw = _row(rows, section, "xxh3_64, one call")
        label = section.removeprefix("check ").split(" (")[0]
        add(f"{label}: region check / raw xxh3", _row(rows, section, "HostChecker"), raw, 0.7)
        add(f"{label}: before (reference) / raw xxh3", _row(rows, section, "before"), raw, None)
    listing = _row(rows, "enumeration", "AdminListing")
    parsing = _row(rows, "enumeration", "parse")
    if listing is not None:
        median = listing.median + (parsing.median if parsing else 0)
        best = listing.best + (parsing.best if parsing else 0)
        rss_ok = listing.rss_mib is not None and listing.rss_mib <= 1024
        out.append([f"enumeration of {listing.keys:,} keys: list + parse, seconds", f"{median:.2f}",
                    f"{best:.2f}", "<= 10 s (for 500,000 keys)", "met" if median <= 10 else "MISSED"])
        out.append(["enumeration: auditor peak RSS MiB", f"{listing.rss_mib:.0f}", "-", "<= 1024 MiB",
                    "met" if rss_ok else "MISSED"])
    return out


RATIO_HEADER = ["ratio", "median", "best", "target", "status"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_const", dest="mode", const="quick", help="smoke run, 1-2 minutes")
    mode.add_argument("--tiny", action="store_const", dest="mode", const="tiny", help="seconds; for the test suite")
    parser.add_argument("--sections", default=",".join(DEFAULT_SECTIONS),
                        help=f"comma-separated subset of {','.join(SECTIONS)}")
    parser.add_argument("--runs", type=int, default=None, help="timed runs per method (default: per mode)")
    parser.add_argument("--markdown", default=None, help="also write the results as Markdown to this path")
    parser.add_argument("--json", default=None, help="also write the results as JSON to this path")
    args = parser.parse_args(argv)
    mode_name = args.mode or "full"
    sizes = MODES[mode_name]
    runs = args.runs or sizes.runs
    chosen = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = set(chosen) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}")

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    started = time.perf_counter()
    info = machine()
    command = "python -m benchmarks.run" + ("" if mode_name == "full" else f" --{mode_name}")
    log(f"{command}: {info['nproc']} CPUs ({info['cpu']}), {info['ram_gib']} GiB RAM, load {info['loadavg_start']}")
    rows: list[Row] = []
    if "kernels" in chosen:
        from benchmarks.kernels import run_kernels
        log(f"kernels: {sizes.kernel_mib} MiB buffer, {runs} runs each")
        rows += run_kernels(sizes.kernel_mib, runs, log)
    if "transfer" in chosen or "listing" in chosen:
        from benchmarks import listing, transfer
        chosen_workloads = transfer.workloads(sizes) if "transfer" in chosen else []
        # The full run gives each section a cluster of its own (memory is freed in between);
        # smaller runs share one, which saves starting and stopping daemons.
        shared = None
        if mode_name != "full":
            from audit.cluster import LocalCluster
            need = sum(transfer.segment_mb(w.count, w.layout.size) for w in chosen_workloads)
            need += listing.segment_mb(sizes.enum_keys) if "listing" in chosen else 0
            shared = LocalCluster(holders=1, segment_mb=need)
        with shared if shared is not None else nullcontext():
            for number, workload in enumerate(chosen_workloads):
                log(f"transfer {workload.name}: {workload.count:,} keys, {runs} alternating runs each")
                rows += transfer.run_workload(workload, runs, log, fixed_costs=number == 0, cluster=shared)
            if "listing" in chosen:
                log(f"listing: {sizes.enum_keys:,} keys, {sizes.enum_runs} runs")
                rows += listing.run_listing(sizes.enum_keys, sizes.enum_runs, log, cluster=shared)
    if "processes" in chosen:
        from benchmarks.processes import KEYS_BY_MODE, run_processes
        log(f"processes: {KEYS_BY_MODE[mode_name]:,} keys, whole processes, interleaved rounds")
        rows += run_processes(KEYS_BY_MODE[mode_name], args.runs or min(runs, 3), log, probe=mode_name != "tiny")[0]
    elapsed = time.perf_counter() - started
    info["loadavg_end"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    lines = table(rows)
    ratio_lines = ratios(rows)
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"# {command} — {date}; {elapsed:.0f} s in all")
    print(f"# machine: {json.dumps(info)}")
    print(text_table(HEADER, lines))
    print()
    print(text_table(RATIO_HEADER, ratio_lines))
    if args.markdown:
        with open(args.markdown, "w") as handle:
            handle.write(f"Command: `{command}`; date: {date}; {elapsed:.0f} s in all.\n\n")
            handle.write("Machine: " + ", ".join(f"{k} {v}" for k, v in info.items()) + "\n\n")
            handle.write(markdown_table(HEADER, lines) + "\n\n" + markdown_table(RATIO_HEADER, ratio_lines) + "\n")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"command": command, "date": date, "machine": info, "elapsed_s": elapsed,
                       "rows": [{"section": r.section, "name": r.name, "keys": r.keys, "bytes": r.nbytes,
                                 "seconds": r.seconds, "rss_mib": r.rss_mib, "note": r.note,
                                 "cpu_self_s": r.cpu_self, "cpu_daemons_s": r.cpu_daemons} for r in rows],
                       "ratios": [dict(zip(RATIO_HEADER, line)) for line in ratio_lines]}, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
