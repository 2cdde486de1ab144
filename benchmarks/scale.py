"""Millions of keys on one auditor (issue #22): whole processes against the fetch-only ceiling.

    python -m benchmarks.scale --keys 100000 1000000              # one round each (~8 min on 2 cores)
    python -m benchmarks.scale --quick                            # 20,000 keys, one round (~1-2 min)
    python -m benchmarks.scale --keys 1000000 --repo /tmp/scale-base --json before.json --markdown before.md
    python -m benchmarks.scale --keys 3000000 --append --json before.json --markdown before.md

Per key count one embedded cluster (`audit.cluster.LocalCluster`: a real mooncake_master and one
holder on loopback, the holder's segment sized for the keys) holds N values of 256 B under vLLM
keys (`benchmarks.processes.key_of`: `mamba-130m-hf@tp_rank:R@pcp0@dcp0@pp_rank:0@group:0@HASH`,
2 TP ranks per chunk), one value in 97 all zero, the rest random bytes: the store the issue
measured. It is populated by several producer processes with `batch_put_from` (timed apart: not
part of the comparison). Then, in interleaved rounds (round k starts at the k-th command), whole
processes are timed from spawn to reaped exit (`os.wait4`, whose `ru_maxrss` is that child's peak
RSS):

  fetch-only     `benchmarks.processes.FETCH_ONLY`: the Mooncake client, `/get_all_keys` +
                 `/batch_query_keys`, `batch_get_into` every key into one registered 256 MiB
                 buffer, `close()` (always from this checkout)
  scan           `python -m cli scan --format json --output FILE` (defaults otherwise)
  check          `python -m cli check --format json --output FILE --state-dir FRESH_DIR`
  snapshot       `python -m cli snapshot --output FRESH.sqlite`
  ray            `python -m cli scan --ray local --format json --output FILE`; Ray's own processes
                 (raylet, GCS, workers) are not the driver: their RSS is sampled from /proc
  scan@before, check@before   with `--repo-before DIR`: scan and check from that checkout, in the
                 same rounds

The CLI runs from `--repo` (default: this checkout) with that checkout first on PYTHONPATH, so a
before/after comparison uses the same interpreter and packages. Every run is verified: exit code
1, every key read (keys_scanned = N, or N rows in the snapshot) and the findings exactly the zero
values. Before the measured sizes a small store (`--baseline-keys`) is measured the same way: the
"RSS per key" column is (peak RSS - that baseline's peak RSS) / (N - baseline keys).

`ru_maxrss` of a child counts at least the RSS of the process that spawned it (Linux carries the
old address space's high-water mark across fork/vfork + exec), so this harness keeps itself small:
it holds no keys and reads no report itself (a child process verifies each run); its own peak RSS
is printed as the floor of every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

from benchmarks.common import (BenchmarkError, _proc_line_value, cpu_seconds, fmt, machine,  # noqa: E402
                               markdown_table, text_table)
from benchmarks.processes import _PREAMBLE, BUFFER_BYTES, FETCH_ONLY, MAX_BATCH_KEYS  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
VALUE_BYTES = 256
ZERO_EVERY = 97               # one value in 97 all zero (the store)
COMMANDS = ("fetch", "scan", "check", "snapshot", "ray")
LABELS = {"fetch": "fetch-only script (baseline)", "scan": "scan (defaults, JSON to a file)",
          "check": "check (defaults, fresh --state-dir)", "snapshot": "snapshot (defaults, fresh file)",
          "ray": "scan --ray local (driver)"}
QUICK_KEYS = 20_000
PUT_BATCH = 1000


def zero_count(keys: int) -> int:
    """How many of indices 0..keys-1 are all-zero values (index % 97 == 96)."""
    return (keys + 1) // ZERO_EVERY


# ---------------------------------------------------------------------------------------------
# Child scripts. The producer: argv[4:9] first index, end index, value bytes, zero every, batch.

POPULATE = _PREAMBLE + r'''
import numpy as np
sys.path.insert(0, os.environ["BENCH_ROOT"])
from benchmarks.processes import key_of
first, end, size, every, per_batch = map(int, sys.argv[4:9])
store = setup()
buffer = np.empty(per_batch * size, np.uint8)
base = buffer.ctypes.data
if store.register_buffer(base, buffer.nbytes) != 0:
    sys.exit("register_buffer failed")
rng = np.random.default_rng(first)
for start in range(first, end, per_batch):
    count = min(per_batch, end - start)
    rows = buffer[:count * size].reshape(count, size)
    rows[:] = rng.integers(0, 256, (count, size), dtype=np.uint8)
    zero_from = start + (every - 1 - start) % every
    rows[zero_from - start::every] = 0
    codes = store.batch_put_from([key_of(index) for index in range(start, start + count)],
                                 [base + slot * size for slot in range(count)], [size] * count)
    bad = [code for code in codes if code != 0]
    if bad:
        sys.exit(f"{len(bad)} puts failed (first {bad[0]})")
store.unregister_buffer(base)
store.close()
print(json.dumps({"published": end - first}))
'''

# What a run produced, read in a child so that this process stays small: argv kind, path.
VERIFY = r'''
import json, sqlite3, sys
kind, path = sys.argv[1:3]
if kind == "snapshot":
    db = sqlite3.connect(path)
    keys = db.execute("SELECT count(*) FROM keys").fetchone()[0]
    flagged = db.execute("SELECT count(*) FROM keys WHERE verdicts != '[]'").fetchone()[0]
    zeros = db.execute("SELECT count(*) FROM keys WHERE zero").fetchone()[0]
    print(json.dumps({"keys": keys, "findings": flagged, "zero": zeros}))
else:
    document = json.load(open(path))
    summary = document.get("summary", document)
    print(json.dumps({"keys": summary.get("keys_scanned"), "findings": summary.get("findings"),
                      "verdicts": summary.get("verdicts"), "complete": summary.get("complete")}))
'''


# ---------------------------------------------------------------------------------------------
# Whole processes: spawn -> reaped, ru_maxrss from wait4, Ray's processes sampled from /proc.

def _status_kib(pid: int, field_name: str) -> int | None:
    return _proc_line_value(f"/proc/{pid}/status", field_name, lambda line: int(line.split()[1]))


def _parents() -> dict[int, int]:
    parents = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as handle:
                    parents[int(name)] = int(handle.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    return parents


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return handle.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _is_worker(cmdline: str) -> bool:
    return cmdline.startswith("ray::") or "default_worker.py" in cmdline


class TreeSampler(threading.Thread):
    """Every `interval_s`, the driver's descendants (and any new `ray::` process): each one's
    VmHWM (its peak so far) and the sum of their VmRSS (the peak of that sum is kept)."""

    def __init__(self, root: int, interval_s: float = 0.5):
        super().__init__(daemon=True)
        self.root, self.interval_s = root, interval_s
        self.before = set(_parents())
        self.stop_event = threading.Event()
        self.hwm_kib: dict[int, int] = {}
        self.names: dict[int, str] = {}
        self.sum_rss_kib = 0

    def run(self) -> None:
        while not self.stop_event.wait(self.interval_s):
            self.sample()

    def sample(self) -> None:
        parents = _parents()
        mine, frontier = set(), {self.root}
        while frontier:
            mine |= frontier
            frontier = {pid for pid, parent in parents.items() if parent in frontier} - mine
        mine.discard(self.root)
        for pid in set(parents) - self.before - mine:
            if pid not in self.names and _cmdline(pid).startswith("ray::"):
                mine.add(pid)
        total = 0
        for pid in mine:
            rss, hwm = _status_kib(pid, "VmRSS:"), _status_kib(pid, "VmHWM:")
            if rss is None:
                continue
            total += rss
            self.hwm_kib[pid] = max(self.hwm_kib.get(pid, 0), hwm or 0)
            if not _is_worker(self.names.get(pid, "")):  # a worker renames itself ray::... once started
                self.names[pid] = _cmdline(pid)[:80]
        self.sum_rss_kib = max(self.sum_rss_kib, total)

    def summary(self) -> dict:
        workers = {pid: kib for pid, kib in self.hwm_kib.items() if _is_worker(self.names.get(pid, ""))}
        return {"processes": len(self.hwm_kib), "peak_sum_rss_mib": self.sum_rss_kib / 1024,
                "workers": len(workers), "largest_worker_hwm_mib": max(workers.values(), default=0) / 1024,
                "largest_hwm_mib": max(self.hwm_kib.values(), default=0) / 1024,
                "largest": max(self.hwm_kib, key=self.hwm_kib.get, default=None) and
                self.names.get(max(self.hwm_kib, key=self.hwm_kib.get), "")}


@dataclass
class Outcome:
    seconds: float
    code: int
    maxrss_mib: float
    cpu_s: float
    stdout: str
    stderr_tail: str
    tree: dict | None = None


def run_child(argv: list[str], env: dict, cwd: Path, timeout_s: float, sample_tree: bool = False) -> Outcome:
    """Spawn -> reaped exit (wall seconds), with the child's own rusage from wait4. The child gets
    a session of its own, so a timeout kills its whole tree (Ray's daemons included)."""
    out_path, err_path = cwd / "stdout", cwd / "stderr"
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        started = time.perf_counter()
        process = subprocess.Popen(argv, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=env, cwd=cwd,
                                   start_new_session=True)
        sampler = TreeSampler(process.pid) if sample_tree else None
        if sampler:
            sampler.start()
        killer = threading.Timer(timeout_s, lambda: os.killpg(process.pid, signal.SIGKILL))
        killer.start()
        try:
            _, status, usage = os.wait4(process.pid, 0)
        finally:
            killer.cancel()
        seconds = time.perf_counter() - started
        process.returncode = os.waitstatus_to_exitcode(status)
        if sampler:
            sampler.stop_event.set()
            sampler.join()
    if sampler:  # Ray's daemons outliving the driver would load the next run: wait for them
        _wait_gone(set(sampler.hwm_kib), 30.0)
    stderr = err_path.read_text(errors="replace").strip().splitlines()
    return Outcome(seconds, process.returncode, usage.ru_maxrss / 1024, usage.ru_utime + usage.ru_stime,
                   out_path.read_text(errors="replace"), "\n".join(stderr[-10:]),
                   sampler.summary() if sampler else None)


def _wait_gone(pids: set[int], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(Path(f"/proc/{pid}").exists() for pid in pids):
        time.sleep(0.2)


# ---------------------------------------------------------------------------------------------

@dataclass
class Measured:
    name: str
    seconds: list[float] = field(default_factory=list)
    rss_mib: list[float] = field(default_factory=list)
    cpu_s: list[float] = field(default_factory=list)
    daemons_cpu_s: list[float] = field(default_factory=list)
    loadavg: list[float] = field(default_factory=list)
    checked: list[dict] = field(default_factory=list)
    tree: list[dict] = field(default_factory=list)
    skipped: str = ""

    @property
    def median(self) -> float | None:
        return statistics.median(self.seconds) if self.seconds else None


def _command_lines(command: str, python: str, connection: list[str], cluster_args: list[str],
                   fetch_script: Path, run_dir: Path) -> tuple[list[str], str | None, Path | None]:
    """(argv, verify kind or None, output path) of one run in a fresh directory."""
    cli = [python, "-m", "cli"]
    if command == "fetch":
        return [python, str(fetch_script), *cluster_args, str(BUFFER_BYTES), str(MAX_BATCH_KEYS)], None, None
    if command == "snapshot":
        out = run_dir / "snapshot.sqlite"
        return [*cli, "snapshot", *connection, "--output", str(out)], "snapshot", out
    out = run_dir / "report.json"
    argv = [*cli, "scan" if command in ("scan", "ray") else "check", *connection, "--format", "json",
            "--output", str(out)]
    if command == "check":
        argv += ["--state-dir", str(run_dir / "state")]
    if command == "ray":
        argv += ["--ray", "local"]
    return argv, "report", out


def _verify(command: str, outcome: Outcome, kind: str | None, out: Path | None, keys: int, python: str,
            env: dict, cwd: Path) -> dict:
    """What the run read and flagged; raises when it is not every key and exactly the zero values."""
    zeros = zero_count(keys)
    if kind is None:  # the fetch-only script prints its own account
        try:
            result = json.loads(outcome.stdout.strip().splitlines()[-1])
        except (json.JSONDecodeError, IndexError):
            result = {}
        good = outcome.code == 0 and result.get("keys") == keys and result.get("failed") == 0 \
            and result.get("bytes") == keys * VALUE_BYTES
    else:
        done = subprocess.run([python, "-c", VERIFY, kind, str(out)], capture_output=True, text=True, env=env,
                              cwd=cwd, timeout=600)
        try:
            result = json.loads(done.stdout.strip().splitlines()[-1])
        except (json.JSONDecodeError, IndexError):
            result = {"error": done.stderr.strip()[-300:]}
        good = outcome.code == 1 and result.get("keys") == keys and result.get("findings") == zeros \
            and result.get("zero", zeros) == zeros
    result["exit"] = outcome.code
    if not good:
        raise BenchmarkError(f"{command} at {keys:,} keys: {result} (wanted exit {0 if kind is None else 1}, "
                             f"{keys:,} keys, {zeros:,} findings)\n{outcome.stderr_tail}")
    return result


def _segment_mb(keys: int) -> int:
    """The holder's segment: every value with room for the allocator's rounding and 30% headroom
    (a nearly full segment evicts silently; the fetch-only run would then read fewer keys)."""
    return int(keys * 1024 * 1.3 / (1 << 20)) + 256


def _mem_available_gib() -> float:
    return (_proc_line_value("/proc/meminfo", "MemAvailable:", lambda line: int(line.split()[1])) or 0) / (1 << 20)


def _populate(cluster, python: str, scratch: Path, env: dict, keys: int, workers: int, log) -> float:
    script = scratch / "populate.py"
    script.write_text(POPULATE)
    cluster_args = [cluster.admin_url, cluster.master_address, cluster.metadata_url]
    bounds = [keys * part // workers // PUT_BATCH * PUT_BATCH for part in range(workers)] + [keys]
    started = time.perf_counter()
    children = [subprocess.Popen([python, str(script), *cluster_args, str(first), str(end), str(VALUE_BYTES),
                                  str(ZERO_EVERY), str(PUT_BATCH)], env=env, cwd=scratch,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for first, end in zip(bounds, bounds[1:]) if end > first]
    failures = []
    for child in children:
        stdout, stderr = child.communicate()
        if child.returncode != 0:
            failures.append(f"exit {child.returncode}: {stderr.strip()[-500:]}")
    seconds = time.perf_counter() - started
    if failures:
        raise BenchmarkError(f"populating {keys:,} keys failed: " + "; ".join(failures))
    log(f"  populated {keys:,} x {VALUE_BYTES} B with {len(children)} producer processes in {seconds:.1f} s "
        f"({keys / seconds:,.0f} keys/s)")
    return seconds


BEFORE = "@before"  # a command's suffix: run from --repo-before


def measure_size(keys: int, commands: list[str], runs: int, repo: Path, log, timeout_s: float,
                 populate_workers: int, min_free_gib: float, repo_before: Path | None = None) -> dict:
    """One cluster, populated, every command `runs` times in interleaved rounds (`command@before`:
    from `repo_before`)."""
    from audit.cluster import LocalCluster

    python = sys.executable
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOONCAKE_AUDIT_")}  # the CLI's defaults
    env.pop("MOONCAKE_CONFIG_PATH", None)
    env.update(MC_LOG_LEVEL=os.environ.get("MC_LOG_LEVEL", "ERROR"), BENCH_ROOT=str(ROOT))
    cli_env = {**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(repo), env.get("PYTHONPATH")]))}
    before_env = repo_before and {**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(repo_before),
                                                                                     env.get("PYTHONPATH")]))}
    measured = {command: Measured(LABELS[command.removesuffix(BEFORE)] + (
        f" - before ({_code_of(repo_before)})" if command.endswith(BEFORE) else "")) for command in commands}
    facts: dict = {"keys": keys, "zero_values": zero_count(keys), "value_bytes": VALUE_BYTES,
                   "segment_mb": _segment_mb(keys), "mem_available_gib_start": round(_mem_available_gib(), 1)}
    with tempfile.TemporaryDirectory(prefix="mooncake-bench-scale-") as scratch_name, \
            LocalCluster(holders=1, segment_mb=facts["segment_mb"]) as cluster:
        scratch = Path(scratch_name)
        facts["populate_s"] = _populate(cluster, python, scratch, env, keys, populate_workers, log)
        daemons = [cluster.master.pid, *(holder.process.pid for holder in cluster.running_holders)]
        facts["daemons_rss_mib_after_populate"] = {
            "master": (_status_kib(cluster.master.pid, "VmRSS:") or 0) / 1024,
            "holder": sum((_status_kib(h.process.pid, "VmRSS:") or 0) for h in cluster.running_holders) / 1024}
        fetch_script = scratch / "fetch.py"
        fetch_script.write_text(FETCH_ONLY)
        cluster_args = [cluster.admin_url, cluster.master_address, cluster.metadata_url]
        connection = ["--master", cluster.master_address, "--metadata", cluster.metadata_url,
                      "--admin", cluster.admin_url]
        for turn in range(runs):
            order = commands[turn % len(commands):] + commands[:turn % len(commands)]
            for command in order:
                row = measured[command]
                if row.skipped:
                    continue
                if _mem_available_gib() < min_free_gib:
                    row.skipped = f"skipped: MemAvailable {_mem_available_gib():.1f} GiB < {min_free_gib} GiB"
                    log(f"  {command}: {row.skipped}")
                    continue
                run_dir = Path(tempfile.mkdtemp(prefix=f"{command.removesuffix(BEFORE)}-", dir=scratch))
                what = command.removesuffix(BEFORE)
                argv, kind, out = _command_lines(what, python, connection, cluster_args, fetch_script, run_dir)
                theirs = cpu_seconds(daemons)
                outcome = run_child(argv, env if what == "fetch" else before_env if command.endswith(BEFORE)
                                    else cli_env, run_dir, timeout_s, sample_tree=what == "ray")
                row.daemons_cpu_s.append(cpu_seconds(daemons) - theirs)
                row.loadavg.append(os.getloadavg()[0])
                row.checked.append(_verify(what, outcome, kind, out, keys, python, env, run_dir))
                row.seconds.append(outcome.seconds)
                row.rss_mib.append(outcome.maxrss_mib)
                row.cpu_s.append(outcome.cpu_s)
                if outcome.tree is not None:
                    row.tree.append(outcome.tree)
                shutil.rmtree(run_dir, ignore_errors=True)
                extra = (f", Ray processes {outcome.tree['peak_sum_rss_mib']:,.0f} MiB at most together"
                         if outcome.tree else "")
                log(f"  {keys:,} keys round {turn + 1}/{runs}: {command} {outcome.seconds:.2f} s, "
                    f"peak RSS {outcome.maxrss_mib:,.0f} MiB{extra} (load {row.loadavg[-1]:.2f})")
        facts["daemons_rss_mib_end"] = {
            "master": (_status_kib(cluster.master.pid, "VmHWM:") or 0) / 1024,
            "holder": sum((_status_kib(h.process.pid, "VmHWM:") or 0) for h in cluster.running_holders) / 1024}
    facts["rows"] = {command: asdict(row) for command, row in measured.items()}
    return facts


def ray_available(python: str) -> str:
    """"" when Ray imports in the measured interpreter, else why not."""
    done = subprocess.run([python, "-c", "import ray"], capture_output=True, text=True, timeout=120)
    return "" if done.returncode == 0 else "Ray is not installed in " + python + ": " + done.stderr.strip()[-200:]


# ---------------------------------------------------------------------------------------------

HEADER = ["command", "runs", "s min", "s median", "keys/s median", "x fetch-only", "peak RSS MiB",
          "RSS B/key beyond baseline", "CPU s (child)", "note"]


def size_table(facts: dict, baseline: dict | None) -> list[list[str]]:
    rows = facts["rows"]
    fetch = rows.get("fetch")
    fetch_median = statistics.median(fetch["seconds"]) if fetch and fetch["seconds"] else None
    lines = []
    for command, row in rows.items():
        if not row["seconds"]:
            lines.append([row["name"], "0", "-", "-", "-", "-", "-", "-", "-", row["skipped"] or "not run"])
            continue
        median = statistics.median(row["seconds"])
        peak = max(row["rss_mib"])
        per_key = "-"
        base = baseline and baseline["rows"].get(command)
        if base and base["rss_mib"] and facts["keys"] > baseline["keys"]:
            per_key = fmt((peak - max(base["rss_mib"])) * (1 << 20) / (facts["keys"] - baseline["keys"]), 0)
        notes = []
        if row["tree"]:
            tree = max(row["tree"], key=lambda t: t["peak_sum_rss_mib"])
            notes.append(f"Ray's {tree['processes']} processes: {tree['peak_sum_rss_mib']:,.0f} MiB together at "
                         f"most, largest worker {tree['largest_worker_hwm_mib']:,.0f} MiB (sampled /proc, 0.5 s)")
        if row["skipped"]:
            notes.append(row["skipped"])
        lines.append([row["name"], str(len(row["seconds"])), fmt(min(row["seconds"])), fmt(median),
                      fmt(facts["keys"] / median, 0),
                      f"{fetch_median / median:.2f}" if fetch_median else "-",
                      fmt(peak, 0), per_key, fmt(statistics.median(row["cpu_s"])), "; ".join(notes)])
    return lines


def _code_of(repo: Path) -> str:
    try:
        head = subprocess.run(["git", "-C", str(repo), "log", "-1", "--format=%h"], capture_output=True,
                              text=True, timeout=10).stdout.strip()
        changed = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                                 capture_output=True, text=True, timeout=10).stdout.splitlines()
        return (head or "unknown") + (f" + uncommitted changes to {len(changed)} tracked files" if changed else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _span(values: list[float]) -> str:
    return f"{min(values):.2f}-{max(values):.2f}" if values else "-"


def render(result: dict) -> tuple[str, str]:
    """(text for stdout, Markdown) of every measured size."""
    info = result["machine"]
    head = (f"`{result['command']}`, {result['date']}; CLI from {result['repo']} (code {result['code']}), fetch-only "
            f"from {result['bench_code']}. Machine: {info['nproc']} CPUs ({info['cpu']}), {info['ram_gib']} GiB RAM, "
            f"Linux {info['kernel']}, Python {info['python']}, numpy {info['numpy']}, mooncake {info['mooncake']}; "
            f"load average at the start {', '.join(f'{x:.2f}' for x in info['loadavg_start'] or [])}. "
            f"Harness peak RSS {result['harness_rss_mib']:.0f} MiB (the floor of every ru_maxrss below).")
    text, markdown = [head], [head]
    baseline = result.get("baseline")
    for facts in ([baseline] if baseline else []) + result["sizes"]:
        title = (f"{facts['keys']:,} keys x {VALUE_BYTES} B ({facts['zero_values']:,} all zero)"
                 + (" - the RSS baseline" if facts is baseline else "")
                 + f": populated in {facts['populate_s']:.1f} s; master/holder RSS after populating "
                 f"{facts['daemons_rss_mib_after_populate']['master']:,.0f}/"
                 f"{facts['daemons_rss_mib_after_populate']['holder']:,.0f} MiB; segment {facts['segment_mb']:,} MB; "
                 f"1-min load after each run {_span([x for r in facts['rows'].values() for x in r['loadavg']])}")
        lines = size_table(facts, None if facts is baseline else baseline)
        text += ["", title, text_table(HEADER, lines)]
        markdown += ["", f"**{title}**", "", markdown_table(HEADER, lines)]
    for note in result.get("notes", []):  # added by hand to the JSON: load, what was left out and why
        text += ["", note]
        markdown += ["", note]
    return "\n".join(text), "\n".join(markdown) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scale", description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, nargs="+", default=[100_000, 1_000_000],
                        help="key counts (one cluster each)")
    parser.add_argument("--runs", type=int, default=1, help="interleaved rounds per key count")
    parser.add_argument("--repo", type=Path, default=ROOT, help="checkout whose CLI is measured (python -m cli)")
    parser.add_argument("--repo-before", type=Path, default=None,
                        help="a second checkout: its scan and check run too, interleaved, as scan@before, check@before")
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_KEYS:,} keys, one round")
    parser.add_argument("--commands", default=",".join(COMMANDS), help="subset of " + ",".join(COMMANDS))
    parser.add_argument("--baseline-keys", type=int, default=None,
                        help="small store measured first, for the RSS-per-key column (0: none; "
                             "default 10,000, 2,000 with --quick)")
    parser.add_argument("--populate-workers", type=int, default=4, help="producer processes")
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="per measured process")
    parser.add_argument("--min-free-gib", type=float, default=3.0, help="skip a run when MemAvailable is below this")
    parser.add_argument("--markdown", default=None, help="write the tables as Markdown here")
    parser.add_argument("--json", default=None, help="write the results as JSON here")
    parser.add_argument("--append", action="store_true", help="add these sizes to the results already in --json")
    parser.add_argument("--render", action="store_true",
                        help="measure nothing: print (and --markdown) the --json results")
    args = parser.parse_args(argv)
    if args.render:
        text, markdown = render(json.loads(Path(args.json).read_text()))
        if args.markdown:
            Path(args.markdown).write_text(markdown)
        print(text)
        return 0
    if args.quick:
        args.keys, args.runs = [QUICK_KEYS], 1
    if args.baseline_keys is None:
        args.baseline_keys = 2000 if args.quick else 10_000
    commands = [c.strip() for c in args.commands.split(",") if c.strip()]
    unknown = set(commands) - set(COMMANDS)
    if unknown or not commands:
        parser.error(f"unknown commands {sorted(unknown)}; choose from {','.join(COMMANDS)}")
    repo = args.repo.resolve()
    if not (repo / "cli.py").exists():
        parser.error(f"{repo} has no cli.py")
    repo_before = args.repo_before and args.repo_before.resolve()
    if repo_before is not None:
        if not (repo_before / "cli.py").exists():
            parser.error(f"{repo_before} has no cli.py")
        commands += [command + BEFORE for command in commands if command in ("scan", "check")]

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    started = time.perf_counter()
    info = machine()
    command = "python -m benchmarks.scale " + " ".join(sys.argv[1:] if argv is None else argv)
    skipped = {}
    if "ray" in commands and (why := ray_available(sys.executable)):
        skipped["ray"] = why
    prior = json.loads(Path(args.json).read_text()) if args.append and args.json and Path(args.json).exists() else None
    result = prior or {"command": command, "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                       "machine": info, "repo": str(repo), "code": _code_of(repo), "bench_code": _code_of(ROOT),
                       "sizes": [], "baseline": None}
    if prior:
        result["command"] += f"; then {command} ({datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')})"

    def measure(keys: int) -> dict:
        log(f"{keys:,} keys: MemAvailable {_mem_available_gib():.1f} GiB, load {os.getloadavg()[0]:.2f}")
        size_started = time.perf_counter()
        facts = measure_size(keys, [c for c in commands if c not in skipped], args.runs, repo, log, args.timeout_s,
                             args.populate_workers, args.min_free_gib, repo_before)
        for command_, why in skipped.items():
            facts["rows"][command_] = asdict(Measured(LABELS[command_], skipped=why))
        facts["elapsed_s"] = time.perf_counter() - size_started
        log(f"{keys:,} keys: {facts['elapsed_s']:.0f} s with populating")
        return facts

    def write() -> str:
        own_peak = (_status_kib(os.getpid(), "VmHWM:") or 0) / 1024
        result["harness_rss_mib"] = max(result.get("harness_rss_mib", 0), own_peak)
        result["elapsed_s"] = result.get("elapsed_s_before", 0) + time.perf_counter() - started
        text, markdown = render(result)
        if args.markdown:
            Path(args.markdown).write_text(markdown)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1, default=str) + "\n")
        return text

    result["elapsed_s_before"] = result.get("elapsed_s", 0)
    if args.baseline_keys and result.get("baseline") is None:
        result["baseline"] = measure(args.baseline_keys)
    for keys in args.keys:
        result["sizes"].append(measure(keys))
        write()  # after every size: a later size that fails or runs out of memory keeps the earlier ones
    print(write())
    log(f"done in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
