"""An ambiguous store against the same store with its dtype given (issue #31 item 3), as whole `scan`
processes of two checkouts, side by side in one run.

    python -m benchmarks.readings                                # 240 keys, 5 rounds
    python -m benchmarks.readings --keys 120 --runs 3 --repo-before /tmp/wt-before

The store (one `audit.cluster.LocalCluster` on loopback, one holder): a Granite 4.0 hybrid
(GraniteMoeHybrid, bfloat16 config: hidden 1536, 6 Mamba2 layers of 48 heads x 64 with d_state 128
and 2 attention layers of 4 KV heads x 128), as vLLM 0.32 pages it: 3 Mamba groups and one attention
group of 2 layers each, every value 1,638,400 B (a Mamba page is conv | ssm | padding). `--keys`
values of bf16 numbers published by `benchmarks.processes`'s producer (`benchmarks.common.state_like`
in every byte, the padding too: the same for every reading), spread over the 4 groups, one in 50
all zero.

Scanned with `--model-config DIR -tp 1` and default flags: no `--dtype`, so every group stays
ambiguous (the bytes cannot tell bfloat16 from float16: 4 readings per Mamba group, conv and ssm
each either, and 2 for attention), against the same with `--dtype bfloat16
--mamba-ssm-cache-dtype bfloat16` (one reading each; `--dtype` alone leaves the ssm state open). Both
checkouts run as `python -m cli scan ...` with their checkout alone on PYTHONPATH (`--repo-before`,
default HEAD exported with `git archive`; after: this tree), from a neutral directory, bytecode
cached by a warm-up run of each. Every round runs the four processes in a rotated order; per
process wall seconds, CPU seconds and peak RSS (`os.wait4`, `benchmarks.paired.run`), and from its
`--verbose` phases the seconds of the layout fit, the sample reads that choose readings, checking
and judging, and the store client's close (before `audit.listeners`, it waited out the one-second
accept() of the client's handshake listener, whose seconds count from its setup, which an ambiguous
run does earlier, for the sample reads). The figure: per checkout, the median over rounds of ambiguous / given, wall
and CPU (the goal: <= 1.1x). Reports must agree:
each store's report is the same before and after (summaries without times, every finding's digest,
size, zero flag and verdicts), and the ambiguous runs must report their groups ambiguous.
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
from pathlib import Path

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

from benchmarks.common import ZERO_EVERY, machine, text_table  # noqa: E402
from benchmarks.paired import checkout_before, child_env, comparable, connection_flags, run  # noqa: E402
from benchmarks import processes  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MODEL = "granite-4.0-h-bench"
GRANITE = {"model_type": "granitemoehybrid", "architectures": ["GraniteMoeHybridForCausalLM"],
           "hidden_size": 1536, "num_hidden_layers": 8, "num_attention_heads": 12, "num_key_value_heads": 4,
           "layer_types": ["mamba"] * 3 + ["attention"] + ["mamba"] * 3 + ["attention"],
           "mamba_n_heads": 48, "mamba_d_head": 64, "mamba_n_groups": 1, "mamba_d_state": 128,
           "mamba_d_conv": 4, "mamba_expand": 2, "torch_dtype": "bfloat16"}
GROUPS = 4
VALUE_BYTES = 1_638_400
# --dtype alone leaves the Mamba ssm state bfloat16 or float16 (--mamba-ssm-cache-dtype): both settle it
STORES = {"ambiguous": [], "given": ["--dtype", "bfloat16", "--mamba-ssm-cache-dtype", "bfloat16"]}
# --verbose phases (stderr) shown beside the wall time: where an ambiguous group's extra cost goes
PHASES = {"layout fit s": "layout fit to the sizes", "sample reads s": "readings chosen by sample bytes",
          "buffer registration s": "buffer registration", "reading s": "reading and judging (wall)",
          "checking s": "checking and judging batches", "close s": "close"}

def key_of(index: int) -> str:
    """vLLM's key of value `index`: chunk `index // GROUPS`, group `index % GROUPS`."""
    chunk, group = divmod(index, GROUPS)
    return f"{MODEL}@tp_rank:0@pcp0@dcp0@pp_rank:0@group:{group}@{(chunk * 0x9E3779B97F4A7C15) % 2**64:016x}"


def page_bytes() -> int:
    """The Granite pages' size, as this checkout's layouts give it (every group's the same)."""
    from audit.layouts import layouts_from_hf_config

    sizes = {layout.size for layout in layouts_from_hf_config(GRANITE, model=MODEL)}
    if sizes != {VALUE_BYTES}:
        raise RuntimeError(f"the Granite pages are {sorted(sizes)} B, not {VALUE_BYTES}")
    return VALUE_BYTES


def _difference(was: dict, now: dict) -> list:
    """The first few keys and summary fields that two `comparable` reports disagree on."""
    keys = [(key, was["keys"].get(key), now["keys"].get(key)) for key in sorted(set(was["keys"]) | set(now["keys"]))
            if was["keys"].get(key) != now["keys"].get(key)]
    fields = [(name, was["summary"].get(name), now["summary"].get(name)) for name in was["summary"]
              if was["summary"].get(name) != now["summary"].get(name)]
    return (keys + fields)[:3]


def phases_of(stderr: str) -> dict[str, float]:
    """The seconds of `PHASES` in a `--verbose` run's stderr ("phase: NAME   1.234 s")."""
    found = {}
    for line in stderr.splitlines():
        name, _, rest = line.removeprefix("phase:").strip().rpartition("  ")
        if line.startswith("phase:") and rest.endswith(" s"):
            found[name.strip()] = float(rest.split()[0])
    return {column: found[phase] for column, phase in PHASES.items() if phase in found}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.readings", description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=240)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured runs of each process first")
    parser.add_argument("--repo-before", type=Path, default=None)
    parser.add_argument("--repo-after", type=Path, default=ROOT)
    parser.add_argument("--ignore-summary", action="append", default=[], metavar="FIELD",
                        help="a summary field left out of the before/after comparison (one that a change "
                             "elsewhere between the checkouts rewords, e.g. layout_inference)")
    args = parser.parse_args(argv)

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    from audit.cluster import LocalCluster

    python = sys.executable
    info = machine()
    log(f"readings: {args.keys:,} keys of {VALUE_BYTES:,} B, {info['nproc']} CPUs, load {info['loadavg_start']}")
    segment = int(args.keys * (VALUE_BYTES + 4096) * 1.3 / (1 << 20)) + 64
    rows, loads = [], [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory(prefix="mooncake-bench-readings-") as scratch_name, \
            LocalCluster(holders=1, segment_mb=segment) as cluster:
        scratch = Path(scratch_name)
        env = child_env()
        script, items = scratch / "publish.py", scratch / "items.json"
        script.write_text(processes.PUBLISH)
        items.write_text(json.dumps([[key_of(i), i % ZERO_EVERY == ZERO_EVERY - 1] for i in range(args.keys)]))
        subprocess.run([python, str(script), cluster.admin_url, cluster.master_address, cluster.metadata_url,
                        str(items), str(page_bytes())], env=env, check=True, capture_output=True)
        config = scratch / MODEL
        config.mkdir()
        (config / "config.json").write_text(json.dumps(GRANITE))
        repos = {"before": checkout_before(args.repo_before, scratch), "after": args.repo_after.resolve()}
        connection = connection_flags(cluster)
        neutral = scratch / "cwd"
        neutral.mkdir()
        runs = [(label, store) for label in repos for store in STORES]

        def measure(label: str, store: str) -> dict:
            out = scratch / f"{label}-{store}.json"
            out.unlink(missing_ok=True)  # a run that writes no report must not pass on the last one's
            argv_ = [python, "-m", "cli", "scan", *connection, "--model-config", str(config), "-tp", "1",
                     *STORES[store], "--format", "json", "--output", str(out), "--verbose"]
            measured = run(argv_, {**env, "PYTHONPATH": str(repos[label])}, neutral)
            if not out.exists():
                raise RuntimeError(f"{label} {store} wrote no report: {measured['stderr'][-800:]}")
            return {**measured, "phases": phases_of(measured.pop("stderr"))}

        for _ in range(args.warmup):
            for label, store in runs:
                measure(label, store)
        measured: dict[tuple, list[dict]] = {pair: [] for pair in runs}
        for turn in range(args.runs):
            order = runs[turn % len(runs):] + runs[:turn % len(runs)]
            for label, store in order:
                measured[label, store].append(measure(label, store))
            for store in STORES:
                was, now = (comparable(scratch / f"{label}-{store}.json", tuple(args.ignore_summary)) for label in repos)
                if was != now:
                    raise RuntimeError(f"{store}: the reports of before and after differ: {_difference(was, now)}")
            for label in repos:
                for store in STORES:
                    statuses = {row["status"] for row in json.loads(
                        (scratch / f"{label}-{store}.json").read_text())["summary"]["layout_inference"]}
                    if (statuses == {"ambiguous"}) != (store == "ambiguous"):
                        raise RuntimeError(f"{label} {store}: the groups are {sorted(statuses)}")
            loads.append(os.getloadavg()[0])
            log(f"  round {turn + 1}/{args.runs}: " + ", ".join(
                f"{label} {store} {measured[label, store][-1]['wall']:.2f} s" for label, store in runs)
                + f" (load {loads[-1]:.2f})")
        for label, store in runs:
            walls = [m["wall"] for m in measured[label, store]]
            ratio = cpu_ratio = "-"
            if store == "ambiguous":
                pairs = list(zip(measured[label, store], measured[label, "given"]))
                ratio = f"{statistics.median(a['wall'] / g['wall'] for a, g in pairs):.2f}"
                cpu_ratio = f"{statistics.median(a['cpu'] / g['cpu'] for a, g in pairs):.2f}"
            after_before = "-"
            if label == "after":
                pairs = list(zip(measured[label, store], measured["before", store]))
                after_before = f"{statistics.median(a['wall'] / b['wall'] for a, b in pairs):.2f}"
            phases = [f"{statistics.median(m['phases'][column] for m in measured[label, store]):.3f}"
                      if all(column in m["phases"] for m in measured[label, store]) else "-" for column in PHASES]
            rows.append([label, store, str(len(walls)), f"{min(walls):.2f}", f"{statistics.median(walls):.2f}",
                         f"{max(walls):.2f}", f"{statistics.median(m['cpu'] for m in measured[label, store]):.2f}",
                         f"{max(m['rss_mib'] for m in measured[label, store]):.0f}", ratio, cpu_ratio, after_before,
                         *phases])
        shutil.rmtree(neutral, ignore_errors=True)
    print(f"# {args.keys:,} keys of {VALUE_BYTES:,} B ({args.keys * VALUE_BYTES / 1e9:.2f} GB), "
          f"{GROUPS} groups; 1-min load {min(loads):.2f}-{max(loads):.2f}; reports before = after")
    print(text_table(["code", "store", "runs", "wall s min", "wall s median", "wall s max", "CPU s median",
                      "peak RSS MiB", "ambiguous/given wall (median of rounds)", "ambiguous/given CPU",
                      "after/before wall (median of rounds)",
                      *(f"{column} (median)" for column in PHASES)], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
