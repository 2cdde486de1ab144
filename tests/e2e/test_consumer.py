"""Issue #29: the harm of #53084 happens in the consumer, so the consumer is tested against a cold
baseline, the way the bug report tests a fix.

Per case (a pure Mamba2 and a GraniteMoeHybrid, both served in float32, at TP 1 and TP 2), on one
fresh cluster:
1. a producer with #53084 put back (``kv_both``, every block kept) publishes its prompts;
2. a cold engine (no connector, at TP 1: see `baseline`) answers the consumer prompts: the baseline;
3. a fresh consumer (``kv_role="kv_consumer"``, recorder on, no guard) answers them from the store:
   the requests whose hit ends on a zero key diverge from the baseline (the harness proves the bug
   is live), and ``impact`` on a scan of the store names exactly those requests;
4. a fresh guarded consumer (``MOONCAKE_AUDIT_LOAD_GUARD=1``, ``kv_load_failure_policy="recompute"``)
   answers every request as the baseline does.
After a healthy producer (TP 1), the guarded consumer refuses nothing and keeps every hit.

Consumer prompts are producer prompts cut at a chunk boundary plus three fresh tokens, one cut per
producer prompt (so no two consumer requests share a prefix a local cache could serve).
"""

from __future__ import annotations

import json
import random
import subprocess
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from tests.e2e import harness
from tests.e2e.models import ALL_MODELS

TOLERANCE = 1e-4   # a logprob this close to the baseline's is the same answer (healthy runs: within 1e-6)
MAX_TOKENS = 8


@dataclass(frozen=True)
class Case:
    model: str
    tp: int
    prompts: int          # producer prompts
    length: int           # producer prompt tokens
    cuts: tuple[int, ...]  # consumer i = producer i's first cuts[i] tokens + 3 fresh ones

    @property
    def name(self) -> str:
        return f"{self.model}-tp{self.tp}"


# Mamba2: 16-token blocks. Granite: vLLM raises the attention block to 256 tokens (the mamba state is
# checkpointed on those boundaries), so its cuts are multiples of 256 and a few between them.
MAMBA2_CUTS = (32, 48, 64, 80, 96, 112, 128, 144)
GRANITE_CUTS = (256, 512, 768, 1024, 384, 640, 896, 1024)
CASES = [Case("mamba2-tiny", 1, 8, 149, MAMBA2_CUTS), Case("mamba2-tiny", 2, 8, 149, MAMBA2_CUTS),
         Case("granite-4h-tiny", 1, 8, 1100, GRANITE_CUTS), Case("granite-4h-tiny", 2, 8, 1100, GRANITE_CUTS)]
HEALTHY = [case for case in CASES if case.tp == 1]
# An unguarded consumer at TP 2 once, on the hybrid (its records name requests from both ranks'
# loads); the pure Mamba2's TP 2 store is still read by a guarded consumer. CI time: a TP 2 engine.
UNGUARDED = [case for case in CASES if case.name != "mamba2-tiny-tp2"]


def producer_prompts(case: Case) -> list[list[int]]:
    rng = random.Random(29 + case.length)
    return [[rng.randrange(3, 512) for _ in range(case.length)] for _ in range(case.prompts)]


def consumer_prompts(case: Case) -> list[list[int]]:
    rng = random.Random(2929)
    return [prompt[:cut] + [rng.randrange(3, 512) for _ in range(3)]
            for prompt, cut in zip(producer_prompts(case), case.cuts)]


def _engine(session, models_dir: Path, case: Case, role: str, cluster_of: str | None, batches, **options):
    """Run (once per session) engine `role` of `case`: on `cluster_of`'s cluster, a fresh one, or none."""
    name = f"consumer-{case.name}-{role}"
    if name in session.failures:
        pytest.fail(f"engine {name} failed earlier in this session:\n{session.failures[name]}")
    if name in session.runs:
        return session.runs[name]
    spec = ALL_MODELS[case.model]
    work = session.root / name
    if cluster_of is None:
        cluster, config = session.cluster(name)
    elif cluster_of == "none":
        cluster, config = None, None
    else:
        base = session.runs.get(cluster_of)
        if base is None:
            pytest.skip(f"needs engine {cluster_of}, which did not run")
        cluster, config = base["cluster"], base["config"]
    record_dir = work / "records"
    try:
        run = harness.run_engine(models_dir / case.model, config, batches, work, mamba=spec.mamba,
                                 block_size=spec.block_size, record_dir=record_dir if config else None,
                                 tp=case.tp, dtype="float32", max_tokens=MAX_TOKENS, logprobs=5, name="engine",
                                 timeout_s=600, **options)
    except (harness.EngineFailed, subprocess.TimeoutExpired) as error:
        session.failures[name] = str(error)
        raise
    session.runs[name] = {"run": run, "cluster": cluster, "config": config, "records": record_dir, "work": work}
    return session.runs[name]


def producer(session, models_dir, case: Case, *, healthy: bool = False):
    return _engine(session, models_dir, case, "healthy-producer" if healthy else "buggy-producer", None,
                   [producer_prompts(case)], bug=not healthy, retention_none=True, drain=True)


def baseline(session, models_dir, case: Case):
    """The cold engine's answers, served at TP 1 for a TP 2 case too: measured on both models, a cold
    engine at TP 2 gives the same tokens as at TP 1, logprobs within 1.5e-6 (TOLERANCE is 1e-4), and
    a TP 2 engine costs a minute of CI here."""
    return _engine(session, models_dir, replace(case, tp=1), "cold", "none", [consumer_prompts(case)])


def consumer(session, models_dir, case: Case, *, guarded: bool, healthy: bool = False):
    store = f"consumer-{case.name}-{'healthy' if healthy else 'buggy'}-producer"
    producer(session, models_dir, case, healthy=healthy)
    role = f"{'healthy' if healthy else 'buggy'}-{'guarded' if guarded else 'unguarded'}"
    options = dict(kv_role="kv_consumer", kv_load_failure_policy="recompute") if guarded else dict(
        kv_role="kv_consumer")
    return _engine(session, models_dir, case, role, store, [consumer_prompts(case)], load_guard=guarded, **options)


def diverged(run, cold) -> dict[int, float]:
    """Request index -> the largest logprob gap to the baseline (inf where a token differs)."""
    gaps = {}
    for index, (tokens, logprobs, cold_tokens, cold_logprobs) in enumerate(zip(
            run.tokens(0), run.logprobs(0), cold.tokens(0), cold.logprobs(0))):
        if tokens != cold_tokens:
            gaps[index] = float("inf")
            continue
        gap = max((abs(a - b) for a, b in zip(logprobs, cold_logprobs)), default=0.0)
        if gap > TOLERANCE:
            gaps[index] = gap
    return gaps


def load_records(directory: Path) -> list[dict]:
    return [json.loads(line) for path in sorted(directory.rglob("loads-*.jsonl"))
            for line in path.read_text().splitlines() if line.strip()]


def impact(report: Path, *record_dirs: Path) -> tuple[int, dict | None, str]:
    argv = [*harness.cli_command(), "impact", str(report), "--format", "json"]
    for directory in record_dirs:
        argv += ["--block-tables", str(directory)]
    process = subprocess.run(argv, cwd=harness.REPO, capture_output=True, text=True, timeout=120)
    return process.returncode, json.loads(process.stdout) if process.stdout.strip() else None, process.stderr


@pytest.mark.parametrize("case", UNGUARDED, ids=lambda c: c.name)
def test_unguarded_consumers_of_a_buggy_store_diverge_and_impact_names_them(session, models_dir, case, tmp_path):
    cold = baseline(session, models_dir, case)["run"]
    buggy = producer(session, models_dir, case)
    unguarded = consumer(session, models_dir, case, guarded=False)
    run = unguarded["run"]

    gaps = diverged(run, cold)
    assert gaps, f"{case.name}: no consumer request diverged from the cold baseline: the bug is not live"
    assert any(run.cached(0)), "the consumer hit nothing in the store"

    scan = harness.scan(buggy["config"], buggy["cluster"], "--model-config", str(models_dir / case.model),
                        "--block-tables", str(buggy["records"]), timeout_s=300)
    assert scan.rc == 1 and scan.report, scan.stderr[-2000:]
    report = tmp_path / "report.json"
    report.write_text(json.dumps(scan.report))
    rc, document, stderr = impact(report, unguarded["records"], buggy["records"])
    assert rc == 1 and document, stderr[-2000:]
    named = {request for affected in document["affected"] for request in affected["request_ids"]}
    truth = {str(index) for index in gaps}
    assert named == truth, (f"{case.name}: impact named {sorted(named)}, diverged {sorted(truth)} "
                            f"(gaps {gaps}, cached {run.cached(0)})")
    assert document["summary"]["requests_affected"] == len(truth)
    assert all(record["request_id"] is not None for record in load_records(unguarded["records"]))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_guarded_consumers_of_a_buggy_store_equal_the_baseline(session, models_dir, case):
    cold = baseline(session, models_dir, case)["run"]
    guarded = consumer(session, models_dir, case, guarded=True)
    run = guarded["run"]

    assert diverged(run, cold) == {}, f"{case.name}: guarded requests still differ from the cold baseline"
    refusals = [r for r in load_records(guarded["records"]) if r.get("refused")]
    assert refusals, "the guard refused nothing, yet the store holds zero states"
    assert {r["reason"] for r in refusals} <= {"ZERO_STATE", "ZERO_VALUE", "DENIED", "NULL_BACKED"}
    assert any("mooncake-audit load guard: refused" in line for line in run.log_path.read_text().splitlines())


@pytest.mark.parametrize("case", HEALTHY, ids=lambda c: c.name)
def test_guarded_consumers_of_a_healthy_store_refuse_nothing_and_keep_every_hit(session, models_dir, case):
    cold = baseline(session, models_dir, case)["run"]
    unguarded = consumer(session, models_dir, case, guarded=False, healthy=True)["run"]
    guarded = consumer(session, models_dir, case, guarded=True, healthy=True)

    assert guarded["run"].cached(0) == unguarded.cached(0) and any(unguarded.cached(0))
    assert [r for r in load_records(guarded["records"]) if r.get("refused")] == []
    assert diverged(guarded["run"], cold) == {} and diverged(unguarded, cold) == {}


def test_a_guarded_consumer_refuses_another_requests_state_under_its_prefix(session, models_dir):
    """Issue #40 §4: a healthy store where one key's value is replaced by another request's state
    (finite, non-zero, of these weights). An unguarded consumer loading it diverges from the cold
    baseline; a guarded one refuses it as PREFIX_MISMATCH (its rows are images of other tokens than
    its request's own at that boundary), recomputes, and equals the baseline."""
    from audit.connection import Settings, open_store
    from audit.workload import Publisher

    case = HEALTHY[0]
    assert ALL_MODELS[case.model].block_size == 16 and case.model == "mamba2-tiny"
    cold = baseline(session, models_dir, case)["run"]
    store = producer(session, models_dir, case, healthy=True)
    prompts = producer_prompts(case)
    last = len(prompts[0]) // 16 * 16  # each producer prompt publishes its last boundary's state
    loader = case.cuts.index(last)     # the consumer request that loads one
    victim_hash = _block_hash(prompts[loader][:last])
    source_hash = _block_hash(prompts[(loader + 1) % len(prompts)][:last])
    by_hash = {key.rpartition("@")[2]: key for key in harness.all_keys(store["cluster"])}
    victim, source = by_hash[victim_hash], by_hash[source_hash]
    settings = Settings.resolve(config=store["config"], admin=store["cluster"].admin_url, local_hostname="127.0.0.1")
    reader = open_store(settings)
    try:
        foreign = reader.get(source)
    finally:
        reader.close()
    publisher = Publisher(settings)
    try:
        harness.remove_when_unleased(publisher, victim)
        publisher.put(victim, foreign)
    finally:
        publisher.close()
    name = f"consumer-{case.name}-healthy-producer"
    unguarded = _engine(session, models_dir, case, "swapped-unguarded", name, [consumer_prompts(case)],
                        kv_role="kv_consumer")
    guarded = _engine(session, models_dir, case, "swapped-guarded", name, [consumer_prompts(case)],
                      load_guard=True, kv_role="kv_consumer", kv_load_failure_policy="recompute")
    assert loader in diverged(unguarded["run"], cold), "the replaced state did not change the unguarded answer"
    refusals = [r for r in load_records(guarded["records"]) if r.get("refused")]
    assert {r["key"] for r in refusals if r["reason"] == "PREFIX_MISMATCH"} == {victim}, refusals
    assert {r["reason"] for r in refusals} <= {"PREFIX_MISMATCH", "DENIED"}
    assert diverged(guarded["run"], cold) == {}


def test_a_guarded_consumer_of_other_weights_refuses_every_hit_and_equals_its_own_cold_baseline(session, models_dir):
    """Issue #40 §4: the checkpoint was updated under the same model name, and the store still holds
    the old weights' states (the healthy producer's). A guarded consumer of the new weights refuses
    every one it loads as WEIGHTS_MISMATCH (its rows are no token's image under the consumer's own
    weights), recomputes, and answers as a cold engine of the new weights does."""
    case = HEALTHY[0]
    new_weights = harness.make_model(session.root / "consumer-new-weights", case.model, seed=1)
    producer(session, models_dir, case, healthy=True)
    store = f"consumer-{case.name}-healthy-producer"
    new_dir = new_weights.parent
    cold = _engine(session, new_dir, case, "new-weights-cold", "none", [consumer_prompts(case)])["run"]
    guarded = _engine(session, new_dir, case, "new-weights-guarded", store, [consumer_prompts(case)],
                      load_guard=True, kv_role="kv_consumer", kv_load_failure_policy="recompute")
    loads = load_records(guarded["records"])
    refusals = [r for r in loads if r.get("refused")]
    assert refusals and {r["reason"] for r in refusals} <= {"WEIGHTS_MISMATCH", "DENIED"}, refusals[:2]
    assert "WEIGHTS_MISMATCH" in {r["reason"] for r in refusals}
    assert [r for r in loads if not r.get("refused") and isinstance(r.get("rc"), int) and r["rc"] >= 0] == []
    assert diverged(guarded["run"], cold) == {}


def _block_hash(tokens: list[int]) -> str:
    """vLLM's chained block hash (sha256, 16-token blocks) of `tokens`' last full block, as a key's last field."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import hash_block_tokens, init_none_hash

    init_none_hash(sha256)
    parent = None
    for start in range(0, len(tokens) - len(tokens) % 16, 16):
        parent = hash_block_tokens(sha256, parent, tokens[start:start + 16])
    return parent.hex()
