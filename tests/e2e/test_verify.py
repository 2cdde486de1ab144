"""`mooncake-audit verify` on a real vLLM (issue #16): production states compared with a reference
producer's recomputation, on the tiny Mamba2 model of the harness (float32, align mode, block 16).

Eight vLLM runs in all (each in its own process, in-process engine core):
  cluster A: a clean production run; the reference run, driven by `verify --engine`; a production
             run with other weights (a second seed) under the same model name, published under a
             cache prefix of its own;
  cluster B: production with vLLM #53084 put back; the reference namespace copied from cluster A
             (a reference published beforehand);
  cluster C: second-order damage (issue #29): a #53084 writer, then a second kv_both engine with the
             bug that extends writer prompts, loads a zero key and publishes non-zero wrong states;
             `verify --engine` with every prompt both ran, without the cuts and with them (default).
The measured noise floor is written to verify_observed.json beside this file (docs/verify.md).
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e import harness
from tests.e2e.conftest import MAMBA2_BLOCK, READER_CHUNKS, exact_prefix_prompts, writer_prompts

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
    return harness.make_model(out, MODEL, seed)


def extension_prompts() -> list[list[int]]:
    """Writer i cut at its chunk READER_CHUNKS[i] (an interior chunk: null-backed in a #53084 writer's
    store) then three fresh full blocks and 5 tokens: a kv_both engine loads the zero state there and
    computes the new chunks on from it (second-order damage)."""
    rng = random.Random(5308429)
    return [w[:k * MAMBA2_BLOCK] + [rng.randrange(3, 512) for _ in range(3 * MAMBA2_BLOCK + 5)]
            for w, k in zip(writer_prompts(), READER_CHUNKS)]


def expected_requests(prompts: list[list[int]], block: int) -> int:
    """What the driver should run, counted here independently of it: per distinct prompt, one cut one
    token after each boundary and the whole prompt (when it is not the last cut), each distinct cut once."""
    cuts = set()
    for prompt in prompts:
        cuts.update(tuple(prompt[:k * block + 1]) for k in range(1, (len(prompt) - 1) // block + 1))
        cuts.add(tuple(prompt))
    return len(cuts)


def _verify(config: Path, cluster, model_dir: Path, *extra: str, timeout_s: float = 300,
            reference_prefix: str = REF) -> tuple[int, dict, str]:
    argv = [*harness.cli_command(), "verify", "--config", str(config), "--admin", cluster.admin_url,
            "--model-config", str(model_dir), "--reference-prefix", reference_prefix, "--format", "json", "--all",
            *extra]
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
    if s.observed:  # merged: a run of some of the tests keeps the others' measurements
        previous = json.loads(OBSERVED.read_text()) if OBSERVED.exists() else {}
        OBSERVED.write_text(json.dumps({**previous, **s.observed}, indent=2) + "\n")


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
    # prompts cut by hand are not cut again: each already ends one token after a boundary
    assert summary["reference_run"]["requests"] == len(boundary_prompts())
    assert summary["reference_run"]["cut_at_boundaries"] and summary["reference_run"]["block_size"] == 16
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
                                "max_num_seqs": 8, "cut_at_boundaries": False,  # a production: prompts as given
                                "out": str(state.root / "a" / "seed2.out.json")}))
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
        donor_bytes, victim_bytes = store.get(donor), store.get(victim)
    finally:
        store.close()
    publisher = Publisher(settings)
    try:
        harness.remove_when_unleased(publisher, victim)
        publisher.put(victim, donor_bytes)
        code, document, _ = _verify(config, cluster, state.models, "--match", "^" + MODEL + "@")
    finally:  # cluster A's production is every later test's too (the busy host compares with the idle run)
        harness.remove_when_unleased(publisher, victim)
        publisher.put(victim, victim_bytes)
        publisher.close()
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


# ---- second-order damage (issue #29 item 5): keys no byte check can see -------------------------------


def _values(config: Path, cluster, keys) -> dict[str, bytes]:
    from audit.connection import Settings, open_store

    store = open_store(Settings.resolve(config=config, admin=cluster.admin_url, local_hostname="127.0.0.1"))
    try:
        return {key: bytes(store.get(key)) for key in keys}
    finally:
        store.close()


def _records(directory: Path, kind: str) -> list[dict]:
    return [r for r in harness.read_records(directory) if r["_source"].startswith(kind + "-")]


@pytest.fixture(scope="module")
def second_order(state):
    """Cluster C: a #53084 writer, then a kv_both extender with the bug on; then `verify --engine`
    with the prompts both ran (the production log), first without the cuts, then with them."""
    cluster, config = state.cluster("c")
    work = state.root / "c"
    writer_records, extender_records = work / "records-writer", work / "records-extender"
    writer = harness.run_engine(state.models, config, [writer_prompts()], work, max_tokens=4, bug=True,
                                retention_none=True, record_dir=writer_records, drain=True, name="writer", **ENGINE)
    after_writer = set(harness.all_keys(cluster))
    extender = harness.run_engine(state.models, config, [extension_prompts()], work, max_tokens=4, bug=True,
                                  retention_none=True, record_dir=extender_records, drain=True, name="extender",
                                  **ENGINE)
    production = {k for k in harness.all_keys(cluster) if k.startswith(MODEL + "@")}
    values = _values(config, cluster, sorted(production))
    prompts = work / "prompts.jsonl"
    logged = writer_prompts() + extension_prompts()
    prompts.write_text("".join(json.dumps(p) + "\n" for p in logged))
    common = ("--engine", sys.executable, "--prompts", str(prompts), "--engine-arg", 'dtype="float32"',
              "--block-tables", str(writer_records), "--block-tables", str(extender_records), "--prefix", MODEL + "@")
    runs = {}
    for name, prefix, extra in (("no_cuts", "verify-nocut", ("--no-cut-at-boundaries",)), ("cuts", REF, ())):
        started = time.monotonic()
        code, document, stderr = _verify(config, cluster, state.models, *common, *extra, reference_prefix=prefix,
                                         timeout_s=600)
        runs[name] = {"code": code, "document": document, "stderr": stderr,
                      "wall_s": round(time.monotonic() - started, 1)}
    return {"cluster": cluster, "config": config, "production": production, "after_writer": after_writer,
            "values": values, "writer_records": writer_records, "extender_records": extender_records,
            "runs": runs, "logged": logged, "engine_s": {"writer": writer.wall_s, "extender": extender.wall_s}}


def test_second_order_damage_every_wrong_key_is_divergent_and_every_key_has_a_twin(state, second_order):
    production, values = second_order["production"], second_order["values"]
    zero = {key for key, value in values.items() if value.count(0) == len(value)}
    extender_keys = production - second_order["after_writer"]
    # ground truth from the extender's own records: every request it served loaded keys, all zero
    loads = [r for r in _records(second_order["extender_records"], "loads") if r.get("rc", -1) >= 0]
    by_request: dict[str, set] = {}
    for record in loads:
        by_request.setdefault(record["request_id"], set()).add(record["key"])
    assert len(by_request) == len(extension_prompts()), sorted(by_request)
    assert set().union(*by_request.values()) <= zero, "an extender request loaded a non-zero key"
    puts = harness.first_successful_put(_records(second_order["extender_records"], "blocks"))
    assert extender_keys <= set(puts), "a new key the extender's recorder did not record"
    wrong = extender_keys - zero            # published after loading an all-zero state: non-zero, wrong
    good = production - zero - wrong
    assert wrong, "the extender published no non-zero state: the second-order case did not happen"
    assert good, "no good key to compare against"

    cut = second_order["runs"]["cuts"]
    document, summary = cut["document"], cut["document"]["summary"]["verify"]
    flagged = _divergent(document)
    compared = {r["key"] for r in document["keys"]}
    unlisted = {entry["key"] for entry in summary["unverified_keys"]}
    run = summary["reference_run"]

    before = second_order["runs"]["no_cuts"]
    before_summary = before["document"]["summary"]["verify"]
    state.observed["second_order"] = {
        "production_keys": len(production), "zero": len(zero), "wrong_nonzero": len(wrong), "good": len(good),
        "extender_requests_loading_zero": len(by_request), "engine_s": second_order["engine_s"],
        "no_cuts": {"pairs_compared": before_summary["pairs_compared"], "unverified": before_summary["unverified"],
                    "flagged": len(_divergent(before["document"])),
                    "wrong_flagged": len(wrong & _divergent(before["document"])),
                    "reference_requests": before_summary["reference_run"]["requests"],
                    "reference_keys": before_summary["reference_keys"], "wall_s": before["wall_s"],
                    "token_counts": before_summary["reference_run"]["token_counts"],
                    "engine_seconds": before_summary["reference_run"]["seconds"],
                    "unverified_reasons": before_summary["unverified_reasons"]},
        "cuts": {"pairs_compared": summary["pairs_compared"], "unverified": summary["unverified"],
                 "flagged": len(flagged), "wrong_flagged": len(wrong & flagged), "good_flagged": len(good & flagged),
                 "reference_requests": run["requests"], "reference_keys": summary["reference_keys"],
                 "reference_without_twin": summary["reference_without_twin"], "block_size": run["block_size"],
                 "block_size_from": run["block_size_from"].split()[0], "token_counts": run["token_counts"],
                 "engine_seconds": run["seconds"], "wall_s": cut["wall_s"], "noise_floor": summary["noise_floor"],
                 "wrong": sorted([r["evidence"]["divergent_state"]["max_rel_l2"],
                                  r["evidence"]["divergent_state"]["min_cosine"]]
                                 for r in document["findings"] if r["key"] in wrong)}}

    # the cuts: the block size came from the producer's manifest, each distinct cut ran once
    assert run["cut_at_boundaries"] and run["block_size"] == MAMBA2_BLOCK
    assert run["block_size_from"].startswith("manifest "), run["block_size_from"]
    assert run["prompts"] == len(second_order["logged"])
    assert run["requests"] == expected_requests(second_order["logged"], MAMBA2_BLOCK)
    # every production key has a twin; were one without, the summary would name it
    assert compared | unlisted == production and not compared & unlisted
    assert summary["unverified"] == len(unlisted) == 0, summary["unverified_keys"][:3]
    assert summary["pairs_compared"] == len(production) and summary["pairs_compared_bytes_only"] == 0
    # the goal: every wrong non-zero key is DIVERGENT_STATE, no good key is (zero keys are too)
    assert wrong <= flagged, sorted(wrong - flagged)
    assert not good & flagged, sorted(good & flagged)
    assert flagged == zero | wrong
    assert cut["code"] == 1
    assert summary["noise_floor"]["over"] == len(good) and summary["noise_floor"]["max_rel_l2"] <= 1e-3


def test_second_order_without_the_cuts_names_every_key_without_a_twin(state, second_order):
    from audit.verify.pairing import NOT_CUT

    production = second_order["production"]
    before = second_order["runs"]["no_cuts"]
    document, summary = before["document"], before["document"]["summary"]["verify"]
    compared = {r["key"] for r in document["keys"]}
    unlisted = {entry["key"] for entry in summary["unverified_keys"]}
    # only each prompt's last boundary is published: one key per distinct prompt
    assert summary["reference_run"]["requests"] == len(second_order["logged"])
    assert summary["reference_keys"] == len(second_order["logged"])
    assert 0 < summary["unverified"] == len(production) - len(compared)
    assert summary["unverified"] <= 100 and unlisted == production - compared
    assert summary["unverified_reasons"] == {NOT_CUT: summary["unverified"]}


# ---- a busy host (issue #42): most of the memory held by another process ---------------------------------

HOLD_SCRIPT = """
import sys, time
import numpy as np
from vllm.utils.cpu_resource_utils import get_memory_node_info
leave = int(sys.argv[1])
held = np.ones(max(0, get_memory_node_info(0).available_memory - leave), dtype=np.uint8)  # every page touched
node = get_memory_node_info(0)
print(held.nbytes, node.available_memory, node.total_memory, flush=True)
time.sleep(3600)
"""
LEAVE_FREE = 3 << 30   # what the holder leaves on node 0: room for a reference sized to its work
DEFAULT_SHARE = 0.92   # vLLM's gpu_memory_utilization: on the CPU, the share of node 0 it checks for


@pytest.fixture(scope="module")
def busy_host(state, cluster_a):
    """A process holding all but LEAVE_FREE of the memory vLLM's CPU worker counts as available on
    node 0 (its own measure), while `verify --engine` runs as an operator runs it: no
    VLLM_CPU_KVCACHE_SPACE, vLLM's default multi-process engine."""
    holder = subprocess.Popen([sys.executable, "-c", HOLD_SCRIPT, str(LEAVE_FREE)], stdout=subprocess.PIPE,
                              text=True, env=harness._clean_env())
    try:
        held, available, total = map(int, holder.stdout.readline().split())
        yield {"held": held, "available": available, "total": total}
    finally:
        holder.kill()
        holder.wait()


def _verify_as_operator(config: Path, cluster, model_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    argv = [*harness.cli_command(), "verify", "--config", str(config), "--admin", cluster.admin_url,
            "--model-config", str(model_dir), "--format", "json", "--all", *extra]
    env = harness._clean_env()  # no VLLM_CPU_KVCACHE_SPACE; the engine core in-process, as the idle run's
    env.update(VLLM_HOST_IP="127.0.0.1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    return subprocess.run(argv, cwd=harness.REPO, env=env, capture_output=True, text=True, timeout=600)


def test_verify_on_a_busy_host_gives_the_idle_hosts_verdicts(state, cluster_a, busy_host):
    """The reference engine takes only what its prompts need: with most of node 0 held, `verify
    --engine` gives the verdicts of the idle run (cluster A's); an engine asking for vLLM's default
    share fails there, and the error is vLLM's own reason, in one line."""
    cluster, config, production, (_, idle, _) = cluster_a
    assert busy_host["available"] < DEFAULT_SHARE * busy_host["total"], busy_host  # the host really is busy
    prompts = state.root / "a" / "prompts.jsonl"
    common = ("--engine", sys.executable, "--prompts", str(prompts), "--engine-arg", 'dtype="float32"',
              "--block-size", "16", "--match", "^" + MODEL + "@")  # production's keys: not the references'
    busy = _verify_as_operator(config, cluster, state.models, "--reference-prefix", "verify-busy", *common)
    document = json.loads(busy.stdout) if busy.stdout.strip() else {}
    assert busy.returncode == 0, (busy.stderr[-2000:], [(r["key"], r["evidence"]) for r in document.get("findings", [])])
    summary, idle_summary = document["summary"]["verify"], idle["summary"]["verify"]
    state.observed["busy_host"] = {**busy_host, "exit_code": busy.returncode,
                                   "memory": summary["reference_run"].get("memory"),
                                   "wall_s": summary["reference_run"].get("wall_s")}
    for field in ("pairs", "pairs_compared", "unverified", "divergent", "reference_keys", "reference_without_twin"):
        assert summary[field] == idle_summary[field], (field, summary[field], idle_summary[field])
    verdicts = {r["key"]: r["verdicts"] for r in document["keys"]}
    assert verdicts == {r["key"]: r["verdicts"] for r in idle["keys"]} and set(verdicts) == set(production)
    assert summary["reference_run"]["memory"]["num_gpu_blocks_override"] > 0

    greedy = _verify_as_operator(config, cluster, state.models, "--reference-prefix", "verify-greedy", *common,
                                 "--engine-arg", f"gpu_memory_utilization={DEFAULT_SHARE}")
    error = [line for line in greedy.stderr.splitlines() if line.startswith("mooncake-audit: error:")]
    state.observed["busy_host"]["default_share_error"] = error
    assert greedy.returncode == 2 and "Traceback" not in greedy.stderr, greedy.stderr[-2000:]
    assert len(error) == 1 and "ValueError: Available memory on node" in error[0], greedy.stderr[-2000:]
