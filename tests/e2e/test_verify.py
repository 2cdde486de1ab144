"""`mooncake-audit verify` on a real vLLM (issue #16): production states compared with a reference
producer's recomputation, on the tiny Mamba2 model of the harness (float32, align mode, block 16).

Four vLLM runs in all (each in its own process, in-process engine core):
  cluster A: a clean production run; the reference run, driven by `verify --engine`; a production
             run with other weights (a second seed) under the same model name, published under a
             cache prefix of its own;
  cluster B: production with vLLM #53084 put back; the reference namespace copied from cluster A
             (a reference published beforehand).
The measured noise floor is written to verify_observed.json beside this file (docs/verify.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e import harness
from tests.e2e.conftest import MAMBA2_BLOCK, exact_prefix_prompts, writer_prompts

MODEL = "mamba2-tiny"
REF = "verify-ref"
SEED2 = "seed2"
OBSERVED = Path(__file__).with_name("verify_observed.json")
ENGINE = dict(mamba=True, block_size=MAMBA2_BLOCK, dtype="float32")


def boundary_prompts() -> list[list[int]]:
    """Every writer prompt cut one token after each of its chunk boundaries: the reference publishes
    the state at each boundary (a prompt ending exactly on a boundary publishes the one before it, as
    measured), so production's interior keys (the #53084 ones) have twins too."""
    prompts = []
    for prompt in writer_prompts():
        prompts += [prompt[:k * MAMBA2_BLOCK + 1] for k in range(1, len(prompt) // MAMBA2_BLOCK + 1)]
    return prompts


def _engine_env(config: Path | None = None) -> dict:
    env = harness._clean_env()
    env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_HOST_IP="127.0.0.1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    if config is not None:
        env["MOONCAKE_CONFIG_PATH"] = str(config)
    return env


def _make_model(out: Path, seed: int) -> Path:
    """The harness's tiny Mamba2 (tests/e2e/models.py), with the weights of `seed`."""
    code = ("import sys, torch, json; from pathlib import Path; import tests.e2e.models as m; "
            "real = torch.manual_seed; torch.manual_seed = lambda s: real(int(sys.argv[2])); "
            "print(m.make(m.MODELS[sys.argv[3]], Path(sys.argv[1])))")
    subprocess.run([sys.executable, "-c", code, str(out), str(seed), MODEL], check=True, capture_output=True,
                   timeout=300, cwd=harness.REPO, env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    return out / MODEL


def _verify(config: Path, cluster, model_dir: Path, *extra: str, timeout_s: float = 300) -> tuple[int, dict, str]:
    argv = [*harness.cli_command(), "verify", "--config", str(config), "--admin", cluster.admin_url,
            "--model-config", str(model_dir), "--reference-prefix", REF, "--format", "json", "--all", *extra]
    process = subprocess.run(argv, cwd=harness.REPO, env=_engine_env(), capture_output=True, text=True,
                             timeout=timeout_s)
    assert process.returncode in (0, 1, 3), f"exit {process.returncode}: {process.stderr[-2000:]}"
    return process.returncode, json.loads(process.stdout), process.stderr


def _divergent(document: dict) -> set[str]:
    return {r["key"] for r in document["findings"] if "DIVERGENT_STATE" in r["verdicts"]}


class State:
    def __init__(self, root: Path):
        self.root, self.observed, self.clusters = root, {}, []

    def cluster(self, name: str):
        from audit.cluster import LocalCluster

        (self.root / name).mkdir(parents=True, exist_ok=True)
        cluster = LocalCluster(holders=1, segment_mb=256, log_dir=self.root / name)
        self.clusters.append(cluster)
        cluster.start()
        return cluster, harness.mooncake_config(cluster, self.root / name / "mooncake.json")


@pytest.fixture(scope="module")
def state(tmp_path_factory):
    s = State(tmp_path_factory.mktemp("verify"))
    s.models = _make_model(tmp_path_factory.mktemp("models-seed0"), 0)
    yield s
    for cluster in s.clusters:
        cluster.stop()
    if s.observed:
        OBSERVED.write_text(json.dumps(s.observed, indent=2) + "\n")


@pytest.fixture(scope="module")
def cluster_a(state):
    """Clean production, then `verify --engine` publishing the reference and comparing."""
    cluster, config = state.cluster("a")
    run = harness.run_engine(state.models, config, [writer_prompts()], state.root / "a", max_tokens=4,
                             name="production", **ENGINE)
    production = harness.all_keys(cluster)
    prompts = state.root / "a" / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in boundary_prompts()))
    code, document, stderr = _verify(config, cluster, state.models, "--engine", sys.executable, "--prompts",
                                     str(prompts), "--engine-arg", 'dtype="float32"', "--block-size", "16",
                                     timeout_s=600)
    state.observed["clean"] = {"production_keys": len(production), "production_engine_s": run.wall_s,
                               "exit_code": code, "verify": document["summary"]["verify"]}
    return cluster, config, production, (code, document, stderr)


def test_clean_production_matches_its_reference(state, cluster_a):
    _, _, production, (code, document, stderr) = cluster_a
    summary = document["summary"]["verify"]
    assert summary["reference_run"]["prompts"] == len(boundary_prompts())
    assert summary["reference_keys"] == len(boundary_prompts())
    assert summary["pairs"] == len(production) == summary["production_keys"], summary
    assert summary["unverified"] == 0 and summary["pairs_compared"] == len(production)
    assert summary["reference_without_twin"] == len(boundary_prompts()) - len(production)
    assert summary["pairs_compared_bytes_only"] == 0, "a layout must fit every pair"
    assert not _divergent(document) and code == 0, document["findings"][:2]
    floor = summary["noise_floor"]
    assert floor["over"] == len(production)
    assert floor["max_rel_l2"] <= 1e-3 and floor["min_cosine"] >= 0.9999, floor


def test_other_weights_under_the_same_name_flag_every_twin(state, cluster_a):
    cluster, config, _, _ = cluster_a
    seed2 = _make_model(state.root / "models-seed2", 1)
    spec = state.root / "a" / "seed2.json"
    spec.write_text(json.dumps({"model": str(seed2), "prompts": writer_prompts(), "cache_prefix": SEED2,
                                "block_size": MAMBA2_BLOCK, "dtype": "float32", "mamba_cache_mode": "align",
                                "max_num_seqs": 8, "out": str(state.root / "a" / "seed2.out.json")}))
    subprocess.run([sys.executable, "-m", "audit.verify.driver", str(spec)], cwd=harness.REPO, check=True,
                   env=_engine_env(config), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=400)
    seed2_keys = {k for k in harness.all_keys(cluster) if k.startswith(SEED2 + "@")}
    assert len(seed2_keys) == len(writer_prompts())
    code, document, _ = _verify(config, cluster, state.models, "--prefix", SEED2 + "@")
    summary = document["summary"]["verify"]
    state.observed["second_seed"] = {"flagged": len(_divergent(document)), "keys": len(seed2_keys),
                                     "worst": sorted(r["evidence"]["divergent_state"]["max_rel_l2"]
                                                     for r in document["findings"])[:1],
                                     "min_cosine": [r["evidence"]["divergent_state"]["min_cosine"]
                                                    for r in document["findings"]]}
    assert code == 1 and summary["pairs"] == len(seed2_keys)
    assert _divergent(document) == seed2_keys


def test_a_key_holding_another_keys_bytes_is_flagged_exactly(state, cluster_a):
    from audit.connection import Settings, open_store
    from audit.workload import Publisher

    cluster, config, production, _ = cluster_a
    settings = Settings.resolve(config=config, admin=cluster.admin_url, local_hostname="127.0.0.1")
    victim, donor = sorted(production)[:2]
    store = open_store(settings)
    try:
        donor_bytes = store.get(donor)
    finally:
        store.close()
    publisher = Publisher(settings)
    try:
        assert publisher.remove(victim) == 0
        publisher.put(victim, donor_bytes)
    finally:
        publisher.close()
    code, document, _ = _verify(config, cluster, state.models, "--match", "^" + MODEL + "@")
    state.observed["swapped"] = {"flagged": sorted(_divergent(document)), "victim": victim}
    assert code == 1
    assert _divergent(document) == {victim}
    assert document["summary"]["verify"]["pairs"] == len(production)


def test_53084_null_backed_keys_are_flagged_exactly(state, cluster_a):
    from audit.connection import Settings, open_store
    from audit.workload import Publisher

    cluster_ref, config_ref, _, _ = cluster_a
    cluster, config = state.cluster("b")
    records = state.root / "b" / "records"
    harness.run_engine(state.models, config, [writer_prompts(), exact_prefix_prompts()], state.root / "b",
                       max_tokens=8, bug=True, retention_none=True, record_dir=records, name="bug", **ENGINE)
    production = harness.all_keys(cluster)
    stored = harness.first_successful_put(harness.read_records(records))
    truth = {k for k in production if 0 in stored[k]["block_ids"]}
    assert truth, "the bug did not fire"
    # the reference namespace, published beforehand: copied from cluster A
    reference = [k for k in harness.all_keys(cluster_ref) if k.startswith(REF + "@")]
    source = open_store(Settings.resolve(config=config_ref, admin=cluster_ref.admin_url, local_hostname="127.0.0.1"))
    target = Publisher(Settings.resolve(config=config, admin=cluster.admin_url, local_hostname="127.0.0.1"))
    try:
        for key in reference:
            target.put(key, source.get(key))
    finally:
        source.close()
        target.close()
    code, document, _ = _verify(config, cluster, state.models)
    summary = document["summary"]["verify"]
    flagged = _divergent(document)
    state.observed["bug_53084"] = {"production_keys": len(production), "null_backed": len(truth),
                                   "flagged": len(flagged), "pairs": summary["pairs"],
                                   "unverified": summary["unverified"], "noise_floor": summary["noise_floor"],
                                   "flagged_not_null_backed": sorted(flagged - truth)[:5]}
    assert summary["unverified"] == 0, summary["unverified_examples"]
    assert code == 1
    assert flagged == truth, (len(flagged), len(truth), sorted(flagged ^ truth)[:3])
