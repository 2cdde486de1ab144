"""The real-vLLM harness: clusters, engines in subprocesses, scans through the CLI, records.

Runs inside .venv-vllm (scripts/vllm-e2e.sh). Every vLLM engine runs in its own process
(tests/e2e/producer.py, forked from one that has imported vLLM and nothing else: `EngineForks`), so
one test's vLLM state (plugins, patched classes, threads) cannot leak into another's. The audit is
run as an operator runs it: the CLI, in a subprocess.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PRODUCER = Path(__file__).with_name("producer.py")

# The log lines that say how vLLM laid its caches out (kept for observed.json and failures).
LOG_PATTERNS = [
    r"Setting attention block size to .*",
    r"Padding mamba page size by .*",
    r"[Kk]v cache group sizes.*",
    r"Registered KV caches: .*",
    r"Reset SSM cache type to .*",
    r"Updating mamba_ssm_cache_dtype.*",
    r"Setting mamba.*",
    r"GPU KV cache size: .*",
    r"CPU KV cache size: .*",
    r"Maximum concurrency .*",
    r"mooncake-audit recorder installed: .*",
    r"mooncake-audit guard: .*",
    r"e2e shim: .*",
    r"batch_put failed: .*",
    r"Boundary-state put failed .*",
    r"Overriding .*block.?size.*",
    r"block_size.*",
]


def cli_command() -> list[str]:
    """The audit CLI: MOONCAKE_AUDIT_E2E_CLI (e.g. .venv/bin/mooncake-audit) or this venv's copy."""
    override = os.environ.get("MOONCAKE_AUDIT_E2E_CLI")
    return override.split() if override else [sys.executable, "-m", "cli"]


def mooncake_config(cluster, path: Path) -> Path:
    """The JSON file vLLM's connector reads (MOONCAKE_CONFIG_PATH), for an embedded cluster."""
    path.write_text(json.dumps({
        "metadata_server": cluster.metadata_url, "master_server_address": cluster.master_address,
        "protocol": "tcp", "device_name": "", "mode": "standalone-store", "global_segment_size": 0,
        "local_buffer_size": "256MB",
    }, indent=2))
    return path


def all_keys(cluster) -> list[str]:
    with urllib.request.urlopen(f"{cluster.admin_url}/get_all_keys", timeout=10) as response:
        return [line for line in response.read().decode().split("\n") if line]


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("MOONCAKE_AUDIT_", "VLLM_", "MOONCAKE_CONFIG_PATH"))}
    env.pop("TRITON_INTERPRET", None)  # the main suite's conftest switch; vLLM must not inherit it
    env.update(MC_TCP_BIND_ADDRESS="127.0.0.1", MC_LOG_LEVEL="ERROR", PYTHONUNBUFFERED="1")
    return env


@dataclass
class EngineRun:
    model: str
    log_path: Path
    batches: list = field(default_factory=list)   # per batch, per prompt: {"tokens", "cached_tokens"}
    seconds: dict = field(default_factory=dict)
    vllm: dict = field(default_factory=dict)      # what vLLM resolved (producer.describe)
    pid: int | None = None                        # the engine's main process
    wall_s: float = 0.0
    log_lines: list[str] = field(default_factory=list)
    unsent: object = None                         # with drain: per rank, store jobs still queued (or the error)
    prompts: list = field(default_factory=list)   # per batch, the prompts it ran (sized batches made)

    def tokens(self, batch: int) -> list[list[int]]:
        return [p["tokens"] for p in self.batches[batch]]

    def cached(self, batch: int) -> list[int]:
        return [p["cached_tokens"] for p in self.batches[batch]]

    def logprobs(self, batch: int) -> list[list[float | None]]:
        return [p.get("logprobs") or [] for p in self.batches[batch]]


def run_engine(model_dir: Path, config_path: Path | None, batches: list[list[list[int]]], work: Path, *,
               mamba: bool, block_size: int | None, max_tokens: int = 8, record_dir: Path | None = None,
               guard: bool = False, bug: bool = False, retention_none: bool = False, tp: int = 1,
               multiprocess: bool = False, dtype: str | None = None, timeout_s: float = 400.0, name: str = "engine",
               drain: bool = False, kv_connector: str | None = None, kv_connector_extra_config: dict | None = None,
               kv_transfer_params: list | None = None, extra_env: dict | None = None,
               settle_s: float | None = None, kv_role: str | None = None, load_guard: bool = False,
               kv_load_failure_policy: str | None = None, logprobs: int | None = None,
               mamba_ssm_cache_dtype: str | None = None, kv_cache_dtype: str | None = None) -> EngineRun:
    """Start one vLLM engine in a subprocess, generate `batches` greedily, return tokens and logs.

    `kv_connector` (default MooncakeStoreConnector), its extra config, per-request `kv_transfer_params`
    (per batch, per prompt), `extra_env` (applied last; a None value removes the variable) and
    `settle_s` are for other connectors (tests/e2e/test_lmcache_e2e.py runs LMCacheConnectorV1).
    `kv_role`, `kv_load_failure_policy`, `load_guard` (MOONCAKE_AUDIT_LOAD_GUARD) and `logprobs` are
    the consumer's (tests/e2e/test_consumer.py)."""
    work.mkdir(parents=True, exist_ok=True)
    spec_path, out_path, log_path = work / f"{name}.spec.json", work / f"{name}.out.json", work / f"{name}.log"
    spec = dict(model=str(model_dir), batches=batches, max_tokens=max_tokens, block_size=block_size, mamba=mamba,
                retention_none=retention_none, tp=tp, dtype=dtype, connector=config_path is not None, out=str(out_path))
    if drain:  # wait for every rank's connector puts before shutdown (producer.drain_sends)
        spec["drain"] = True
    for option, value in (("kv_connector", kv_connector), ("kv_connector_extra_config", kv_connector_extra_config),
                          ("kv_transfer_params", kv_transfer_params), ("settle_s", settle_s), ("kv_role", kv_role),
                          ("kv_load_failure_policy", kv_load_failure_policy), ("logprobs", logprobs),
                          ("mamba_ssm_cache_dtype", mamba_ssm_cache_dtype), ("kv_cache_dtype", kv_cache_dtype)):
        if value is not None:
            spec[option] = value
    spec_path.write_text(json.dumps(spec))
    env = _clean_env()
    env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_HOST_IP="127.0.0.1",
               VLLM_ENABLE_V1_MULTIPROCESSING="1" if (multiprocess or tp > 1) else "0",
               VLLM_LOGGING_LEVEL="INFO")
    if drain and (multiprocess or tp > 1):  # collective_rpc with a function crosses processes pickled
        env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    if tp > 1:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i % (os.cpu_count() or 1)) for i in range(tp))
    if config_path is not None:
        env["MOONCAKE_CONFIG_PATH"] = str(config_path)
    if record_dir is not None:
        env["MOONCAKE_AUDIT_RECORD"] = str(record_dir)
    if guard:
        env["MOONCAKE_AUDIT_GUARD"] = "1"
    if load_guard:
        env["MOONCAKE_AUDIT_LOAD_GUARD"] = "1"
    if bug:
        env["MOONCAKE_AUDIT_E2E_BUG_53084"] = "1"
    for variable, value in (extra_env or {}).items():
        if value is None:
            env.pop(variable, None)
        else:
            env[variable] = value
    started = time.monotonic()
    if env.get("PYTHONPATH") == os.environ.get("PYTHONPATH") and not os.environ.get(OWN_PROCESS_ENV):
        returncode = _forks().run(spec_path, work, env, log_path, timeout_s)
    else:  # stand-in modules on its path: vLLM must import with them, in a process of its own
        with open(log_path, "wb") as log:
            returncode = subprocess.run([sys.executable, str(PRODUCER), str(spec_path)], cwd=work, env=env,
                                        stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s).returncode
    text = log_path.read_text(errors="replace")
    if returncode != 0 or not out_path.exists():
        tail = "\n".join(text.splitlines()[-40:])
        raise EngineFailed(f"vLLM engine for {model_dir.name} exited {returncode}; log {log_path}:\n{tail}")
    result = json.loads(out_path.read_text())
    return EngineRun(model=model_dir.name, log_path=log_path, batches=result["batches"], seconds=result["seconds"], vllm=result.get("vllm", {}), pid=result.get("pid"),
                     wall_s=round(time.monotonic() - started, 1), log_lines=interesting_lines(text),
                     unsent=result.get("unsent_after_drain"), prompts=result.get("prompts") or batches)


OWN_PROCESS_ENV = "MOONCAKE_AUDIT_E2E_ENGINE_PROCESS"  # set: every engine in a process of its own, as before


class EngineForks:
    """``producer.py --serve``: vLLM imported once, each engine a forked child of it (its docstring
    says why that is the same engine). Started at the first engine; ends with the session."""

    def __init__(self):
        env = _clean_env()
        env.update(VLLM_LOGGING_LEVEL="INFO")
        self._pending = b""
        self._stderr = tempfile.TemporaryFile()  # (its own: each engine's goes to that engine's log)
        self.process = subprocess.Popen([sys.executable, str(PRODUCER), "--serve"], cwd=REPO, env=env, text=True,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr)
        if self._answer(120.0) != "ready":
            self._stderr.seek(0)
            raise EngineFailed(f"producer.py --serve did not start (exit {self.process.poll()}; set {OWN_PROCESS_ENV}=1 "
                               f"to start each engine afresh):\n{self._stderr.read()[-3000:].decode(errors='replace')}")

    def run(self, spec_path: Path, work: Path, env: dict, log_path: Path, timeout_s: float) -> int:
        """One engine; its exit status (negative: the signal that ended it). Past `timeout_s` its
        process group is killed and subprocess.TimeoutExpired raised, as subprocess.run does."""
        request = {"spec": str(spec_path), "cwd": str(work), "env": env, "log": str(log_path)}
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        started = self._answer(60.0)
        if started is None:
            raise EngineFailed(f"producer.py --serve started no engine in 60 s (for {spec_path})")
        pid = int(started.split()[1])
        answer = self._answer(timeout_s)
        if answer is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            self._answer(60.0)
            raise subprocess.TimeoutExpired([str(PRODUCER), str(spec_path)], timeout_s)
        return int(answer.split()[2])

    def _answer(self, timeout_s: float) -> str | None:
        """Its next line, or None after `timeout_s` (read from the pipe's descriptor: a buffered
        reader could hold a line that `select` no longer sees)."""
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._pending:
            ready, _, _ = select.select([self.process.stdout], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                return None
            chunk = os.read(self.process.stdout.fileno(), 4096)
            if not chunk:
                raise EngineFailed(f"producer.py --serve exited ({self.process.wait()})")
            self._pending += chunk
        line, _, self._pending = self._pending.partition(b"\n")
        return line.decode().strip()

    def close(self) -> None:
        self.process.stdin.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self._stderr.close()


_FORKS: list[EngineForks] = []


def _forks() -> EngineForks:
    if not _FORKS or _FORKS[0].process.poll() is not None:
        _FORKS[:] = [EngineForks()]
        atexit.register(_FORKS[0].close)
    return _FORKS[0]


def make_model(out: Path, name: str, seed: int) -> Path:
    """One tiny model of tests/e2e/models.py with the weights of `seed` (another checkpoint under the
    same name), made in a subprocess like the session's models."""
    code = ("import sys, torch; from pathlib import Path; import tests.e2e.models as m; "
            "real = torch.manual_seed; torch.manual_seed = lambda s: real(int(sys.argv[2])); "
            "print(m.make(m.ALL_MODELS[sys.argv[3]], Path(sys.argv[1])))")
    subprocess.run([sys.executable, "-c", code, str(out), str(seed), name], check=True, capture_output=True,
                   timeout=300, cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    return out / name


def sized_batch(count: int, blocks: int, extra: int, seed: int) -> dict:
    """`count` random prompts of `blocks` full blocks and `extra` tokens, at the block size the engine
    reports (tests/e2e/producer.py makes them): a case publishes keys on any CPU, whatever block
    vLLM chose there (issue #42: an avx512_bf16 CPU keeps a GDN ssm state in float32 and doubles
    the hybrid's block)."""
    return {"sized": {"count": count, "blocks": blocks, "extra": extra, "seed": seed}}


def published_keys(cluster, run: EngineRun) -> list[str]:
    """Every key in the cluster after `run`; a run that published none fails here, first, saying why."""
    keys = all_keys(cluster)
    if not keys:
        lengths = sorted({len(prompt) for batch in run.prompts for prompt in batch})
        raise NothingPublished(f"vLLM published no key: its block is {run.vllm.get('block_size')} tokens, "
                               f"the prompts {lengths} tokens; log {run.log_path}: {run.log_lines}")
    return keys


class EngineFailed(RuntimeError):
    """The vLLM engine did not come up or did not finish (the log tail says why)."""


class NothingPublished(EngineFailed):
    """The engine ran, and no key reached the store: every test of its case fails with this first."""


def run_once(session, name: str, make):
    """``make()`` once per test session, kept in ``session.runs[name]``; an engine that failed is
    not started again: later tests that need it fail with its first error."""
    import pytest

    if name in session.failures:
        pytest.fail(f"engine {name} failed earlier in this session:\n{session.failures[name]}")
    if name not in session.runs:
        try:
            session.runs[name] = make()
        except (EngineFailed, subprocess.TimeoutExpired) as error:
            session.failures[name] = str(error)
            raise
    return session.runs[name]


def interesting_lines(text: str) -> list[str]:
    found = []
    for line in text.splitlines():
        for pattern in LOG_PATTERNS:
            match = re.search(pattern, line)
            if match and match.group(0) not in found:
                found.append(match.group(0).strip())
                break
    return found


@dataclass
class Scan:
    rc: int
    report: dict | None
    stderr: str
    argv: list[str]

    @property
    def records(self) -> list[dict]:
        return (self.report or {}).get("keys") or (self.report or {}).get("findings") or []

    def keys_with(self, verdict: str) -> set[str]:
        return {r["key"] for r in self.records if verdict in r.get("verdicts", [])}


def scan(config_path: Path, cluster, *extra: str, timeout_s: float = 120.0) -> Scan:
    """`mooncake-audit scan --config C --admin URL --format json --all EXTRA...`, as an operator runs it."""
    argv = [*cli_command(), "scan", "--config", str(config_path), "--admin", cluster.admin_url,
            "--format", "json", "--all", "--no-progress", *extra]
    env = _clean_env()
    process = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
    try:
        report = json.loads(process.stdout) if process.stdout.strip() else None
    except json.JSONDecodeError:
        report = None
    return Scan(process.returncode, report, process.stderr, argv)


def remove_when_unleased(publisher, key: str, timeout_s: float = 60) -> None:
    """Remove `key` once the leases of the reads before it (a test's, the audit's) have expired:
    Mooncake refuses to remove a leased key (-706)."""
    deadline = time.monotonic() + timeout_s
    while (code := publisher.remove(key)) == -706 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert code == 0, (key, code)


def read_records(directory: Path) -> list[dict]:
    """Every line the recorder plugin wrote (all processes), in file then line order; not the prefix
    records (per chunk hash, not per key: `audit.prefixrecords`)."""
    lines = []
    for path in sorted(p for p in directory.rglob("*.jsonl") if not p.name.startswith("prefixes-")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip():
                record = json.loads(line)
                record["_source"] = f"{path.name}:{number}"
                lines.append(record)
    return lines


def first_successful_put(records: list[dict]) -> dict[str, dict]:
    """Per key, the record of the put that stored it: the first with rc 0 and not withheld.

    Mooncake keeps a key's first copy (a later put of an existing key returns 0 and changes nothing),
    so this is the put whose bytes the store holds (FACTS §7)."""
    first: dict[str, dict] = {}
    for record in sorted(records, key=lambda r: r.get("time", 0)):
        if record.get("rc") == 0 and not record.get("withheld") and record["key"] not in first:
            first[record["key"]] = record
    return first


def key_sizes(cluster, keys: list[str]) -> dict[str, int]:
    """Value sizes from the master's lease-free `/batch_query_keys` (no read, no lease)."""
    sizes: dict[str, int] = {}
    for start in range(0, len(keys), 200):
        chunk = keys[start:start + 200]
        query = ",".join(urllib.parse.quote(k, safe="@:") for k in chunk)
        with urllib.request.urlopen(f"{cluster.admin_url}/batch_query_keys?keys={query}", timeout=10) as response:
            document = json.loads(response.read())
        for key, answer in (document.get("data") or {}).items():
            replicas = answer.get("values") or []
            if answer.get("ok") and replicas:
                sizes[key] = int(replicas[0]["size_"])
    return sizes


KEY_RE = re.compile(r"^(?:(?P<prefix>.*)@)?(?P<model>[^@]+)@tp_rank:(?P<tp>\d+)@pcp(?P<pcp>\d+)@dcp(?P<dcp>\d+)"
                    r"@pp_rank:(?P<pp>\d+)(?:@group:(?P<group>\d+))?@(?P<hash>[0-9a-f]+)$")


def key_pattern(key: str) -> str:
    """The key with its varying fields replaced: model@tp_rank:{t}@...@group:{g}@{hash}."""
    match = KEY_RE.match(key)
    if not match:
        return "unparsed: " + key
    group = "" if match["group"] is None else "@group:{g}"
    return f"{match['model']}@tp_rank:{{t}}@pcp{match['pcp']}@dcp{match['dcp']}@pp_rank:{match['pp']}{group}@{{{len(match['hash'])} hex}}"


def key_fields(key: str) -> dict:
    match = KEY_RE.match(key)
    return {} if not match else {"model": match["model"], "tp_rank": int(match["tp"]),
                                 "group": None if match["group"] is None else int(match["group"]),
                                 "hash": match["hash"]}


REMOVE_SCRIPT = """
import sys
from pathlib import Path
from audit.connection import Settings, open_store
store = open_store(Settings.resolve(config=Path(sys.argv[1])))
print(store.remove(sys.argv[2], True))
store.close()
"""


def remove_key(config_path: Path, key: str, timeout_s: float = 60.0) -> int:
    """`MooncakeDistributedStore.remove(key, force=True)` from a client of its own (a member evicted
    or never put, as a test plants it); the return code (0: removed)."""
    process = subprocess.run([sys.executable, "-c", REMOVE_SCRIPT, str(config_path), key], cwd=REPO,
                             env=_clean_env(), capture_output=True, text=True, timeout=timeout_s)
    if process.returncode != 0:
        raise RuntimeError(f"remove {key!r} failed: {process.stderr.strip()[-500:]}")
    return int(process.stdout.strip().splitlines()[-1])


PLANT_SCRIPT = """
import json, sys
from pathlib import Path
from audit.connection import Settings, open_store
store = open_store(Settings.resolve(config=Path(sys.argv[1])))
for copy in json.loads(sys.argv[2]):
    value = bytearray(store.get(copy["source"]))
    assert value, copy["source"]
    for offset, length in copy["zero"]:
        value[offset:offset + length] = bytes(length)
    rc = store.put(copy["key"], bytes(value))
    assert rc == 0, (copy["key"], rc)
store.close()
"""


def plant_copies(config_path: Path, copies: list[dict], timeout_s: float = 60.0) -> None:
    """Put each ``{"source", "key", "zero": [[offset, length], ...]}``: a copy of a real key's value
    under a new key, with those byte ranges zeroed, from a client of its own (a fault planted beside
    what the producer published)."""
    process = subprocess.run([sys.executable, "-c", PLANT_SCRIPT, str(config_path), json.dumps(copies)], cwd=REPO,
                             env=_clean_env(), capture_output=True, text=True, timeout=timeout_s)
    if process.returncode != 0:
        raise RuntimeError(f"planting {len(copies)} keys failed: {process.stderr.strip()[-800:]}")


FILLER_SCRIPT = """
import sys, time
from pathlib import Path
from audit.connection import Settings, open_store
store = open_store(Settings.resolve(config=Path(sys.argv[1])))
action, keys, size = sys.argv[2], sys.argv[3].split(","), int(sys.argv[4])
for key in keys:
    deadline = time.monotonic() + 30
    while True:
        rc = store.put(key, bytes([1]) * size) if action == "put" else store.remove(key, True)
        if rc != -200 or time.monotonic() > deadline:  # -200: the segment is full while eviction catches up
            break
        time.sleep(0.05)
    assert rc == 0, (action, key, rc)
store.close()
"""


def filler(config_path: Path, action: str, keys: list[str], value_bytes: int = 1 << 20,
           timeout_s: float = 120.0) -> None:
    """Another tenant's traffic, from a client of its own: `put` fills the holder's segment with
    `keys` (so that Mooncake evicts the oldest values, to the disk on a tiered store), `remove`
    takes them out again."""
    process = subprocess.run([sys.executable, "-c", FILLER_SCRIPT, str(config_path), action, ",".join(keys),
                              str(value_bytes)], cwd=REPO, env=_clean_env(), capture_output=True, text=True,
                             timeout=timeout_s)
    if process.returncode != 0:
        raise RuntimeError(f"filler {action} of {len(keys)} keys failed: {process.stderr.strip()[-800:]}")
