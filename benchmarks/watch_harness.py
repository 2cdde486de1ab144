"""Shared pieces of the `watch` benchmarks (`watch_detect`, `watch_soak`): the watcher as a whole
process, its metrics and /proc figures, a producer of vLLM-style keys, and a master restart on a
`LocalCluster`. Not a benchmark by itself.

The watcher runs as `.venv/bin/mooncake-audit watch ...` (the entry point beside this interpreter, as
`benchmarks.processes` runs the CLI), or `python -c 'from cli import main; main()'` where the entry
point is missing.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from benchmarks.common import cpu_seconds
from benchmarks.processes import key_of

ROOT = Path(__file__).resolve().parent.parent
BAD_BASE = 50_000_000        # bad keys' indices: never among the clean ones
TP_SIZE = 1


def connection_args(cluster) -> list[str]:
    return ["--master", cluster.master_address, "--metadata", cluster.metadata_url, "--admin", cluster.admin_url,
            "--local-hostname", "127.0.0.1"]


def watch_command() -> list[str]:
    entry = Path(sys.executable).parent / "mooncake-audit"
    if entry.exists():
        return [str(entry), "watch"]
    return [sys.executable, "-c", "import sys; from cli import main; sys.argv = ['mooncake-audit', *sys.argv[1:]]; "
            "main()", "watch"]


def _spelled(sample) -> str:
    labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
    return f"{sample.name}{{{labels}}}" if labels else sample.name


def clean_value(index: int, size: int) -> bytes:
    """Random bytes (never all zero, never shared), the index in front."""
    return index.to_bytes(8, "little") + os.urandom(size - 8)


class WatchProcess:
    """`mooncake-audit watch` as a child process, its metrics scraped from /metrics."""

    def __init__(self, cluster, state_dir: Path, port: int, extra: list[str], log_path: Path):
        self.port = port
        self.argv = [*watch_command(), *connection_args(cluster), "--state-dir", str(state_dir),
                     "--listen", f"127.0.0.1:{port}", *extra]
        self.log = open(log_path, "ab")
        env = {k: v for k, v in os.environ.items() if not k.startswith("MOONCAKE_AUDIT_")}
        env.setdefault("MC_LOG_LEVEL", "ERROR")
        self.process = subprocess.Popen(self.argv, stdout=self.log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, cwd=ROOT, env=env)
        self.started = time.time()

    @property
    def pid(self) -> int:
        return self.process.pid

    def metrics(self, timeout: float = 5.0) -> dict[str, float]:
        """Every sample, `name{label=value,...}` as the test suite spells them."""
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=timeout) as answer:
            text = answer.read().decode()
        return {_spelled(sample): sample.value for family in text_string_to_metric_families(text)
                for sample in family.samples}

    def try_metrics(self) -> dict[str, float] | None:
        with contextlib.suppress(OSError, ValueError):
            return self.metrics()
        return None

    def wait_for(self, condition, timeout_s: float, what: str) -> dict[str, float]:
        deadline = time.monotonic() + timeout_s
        last: dict[str, float] = {}
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the watcher exited ({self.process.returncode}) waiting for {what}")
            last = self.try_metrics() or last
            if last and condition(last):
                return last
            time.sleep(0.2)
        raise RuntimeError(f"timed out after {timeout_s:.0f} s waiting for {what}; last: "
                           f"{ {k: v for k, v in last.items() if '_watch_' in k and 'bucket' not in k} }")

    def cpu_seconds(self) -> float:
        return cpu_seconds([self.pid])

    def rss_mib(self) -> float | None:
        with contextlib.suppress(OSError, ValueError, IndexError):
            with open(f"/proc/{self.pid}/status") as handle:
                for line in handle:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1]) / 1024
        return None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()
        return self.process.returncode


class Producer:
    """A producer-side client (no segment) putting values under vLLM's key scheme; reopened after a
    master restart."""

    def __init__(self, cluster):
        self.cluster = cluster
        self.store = None

    def _open(self):
        if self.store is None:
            from audit.connection import Settings, open_store

            c = self.cluster
            self.store = open_store(Settings(master=c.master_address, metadata=c.metadata_url, admin=c.admin_url,
                                             local_hostname="127.0.0.1"))
        return self.store

    def put_many(self, items: list[tuple[str, bytes]]) -> int:
        """Puts; the number that failed."""
        store = self._open()
        failed = 0
        for start in range(0, len(items), 500):
            chunk = items[start:start + 500]
            codes = store.put_batch([key for key, _ in chunk], [value for _, value in chunk])
            codes = codes if isinstance(codes, list) else [codes] * len(chunk)
            failed += sum(1 for code in codes if code != 0)
        return failed

    def put(self, key: str, value: bytes) -> int:
        return self._open().put(key, value)

    def reopen(self) -> None:
        self.close()

    def close(self) -> None:
        if self.store is not None:
            with contextlib.suppress(Exception):
                self.store.close()
            self.store = None


def clean_items(start: int, count: int, size: int) -> list[tuple[str, bytes]]:
    """vLLM keys at TP 1 (a chunk is one key: a lost holder leaves no INCOMPLETE_CHUNK to account for)."""
    return [(key_of(index, TP_SIZE), clean_value(index, size)) for index in range(start, start + count)]


def bad_key(n: int) -> str:
    return key_of(BAD_BASE + n, TP_SIZE)


def restart_master(cluster, sig: int = signal.SIGKILL, down_s: float = 1.0) -> None:
    """Kill the master and start a new one on the same ports (LocalCluster has no restart: its `start()`
    with `holders` set to 0 starts just the master). The holders stay up; an in-memory master forgets
    every key and segment, and the holders mount theirs again when their pings find it."""
    from audit.cluster import _terminate

    _terminate(cluster.master, sig)
    cluster.master = None
    time.sleep(down_s)
    holders = cluster.holders
    cluster.holders = 0
    try:
        cluster.start()
    finally:
        cluster.holders = holders


def write_record(path: Path, key: str, block_ids: list[int]) -> None:
    """One recorder record (audit/recorder/records.py's shape), appended whole."""
    line = json.dumps({"key": key, "block_ids": block_ids, "rc": 0, "time": time.time(), "pid": os.getpid(),
                       "segments": 1}) + "\n"
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(line)


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, min(len(ordered), int(-(-q * len(ordered) // 100))))
    return ordered[rank - 1]
