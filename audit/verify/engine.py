"""Driving a reference producer (`verify --engine PYTHON --prompts FILE`): the operator's python,
which has vLLM, runs `audit/verify/driver.py` in a child process. Nothing here imports vLLM."""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
import time
from pathlib import Path

from audit.connection import Settings
from audit.errors import AuditError

DRIVER = Path(__file__).with_name("driver.py")


def read_prompts(path: Path) -> list[list[int]]:
    """Prompts as token ids, one per JSONL line: ``[1, 2, 3]`` or an object with ``prompt_token_ids``
    (or ``token_ids``/``tokens``). Blank lines are skipped."""
    prompts = []
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as error:
        raise AuditError(f"cannot read prompts {path}: {error.strerror}") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as error:
            raise AuditError(f"{path}:{number}: not JSON ({error.msg})") from None
        if isinstance(item, dict):
            item = item.get("prompt_token_ids") or item.get("token_ids") or item.get("tokens")
        if not isinstance(item, list) or not item or not all(isinstance(t, int) and t >= 0 for t in item):
            raise AuditError(f"{path}:{number}: a prompt must be a non-empty list of token ids")
        prompts.append(item)
    if not prompts:
        raise AuditError(f"{path}: no prompts")
    return prompts


def manifest_groups(manifests, model: str) -> list[tuple[dict, object]]:
    """(group, manifest) for every group with a block size in the producer's manifests of `model`
    (`ProducerManifests` from ``--block-tables``, or None)."""
    return [(group, manifest) for manifest in (manifests.manifests if manifests is not None else ())
            if manifest.document.get("model") == model
            for group in manifest.document.get("groups") or () if group.get("block_size")]


def cut_block_size(operator_block_size: int | None, manifests, model: str) -> tuple[int | None, str]:
    """The block size the reference driver cuts prompts at, and where it came from: the operator's
    ``--block-size``; else the producer's manifest: the smallest block of the model's Mamba groups
    (a hybrid raises its attention block; FACTS §8), or of any group where it has none; else None:
    the driver takes its engine's own after start-up."""
    if operator_block_size:
        return int(operator_block_size), "--block-size"
    groups = manifest_groups(manifests, model)
    mamba = [(group, manifest) for group, manifest in groups if group.get("states") or group.get("mamba_type")]
    if mamba or groups:
        group, manifest = min(mamba or groups, key=lambda item: int(item[0]["block_size"]))
        return int(group["block_size"]), f"manifest {manifest.path} (group {group.get('group')})"
    return None, "engine"


def manifest_engine_block_size(manifests, model: str) -> int | None:
    """The block size the producer's engine ran with, when its manifests give one for every group
    (the reference must run with it: chunk hashes are per block); None when they differ or are absent."""
    sizes = {int(group["block_size"]) for group, _ in manifest_groups(manifests, model)}
    return sizes.pop() if len(sizes) == 1 else None


def mooncake_config_for(settings: Settings, config: Path | None, work: Path) -> Path:
    """The connector's JSON config: the operator's (--config), else one written from the settings."""
    if config is not None:
        return Path(config)
    path = work / "mooncake.json"
    path.write_text(json.dumps({"metadata_server": settings.metadata, "master_server_address": settings.master,
                                "protocol": settings.protocol, "device_name": settings.device_name,
                                "mode": "standalone-store", "global_segment_size": 0,
                                "local_buffer_size": "256MB"}))
    return path


# An exception line, bare or behind vLLM's prefixes: the process's ``(VllmWorker-0 pid=20983)`` and
# its logger's ``ERROR 12-03 08:21:23 [multiproc_executor.py:953]``.
_EXCEPTION_LINE = re.compile(r"^\s*(?:\([^()\s]+ pid=\d+\)\s*)?"
                             r"(?:[A-Z]+ \d\d-\d\d [\d:.]+ \[[^\]]*\]\s*)?"
                             r"([A-Za-z_][\w.]*(?:Error|Exception)): (.+)$")
_WRAPPERS = ("Engine core initialization failed", "See root cause above", "See stack trace for root cause",
             "WorkerProc initialization failed")


def root_cause(output: str) -> str:
    """vLLM's own reason an engine failed: the last exception line, whatever process logged it, that
    is not a wrapper ("Engine core initialization failed. See root cause above"); else the log's
    last lines."""
    causes = [f"{match[1]}: {match[2]}" for line in output.splitlines()
              if (match := _EXCEPTION_LINE.match(line)) and not any(w in match[2] for w in _WRAPPERS)]
    if causes:
        return causes[-1][-600:]
    return " | ".join(output.strip().splitlines()[-5:])[-600:]


def run_reference(python: str, spec: dict, settings: Settings, config: Path | None, *,
                  timeout_s: float = 3600.0, log=None) -> dict:
    """Run the driver with `python`; returns what it did (prompts, seconds). Its log goes to stderr."""
    with tempfile.TemporaryDirectory(prefix="mooncake-audit-verify-") as work:
        work = Path(work)
        spec = dict(spec, out=str(work / "out.json"))
        (work / "spec.json").write_text(json.dumps(spec))
        env = dict(os.environ, MOONCAKE_CONFIG_PATH=str(mooncake_config_for(settings, config, work)))
        env.setdefault("VLLM_HOST_IP", settings.local_hostname or "")
        if not env["VLLM_HOST_IP"]:
            env.pop("VLLM_HOST_IP")
        started = time.monotonic()
        try:
            process = subprocess.run([python, str(DRIVER), str(work / "spec.json")], env=env, cwd=work,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout_s)
        except FileNotFoundError:
            raise AuditError(f"--engine {python}: no such executable") from None
        except subprocess.TimeoutExpired:
            raise AuditError(f"the reference engine did not finish in {timeout_s:.0f} s") from None
        output = process.stdout.decode(errors="replace")
        if process.returncode != 0 or not (work / "out.json").exists():
            raise AuditError(f"the reference engine ({python}) exited {process.returncode}: {root_cause(output)}")
        if log is not None:
            log(output)
        result = json.loads((work / "out.json").read_text())
    result["wall_s"] = round(time.monotonic() - started, 1)
    return result
