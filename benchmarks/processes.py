"""Whole processes, as cron pays for them: start-up, imports, listing, reads, checks, close, exit.

    python -m benchmarks.processes                      # 1,200 keys, 3 interleaved rounds (~2-3 min on 2 cores)
    python -m benchmarks.processes --keys 300 --runs 1  # a smoke run
    python -m benchmarks.run --sections processes       # the same section through the dispatcher

One embedded cluster (`audit.cluster.LocalCluster`: master + one holder, TCP on loopback) holds
`--keys` realistic mamba-130m TP 2 values (700,416 B of bf16 state each, one in 50 all zero, vLLM
keys). Every measured process is a fresh `subprocess` of this interpreter (the project's
`.venv/bin/python`), timed from spawn to reaped exit:

  fetch-only   a minimal script: import the Mooncake client, list (`/get_all_keys` +
               `/batch_query_keys` sizes), `batch_get_into` every key into one registered
               256 MiB buffer (batches <= 1,000 keys), `close()`: the baseline
  naive        per key `get()` + sha256, compared with the digest of that many zeros, `close()`
  scan ...     `mooncake-audit scan --model-config <dir> --tp-size 2 --format json`, with default
               flags, with `--device cpu`, and with `--device cpu` and no layout
  check        `mooncake-audit check --model-config <dir> --tp-size 2 --format json` (defaults:
               `--read-mode peek`, `--device auto`)
  --version    `mooncake-audit --version`
  import torch `python -c "import torch"`

Rounds are interleaved (each round starts at the next process), and every run is verified: keys
read, bytes, zero values found, exit code. Then a probe measures, in one process each, what
`MooncakeDistributedStore.close()` costs an auditor client (global_segment_size=0) and what the
interpreter's exit costs when close() is not called (or is skipped with `os._exit`), and whether
the master or the metadata server keeps anything of the client afterwards.

Nothing here imports the audit package beyond `audit.cluster`; the CLI runs as a subprocess.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

from benchmarks.common import (MAMBA_130M, MAMBA_130M_NAME, ZERO_EVERY, BenchmarkError, Row,  # noqa: E402
                               cpu_seconds, fmt, machine, markdown_table, text_table)

ROOT = Path(__file__).resolve().parent.parent
SECTION = "processes"
TP_SIZE = 2
BUFFER_BYTES = 256 << 20      # the fetch-only script's registered buffer (the scan's default --buffer-mb 256)
MAX_BATCH_KEYS = 1000         # TCP batches above ~1,000 keys per peer overflow a queue
KEYS_BY_MODE = {"full": 1200, "quick": 300, "tiny": 12}


def value_bytes(config: dict = MAMBA_130M, tp_size: int = TP_SIZE) -> int:
    """Bytes of one vLLM Mamba state value: per layer conv (d_conv - 1, d_inner / tp) + ssm
    (d_inner / tp, d_state), bf16. mamba-130m at TP 2: 24 x (3 x 768 + 768 x 16) x 2 = 700,416 B."""
    inner = config["intermediate_size"] // tp_size
    per_layer = (config["conv_kernel"] - 1) * inner + inner * config["state_size"]
    return config["num_hidden_layers"] * per_layer * 2


def key_of(index: int, tp_size: int = TP_SIZE) -> str:
    """vLLM's key for value `index` (the TP ranks of one chunk share its hash)."""
    chunk, rank = divmod(index, tp_size)
    chunk_hash = f"{(chunk * 0x9E3779B97F4A7C15) & (2**64 - 1):016x}{chunk:016x}"
    return f"{MAMBA_130M_NAME}@tp_rank:{rank}@pcp0@dcp0@pp_rank:0@group:0@{chunk_hash}"


def is_zero(index: int) -> bool:
    return index % ZERO_EVERY == ZERO_EVERY - 1


# ---------------------------------------------------------------------------------------------
# The scripts the child processes run. Each is standalone: the Mooncake client, numpy, stdlib.
# argv: admin URL, master HOST:PORT, metadata URL, then per script.

_PREAMBLE = r'''
import hashlib, json, os, sys, time, urllib.parse, urllib.request
admin, master, metadata = sys.argv[1:4]

def setup():
    from mooncake.store import MooncakeDistributedStore
    store = MooncakeDistributedStore()
    rc = store.setup("127.0.0.1", metadata, 0, 16 << 20, "tcp", "", master)  # mounts no segment
    if rc != 0:
        sys.exit(f"setup returned {rc}")
    return store

def list_keys():
    with urllib.request.urlopen(admin + "/get_all_keys", timeout=60) as answer:
        return [line for line in answer.read().decode().splitlines() if line]

def sizes_of(keys):
    sizes = {}
    for start in range(0, len(keys), 500):
        chunk = keys[start:start + 500]
        query = ",".join(urllib.parse.quote(key, safe="@:") for key in chunk)
        with urllib.request.urlopen(admin + "/batch_query_keys?keys=" + query, timeout=60) as answer:
            data = json.loads(answer.read())["data"]
        for key in chunk:
            sizes[key] = int(data[key]["values"][0]["size_"])
    return sizes
'''

FETCH_ONLY = _PREAMBLE + r'''
import numpy as np
store = setup()
keys = list_keys()
sizes = sizes_of(keys)
buffer = np.empty(int(sys.argv[4]), np.uint8)
base = buffer.ctypes.data
if store.register_buffer(base, buffer.nbytes) != 0:
    sys.exit("register_buffer failed")
done = failed = 0
batch, used = [], 0
def flush(batch):
    offsets, at = [], 0
    for key in batch:
        offsets.append(base + at)
        at += sizes[key]
    results = store.batch_get_into(batch, offsets, [sizes[key] for key in batch])
    return sum(1 for key, got in zip(batch, results) if got != sizes[key]), sum(sizes[key] for key in batch)
for key in keys:
    if batch and (len(batch) >= int(sys.argv[5]) or used + sizes[key] > buffer.nbytes):
        bad, nbytes = flush(batch); failed += bad; done += nbytes
        batch, used = [], 0
    batch.append(key); used += sizes[key]
if batch:
    bad, nbytes = flush(batch); failed += bad; done += nbytes
store.unregister_buffer(base)
store.close()
print(json.dumps({"keys": len(keys), "bytes": done, "failed": failed}))
'''

NAIVE = _PREAMBLE + r'''
store = setup()
keys = list_keys()
zero_digest = {}
zeros = nbytes = 0
for key in keys:
    value = store.get(key)
    nbytes += len(value)
    if len(value) not in zero_digest:
        zero_digest[len(value)] = hashlib.sha256(bytes(len(value))).digest()
    if hashlib.sha256(value).digest() == zero_digest[len(value)]:
        zeros += 1
store.close()
print(json.dumps({"keys": len(keys), "bytes": nbytes, "zeros": zeros}))
'''

PUBLISH = _PREAMBLE + r'''
# The producer: argv[4] a JSON file of [[key, is_zero], ...], argv[5] the value size.
import numpy as np
sys.path.insert(0, os.environ["BENCH_ROOT"])
from benchmarks.common import stamp, state_like
items = json.load(open(sys.argv[4]))
size = int(sys.argv[5])
store = setup()
per_batch = max(1, min(1000, (64 << 20) // size, len(items)))
buffer = np.zeros(per_batch * size, np.uint8)
base = buffer.ctypes.data
store.register_buffer(base, buffer.nbytes)
rng = np.random.default_rng(0)
pool = [state_like(rng, size) for _ in range(min(per_batch, 16))]
for start in range(0, len(items), per_batch):
    chunk = items[start:start + per_batch]
    for slot, (key, zero) in enumerate(chunk):
        view = buffer[slot * size:(slot + 1) * size]
        if zero:
            view[:] = 0
        else:
            view[:] = pool[(start + slot) % len(pool)]
            stamp(view, start + slot)
    codes = store.batch_put_from([key for key, _ in chunk], [base + slot * size for slot in range(len(chunk))],
                                 [size] * len(chunk))
    bad = [code for code in codes if code != 0]
    if bad:
        sys.exit(f"{len(bad)} puts failed (first {bad[0]})")
store.unregister_buffer(base)
store.close()
print(json.dumps({"published": len(items)}))
'''

# The close() probe: argv[4] the mode (close, exit, os_exit), argv[5] keys to read first.
PROBE = _PREAMBLE + r'''
import numpy as np
mode, count = sys.argv[4], int(sys.argv[5])
started = time.perf_counter()
from mooncake.store import MooncakeDistributedStore
import_s = time.perf_counter() - started
started = time.perf_counter()
store = setup()
setup_s = time.perf_counter() - started
hostname = store.get_hostname()
keys = list_keys()[:count]
sizes = sizes_of(keys)
buffer = np.empty(sum(sizes.values()), np.uint8)
base = buffer.ctypes.data
store.register_buffer(base, buffer.nbytes)
offsets, at = [], 0
for key in keys:
    offsets.append(base + at); at += sizes[key]
started = time.perf_counter()
results = store.batch_get_into(keys, offsets, [sizes[key] for key in keys])
read_s = time.perf_counter() - started
if [r for r, key in zip(results, keys) if r != sizes[key]]:
    sys.exit("probe: reads failed")
time.sleep(float(sys.argv[6]))   # as a scan would: the client's background threads run meanwhile
close_s = None
if mode == "close":
    store.unregister_buffer(base)
    started = time.perf_counter()
    store.close()
    close_s = time.perf_counter() - started
print(json.dumps({"mode": mode, "import_s": import_s, "setup_s": setup_s, "read_s": read_s, "close_s": close_s,
                  "hostname": hostname, "end_wall": time.time()}), flush=True)
if mode == "os_exit":
    os._exit(0)
'''


# ---------------------------------------------------------------------------------------------

@dataclass
class Process:
    """One kind of measured process: its command line and how to verify one run."""

    name: str
    argv: list[str]
    verify: Callable[[int, str], str]   # (exit code, stdout) -> "" when right, else what was wrong
    moves_data: bool = True
    seconds: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)          # CPU seconds of the child (user + sys)
    daemons: list[float] = field(default_factory=list)      # CPU seconds of master + holder meanwhile


def timed_process(argv: list[str], env: dict, scratch: Path) -> tuple[float, float, int, str, str]:
    """(wall seconds spawn -> reaped, child CPU seconds, exit code, stdout, stderr tail)."""
    out_path, err_path = scratch / "stdout", scratch / "stderr"
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        started = time.perf_counter()
        process = subprocess.Popen(argv, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=env, cwd=scratch)
        code = process.wait()
        seconds = time.perf_counter() - started
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    stderr = err_path.read_text(errors="replace").strip().splitlines()
    return seconds, cpu, code, out_path.read_text(errors="replace"), "\n".join(stderr[-8:])


def _json(stdout: str) -> dict | None:
    try:
        return json.loads(stdout)
    except json.JSONDecodeError:
        return None


def _summary(stdout: str) -> dict:
    document = _json(stdout) or {}
    return document.get("summary", document)


def processes(python: str, cli: str, cluster_args: list[str], connection: list[str], config_dir: Path,
              scripts: dict[str, Path], count: int, size: int, zeros: int) -> list[Process]:
    layout = ["--model-config", str(config_dir), "--tp-size", str(TP_SIZE)]

    def fetch_ok(code, stdout):
        result = _json(stdout) or {}
        good = code == 0 and result.get("keys") == count and result.get("bytes") == count * size \
            and result.get("failed") == 0
        return "" if good else f"exit {code}, {result}"

    def naive_ok(code, stdout):
        result = _json(stdout) or {}
        good = code == 0 and result.get("keys") == count and result.get("zeros") == zeros
        return "" if good else f"exit {code}, {result}"

    def scan_ok(expect_findings: int | None):
        def verify(code, stdout):
            summary = _summary(stdout)
            scanned = summary.get("keys_scanned")
            findings = summary.get("findings")
            wanted = 1 if (expect_findings or zeros) else 0
            good = scanned == count and code == wanted and (expect_findings is None or findings == expect_findings)
            return "" if good else f"exit {code}, keys_scanned {scanned}, findings {findings}"
        return verify

    def version_ok(code, stdout):
        return "" if code == 0 and stdout.startswith("mooncake-audit ") else f"exit {code}, {stdout[:80]!r}"

    def import_ok(code, stdout):
        return "" if code == 0 else f"exit {code}"

    return [
        Process("fetch-only script (baseline)", [python, str(scripts["fetch"]), *cluster_args,
                                                 str(BUFFER_BYTES), str(MAX_BATCH_KEYS)], fetch_ok),
        Process("naive script: get() + sha256 per key", [python, str(scripts["naive"]), *cluster_args], naive_ok),
        Process("scan --model-config (defaults: --device auto)",
                [cli, "scan", *connection, *layout, "--format", "json"], scan_ok(zeros)),
        Process("scan --model-config --device cpu",
                [cli, "scan", *connection, *layout, "--device", "cpu", "--format", "json"], scan_ok(zeros)),
        Process("scan --device cpu, no layout",
                [cli, "scan", *connection, "--device", "cpu", "--format", "json"], scan_ok(None)),
        Process("check --model-config (defaults: peek, --device auto)",
                [cli, "check", *connection, *layout, "--format", "json"], scan_ok(zeros)),
        Process("mooncake-audit --version", [cli, "--version"], version_ok, moves_data=False),
        Process("python -c 'import torch'", [python, "-c", "import torch"], import_ok, moves_data=False),
    ]


def _metadata_has(cluster, hostname: str) -> dict[str, bool]:
    """Whether the metadata server still holds the client's transfer-engine entries."""
    found = {}
    for kind in ("ram", "rpc_meta"):
        url = f"{cluster.metadata_url}?key=" + urllib.parse.quote(f"mooncake/{kind}/{hostname}", safe="")
        try:
            with urllib.request.urlopen(url, timeout=2) as answer:
                found[kind] = answer.status == 200
        except urllib.error.HTTPError as error:
            found[kind] = error.code == 200
        except OSError:
            found[kind] = False
    return found


def _master_metrics(cluster) -> dict[str, float]:
    with urllib.request.urlopen(cluster.admin_url + "/metrics", timeout=5) as answer:
        body = answer.read().decode(errors="replace")
    wanted = ("master_active_clients", "master_ping_requests_total")
    return {line.split()[0]: float(line.split()[1]) for line in body.splitlines()
            if line.split() and line.split()[0] in wanted}


def close_probe(cluster, python: str, script: Path, cluster_args: list[str], env: dict, scratch: Path,
                reps: int, log: Callable[[str], None], keys: int = 100, linger_s: float = 1.5) -> list[dict]:
    """Per mode, `reps` processes: import, setup, read `keys` keys, linger, then close() / plain
    exit / os._exit. Returns one dict per process."""
    results = []
    for rep in range(reps):
        for mode in ("close", "exit", "os_exit"):
            before = _master_metrics(cluster)
            wall, cpu, code, stdout, stderr = timed_process(
                [python, str(script), *cluster_args, mode, str(keys), str(linger_s)], env, scratch)
            reaped = time.time()
            result = _json(stdout.strip().splitlines()[-1] if stdout.strip() else "") or {}
            if code != 0 or not result:
                raise BenchmarkError(f"close probe {mode}: exit {code}\n{stderr}")
            after = _master_metrics(cluster)
            result.update(rep=rep, wall_s=wall, exit_s=reaped - result["end_wall"],
                          metadata_after=_metadata_has(cluster, result["hostname"]),
                          active_clients_before=before.get("master_active_clients"),
                          active_clients_after=after.get("master_active_clients"))
            results.append(result)
            closed = "-" if result["close_s"] is None else f"{result['close_s']:.2f} s"
            log(f"  probe {mode}: process {wall:.2f} s, close {closed}, exit {result['exit_s']:.2f} s, "
                f"metadata kept {result['metadata_after']}")
    return results


def ping_rate(cluster, python: str, script: Path, cluster_args: list[str], env: dict, seconds: float = 4.0) -> dict:
    """Master pings per second with and without an idle auditor client attached: does the master
    track an auditor client at all?"""
    a = _master_metrics(cluster)["master_ping_requests_total"]
    time.sleep(seconds)
    b = _master_metrics(cluster)["master_ping_requests_total"]
    child = subprocess.Popen([python, str(script), *cluster_args, "close", "1", str(seconds + 1.5)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    time.sleep(1.0)
    c = _master_metrics(cluster)["master_ping_requests_total"]
    time.sleep(seconds)
    d = _master_metrics(cluster)["master_ping_requests_total"]
    child.wait()
    return {"without_auditor_per_s": (b - a) / seconds, "with_auditor_per_s": (d - c) / seconds}


def _git_state() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "audit", "cli.py"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.split("\n")
        changed = [line[3:] for line in dirty if line.strip()]
        return head + (f" + uncommitted changes to {len(changed)} files under audit/, cli.py" if changed else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def run_processes(count: int, runs: int, log: Callable[[str], None], probe: bool = True) -> tuple[list[Row], dict]:
    """The measured rows (section `processes`) and the extra facts (load, close probe)."""
    from audit.cluster import LocalCluster

    python = sys.executable
    cli = str(Path(python).parent / "mooncake-audit")
    if not Path(cli).exists():
        raise BenchmarkError(f"{cli} not found: install the project into this interpreter's environment")
    size = value_bytes()
    total = count * size
    zeros = sum(1 for index in range(count) if is_zero(index))
    segment_mb = int(count * (size + 4096) * 1.3 / (1 << 20)) + 64
    facts: dict = {"keys": count, "value_bytes": size, "total_bytes": total, "zero_values": zeros,
                   "runs": runs, "code": _git_state(), "loadavg": []}
    with tempfile.TemporaryDirectory(prefix="mooncake-bench-proc-") as scratch_name, \
            LocalCluster(holders=1, segment_mb=segment_mb) as cluster:
        scratch = Path(scratch_name)
        env = {**os.environ, "MC_LOG_LEVEL": os.environ.get("MC_LOG_LEVEL", "ERROR"), "BENCH_ROOT": str(ROOT)}
        env.pop("MOONCAKE_CONFIG_PATH", None)
        env = {k: v for k, v in env.items() if not k.startswith("MOONCAKE_AUDIT_")}  # the CLI's defaults, not ours
        config_dir = scratch / MAMBA_130M_NAME
        config_dir.mkdir()
        (config_dir / "config.json").write_text(json.dumps({**MAMBA_130M, "architectures": ["MambaForCausalLM"],
                                                             "torch_dtype": "bfloat16"}))
        scripts = {}
        for name, text in (("fetch", FETCH_ONLY), ("naive", NAIVE), ("publish", PUBLISH), ("probe", PROBE)):
            scripts[name] = scratch / f"{name}.py"
            scripts[name].write_text(text)
        cluster_args = [cluster.admin_url, cluster.master_address, cluster.metadata_url]
        connection = ["--master", cluster.master_address, "--metadata", cluster.metadata_url,
                      "--admin", cluster.admin_url]
        items = scratch / "items.json"
        items.write_text(json.dumps([[key_of(index), is_zero(index)] for index in range(count)]))
        seconds, _, code, stdout, stderr = timed_process(
            [python, str(scripts["publish"]), *cluster_args, str(items), str(size)], env, scratch)
        if code != 0:
            raise BenchmarkError(f"publishing failed (exit {code}):\n{stderr}")
        log(f"  published {count:,} x {size:,} B in {seconds:.1f} s (a whole process)")
        measured = processes(python, cli, cluster_args, connection, config_dir, scripts, count, size, zeros)
        daemons = [cluster.master.pid, *(holder.process.pid for holder in cluster.running_holders)]
        facts["loadavg"].append(os.getloadavg())
        for turn in range(runs):
            for offset in range(len(measured)):
                process = measured[(turn + offset) % len(measured)]
                theirs = cpu_seconds(daemons)
                wall, cpu, code, stdout, stderr = timed_process(process.argv, env, scratch)
                wrong = process.verify(code, stdout)
                if wrong:
                    raise BenchmarkError(f"{process.name}: {wrong}\n{stderr}")
                process.seconds.append(wall)
                process.cpu.append(cpu)
                process.daemons.append(cpu_seconds(daemons) - theirs)
            facts["loadavg"].append(os.getloadavg())
            log(f"  round {turn + 1}/{runs} (load {facts['loadavg'][-1][0]:.2f}): "
                + ", ".join(f"{p.name.split(' (')[0].split(':')[0]} {p.seconds[-1]:.2f}s" for p in measured))
        if probe:
            facts["close_probe"] = close_probe(cluster, python, scripts["probe"], cluster_args, env, scratch,
                                               runs, log)
            facts["ping_rate"] = ping_rate(cluster, python, scripts["probe"], cluster_args, env)
            log(f"  master pings/s: {facts['ping_rate']}")
    baseline = statistics.median(measured[0].seconds)
    rows = []
    for process in measured:
        row = Row(SECTION, process.name, count if process.moves_data else 0, total if process.moves_data else 0,
                  list(process.seconds), cpu_self=list(process.cpu), cpu_daemons=list(process.daemons))
        ratio = baseline / row.median
        row.note = f"{ratio:.2f} x fetch-only" if process.moves_data else ""
        rows.append(row)
    return rows, facts


# ---------------------------------------------------------------------------------------------

PROCESS_HEADER = ["process", "runs", "s min", "s median", "s max", "GB/s median", "x fetch-only (median)",
                  "CPU s (child)", "CPU s (daemons)"]


def process_table(rows: list[Row]) -> list[list[str]]:
    baseline = rows[0]
    lines = []
    for row in rows:
        lines.append([row.name, str(len(row.seconds)), fmt(row.best), fmt(row.median), fmt(row.worst),
                      fmt(row.gbps(row.median)) if row.nbytes else "-",
                      f"{baseline.median / row.median:.2f}" if row.nbytes else "-",
                      fmt(statistics.median(row.cpu_self)), fmt(statistics.median(row.cpu_daemons))])
    return lines


PROBE_HEADER = ["ending", "processes", "close() s (each)", "exit s (each: last line -> reaped)",
                "metadata entries left", "master active clients before -> after"]


def probe_table(results: list[dict]) -> list[list[str]]:
    lines = []
    for mode, label in (("close", "close(), then exit"), ("exit", "no close(): plain interpreter exit"),
                        ("os_exit", "no close(): os._exit(0)")):
        mine = [r for r in results if r["mode"] == mode]
        if not mine:
            continue
        closes = ", ".join(f"{r['close_s']:.2f}" for r in mine if r["close_s"] is not None) or "-"
        exits = ", ".join(f"{r['exit_s']:.2f}" for r in mine)
        left = sorted({k for r in mine for k, v in r["metadata_after"].items() if v})
        clients = sorted({f"{r['active_clients_before']:.0f} -> {r['active_clients_after']:.0f}" for r in mine})
        lines.append([label, str(len(mine)), closes, exits, ", ".join(left) or "none", "; ".join(clients)])
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.processes", description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=KEYS_BY_MODE["full"], help="mamba-130m TP 2 values (700,416 B)")
    parser.add_argument("--runs", type=int, default=3, help="interleaved rounds (median of these)")
    parser.add_argument("--no-probe", action="store_true", help="skip the close() / exit probe")
    parser.add_argument("--markdown", default=None, help="also write the tables as Markdown here")
    parser.add_argument("--json", default=None, help="also write the results as JSON here")
    args = parser.parse_args(argv)

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    started = time.perf_counter()
    info = machine()
    command = "python -m benchmarks.processes" + ("" if args.keys == KEYS_BY_MODE["full"] else f" --keys {args.keys}") \
        + ("" if args.runs == 3 else f" --runs {args.runs}") + (" --no-probe" if args.no_probe else "")
    log(f"{command}: {info['nproc']} CPUs, load {info['loadavg_start']}")
    rows, facts = run_processes(args.keys, args.runs, log, probe=not args.no_probe)
    elapsed = time.perf_counter() - started
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    loads = ", ".join(f"{load[0]:.2f}" for load in facts["loadavg"])
    head = (f"{command} - {date}; {elapsed:.0f} s in all; {facts['keys']:,} keys x {facts['value_bytes']:,} B = "
            f"{facts['total_bytes'] / 1e9:.3f} GB ({facts['zero_values']} all-zero); code {facts['code']}; "
            f"1-min load average at the start and after each round: {loads}")
    print("# " + head)
    print(text_table(PROCESS_HEADER, process_table(rows)))
    if facts.get("close_probe"):
        print()
        print(text_table(PROBE_HEADER, probe_table(facts["close_probe"])))
        print(f"master pings per second: {facts['ping_rate']}")
    if args.markdown:
        with open(args.markdown, "w") as handle:
            handle.write(head + "\n\n" + markdown_table(PROCESS_HEADER, process_table(rows)) + "\n")
            if facts.get("close_probe"):
                handle.write("\n" + markdown_table(PROBE_HEADER, probe_table(facts["close_probe"])) + "\n")
                handle.write(f"\nmaster pings per second: {facts['ping_rate']}\n")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"command": command, "date": date, "machine": info, "elapsed_s": elapsed, "facts": facts,
                       "rows": [{"name": r.name, "keys": r.keys, "bytes": r.nbytes, "seconds": r.seconds,
                                 "cpu_self_s": r.cpu_self, "cpu_daemons_s": r.cpu_daemons, "note": r.note}
                                for r in rows]}, handle, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
