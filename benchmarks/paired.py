"""Whole processes of two checkouts, paired (issue #31): the same command line from the code before
and after a change, run in turn on one store, timed from spawn to reaped exit; their reports compared.

    python -m benchmarks.paired --store empty --command scan --runs 7
    python -m benchmarks.paired --store mamba --keys 600 --command scan --command check --runs 5
    python -m benchmarks.paired --store mamba --keys 2200 --dtype bfloat16 --command scan --command fetch-only
    python -m benchmarks.paired --store small --keys 200000 --command check --command fetch-only --runs 3
    python -m benchmarks.paired --store small --keys 200000 --command check --repo-before /tmp/base

Stores (one `audit.cluster.LocalCluster` on loopback, one holder): `empty`; `mamba`, `--keys`
mamba-130m TP 2 values (700,416 B of bf16 state, one in 50 all zero, `benchmarks.processes`'s
producer) scanned with `--model-config mamba-130m-hf -tp 2` (and, with `--dtype`, that dtype as
`--dtype` and `--mamba-ssm-cache-dtype`: the layout whole, no reading left open; `--dtype` alone
leaves the ssm state's dtype open, bfloat16 against float16); `small`, `--keys` values of 256 B (one in 97 all zero, `benchmarks.scale`'s producers).
Commands: `scan` and `check` (`--format json --output FILE`, check with a `--state-dir` of its own
per checkout), and `fetch-only` (`benchmarks.processes`'s script: the ceiling). The "before"
checkout is `--repo-before` (default: HEAD, exported with `git archive` into a temporary directory);
"after" is this working tree. Both run as `python -m cli ...` with their checkout alone on
PYTHONPATH, from a neutral directory, bytecode cached after the first run (`--warmup` unmeasured
runs of each first, default 1).

Per command, rounds alternate A B, B A, ...; per run: wall seconds, CPU seconds and peak RSS of the
child (`os.wait4`); the median of each, and the median of the per-pair ratios after / before. Every
pair's reports are compared: summaries without times, and every finding's (with `--all-keys`, every
key's) digest, size, zero flag and verdicts; any difference fails the benchmark. Peak RSS is the
child's `ru_maxrss`, which Linux floors at this harness's own peak (it reads the reports): keep
`--all-keys` for small stores.
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

from benchmarks.common import MAMBA_130M, MAMBA_130M_NAME, machine, text_table  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TIMES = ("started_at", "finished_at", "duration_s", "bytes_per_s")


def comparable(path: Path, ignore: tuple[str, ...] = ()) -> dict:
    """What must be equal between two reports of one store: the summary (without times and the fields
    named in `ignore`: ones a change between the two checkouts rewords), every key's or finding's
    digest, size, zero flag and verdicts, the shared groups."""
    document = json.loads(path.read_text())
    summary = {k: v for k, v in document["summary"].items() if k not in TIMES and k not in ignore}
    keys = {r["key"]: (r["xxh3"], r["size"], r["zero"], sorted(r["verdicts"]))
            for r in document.get("keys", document.get("findings", []))}
    return {"summary": summary, "keys": keys, "shared": document.get("shared_groups"),
            "expected": document.get("expected_duplicates")}


def run(argv: list[str], env: dict, cwd: Path) -> dict:
    started = time.perf_counter()
    process = subprocess.Popen(argv, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(process.pid, 0)
    wall = time.perf_counter() - started
    stderr = process.stderr.read().decode(errors="replace")
    process.stderr.close()
    code = os.waitstatus_to_exitcode(status)
    if code not in (0, 1, 3):
        raise RuntimeError(f"{' '.join(argv[:4])} exited {code}: {stderr[-800:]}")
    return {"wall": wall, "cpu": usage.ru_utime + usage.ru_stime, "rss_mib": usage.ru_maxrss / 1024, "code": code,
            "stderr": stderr}


def checkout_before(given: Path | None, scratch: Path) -> Path:
    """The "before" checkout: `given`, else HEAD exported with `git archive` into `scratch`."""
    if given is not None:
        return given.resolve()
    before = scratch / "before"
    before.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "HEAD"], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(before)], input=archive.stdout, check=True)
    return before.resolve()


def child_env() -> dict:
    """The measured processes' environment: no audit settings of this shell's, bytecode cached."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOONCAKE_AUDIT_")}
    env.pop("MOONCAKE_CONFIG_PATH", None)
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # both checkouts run from cached bytecode
    env["BENCH_ROOT"] = str(ROOT)
    return env


def connection_flags(cluster) -> list[str]:
    """The CLI's flags for a `LocalCluster`."""
    return ["--master", cluster.master_address, "--metadata", cluster.metadata_url, "--admin", cluster.admin_url]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.paired", description=__doc__.splitlines()[0])
    parser.add_argument("--store", choices=("empty", "mamba", "small"), default="empty")
    parser.add_argument("--keys", type=int, default=600)
    parser.add_argument("--command", action="append", choices=("scan", "check", "fetch-only"))
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured runs of each command and checkout first")
    parser.add_argument("--all-keys", action="store_true",
                        help="reports with --all, compared key by key (else the summaries and findings)")
    parser.add_argument("--ignore-summary", action="append", default=[], metavar="FIELD",
                        help="a summary field the two checkouts word differently (e.g. layout_inference)")
    parser.add_argument("--dtype", default=None,
                        help="mamba store: also give the served dtype (--dtype and --mamba-ssm-cache-dtype), "
                             "so no reading is left open")
    parser.add_argument("--repo-before", type=Path, default=None)
    parser.add_argument("--repo-after", type=Path, default=ROOT, help="the checkout after (default: this tree)")
    args = parser.parse_args(argv)
    commands = args.command or ["scan"]

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    from audit.cluster import LocalCluster
    from benchmarks import processes, scale

    python = sys.executable
    info = machine()
    log(f"paired: store {args.store}, {args.keys:,} keys, {info['nproc']} CPUs, load {info['loadavg_start']}")
    if args.store == "mamba":
        segment = int(args.keys * (processes.value_bytes() + 4096) * 1.3 / (1 << 20)) + 64
    else:
        segment = scale._segment_mb(args.keys if args.store == "small" else 0)
    rows, loads = [], [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory(prefix="mooncake-bench-paired-") as scratch_name, \
            LocalCluster(holders=1, segment_mb=segment) as cluster:
        scratch = Path(scratch_name)
        env = child_env()
        cluster_args = [cluster.admin_url, cluster.master_address, cluster.metadata_url]
        layout: list[str] = []
        if args.store == "small" and args.keys:
            scale._populate(cluster, python, scratch, env, args.keys, 2, log)
        elif args.store == "mamba":
            script, items = scratch / "publish.py", scratch / "items.json"
            script.write_text(processes.PUBLISH)
            items.write_text(json.dumps([[processes.key_of(i), processes.is_zero(i)] for i in range(args.keys)]))
            subprocess.run([python, str(script), *cluster_args, str(items), str(processes.value_bytes())],
                           env=env, check=True, capture_output=True)
            config = scratch / MAMBA_130M_NAME
            config.mkdir()
            (config / "config.json").write_text(json.dumps({**MAMBA_130M, "architectures": ["MambaForCausalLM"],
                                                            "torch_dtype": "bfloat16"}))
            given = ["--dtype", args.dtype, "--mamba-ssm-cache-dtype", args.dtype] if args.dtype else []
            layout = ["--model-config", str(config), "-tp", "2", *given]
        fetch = scratch / "fetch.py"
        fetch.write_text(processes.FETCH_ONLY)
        repos = {"before": checkout_before(args.repo_before, scratch), "after": args.repo_after.resolve()}
        connection = connection_flags(cluster)
        neutral = scratch / "cwd"
        neutral.mkdir()

        def argv_of(command: str, label: str) -> tuple[list[str], Path | None]:
            if command == "fetch-only":
                return [python, str(fetch), *cluster_args, str(processes.BUFFER_BYTES),
                        str(processes.MAX_BATCH_KEYS)], None
            out = scratch / f"{command}-{label}.json"
            extra = ["--state-dir", str(scratch / f"state-{label}")] if command == "check" else []
            every = ["--all"] if args.all_keys else []
            return [python, "-m", "cli", command, *connection, *layout, "--format", "json", *every,
                    "--output", str(out), *extra], out

        for command in commands:
            labels = ("after", "before") if command != "fetch-only" else ("after",)
            measured: dict[str, list[dict]] = {label: [] for label in labels}
            for _ in range(args.warmup):  # bytecode, page cache
                for label in labels:
                    run(argv_of(command, label)[0], {**env, "PYTHONPATH": str(repos[label])}, neutral)
            for turn in range(args.runs):
                for label in (labels if turn % 2 == 0 else labels[::-1]):
                    argv_, _ = argv_of(command, label)
                    measured[label].append(run(argv_, {**env, "PYTHONPATH": str(repos[label])}, neutral))
                if len(labels) == 2:
                    a, b = (comparable(argv_of(command, label)[1], tuple(args.ignore_summary)) for label in labels)
                    if a != b:
                        raise RuntimeError(f"{command}: the reports of before and after differ")
                loads.append(os.getloadavg()[0])
                log(f"  {command} round {turn + 1}/{args.runs}: " + ", ".join(
                    f"{label} {m[-1]['wall']:.2f} s" for label, m in measured.items()) + f" (load {loads[-1]:.2f})")
            for label, runs in measured.items():
                ratio = "-"
                if len(labels) == 2 and label == "after":
                    ratio = f"{statistics.median(a['wall'] / b['wall'] for a, b in zip(runs, measured['before'])):.2f}"
                rows.append([command, label, str(len(runs)), f"{min(r['wall'] for r in runs):.2f}",
                             f"{statistics.median(r['wall'] for r in runs):.2f}",
                             f"{max(r['wall'] for r in runs):.2f}", f"{statistics.median(r['cpu'] for r in runs):.2f}",
                             f"{max(r['rss_mib'] for r in runs):.0f}", ratio,
                             "identical" if len(labels) == 2 else "-"])
        shutil.rmtree(neutral, ignore_errors=True)
    print(f"# store {args.store}, {args.keys:,} keys; 1-min load {min(loads):.2f}-{max(loads):.2f}")
    print(text_table(["command", "code", "runs", "wall s min", "wall s median", "wall s max", "CPU s median",
                      "peak RSS MiB", "after/before wall (median of pairs)", "reports"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
