"""`verify`: the comparison math, pairing, and the command on a real loopback cluster with synthetic
values (a tiny Mamba2 layout, float32 conv and ssm)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import jsonschema
import numpy as np
import pytest

from audit.keys import vllm_key
from audit.layouts import layouts_from_hf_config
from audit.records import KeyInfo
from audit.simulate import TINY_MAMBA2
from audit.verify import Tolerances, compare_values, pair_keys
from audit.verify.driver import boundary_cuts, cut_prompts
from audit.verify.engine import cut_block_size, manifest_engine_block_size, read_prompts
from audit.verify.pairing import (NO_REFERENCE, NOT_CUT, NOT_PUBLISHED, NOTHING_PAIRS, PROMPT_NOT_GIVEN,
                                  UNVERIFIED_LISTED)
from audit.verify.run import _absent_reason, pair_batches
from tests.helpers import report_schema, run_cli

MODEL = "tiny-m2"
LAYOUT = layouts_from_hf_config(TINY_MAMBA2, model=MODEL, state_dtype="float32", ssm_dtype="float32")[0]
HASHES = [f"{i:02x}" * 32 for i in range(1, 6)]


def state(seed: int) -> np.ndarray:
    """A plausible value: every state region random (float32), as bytes."""
    return np.random.default_rng(seed).normal(0.0, 1.0, LAYOUT.size // 4).astype(np.float32).view(np.uint8)


def perturbed(value: np.ndarray, scale: float, seed: int = 99) -> np.ndarray:
    floats = value.view(np.float32).copy()
    floats += np.random.default_rng(seed).normal(0.0, scale, floats.size).astype(np.float32) * np.abs(floats)
    return floats.view(np.uint8)


def with_region(value: np.ndarray, layer: int, region: str, fill) -> np.ndarray:
    out = value.copy()
    for segment, r in LAYOUT.regions():
        if segment.layer == layer and r.name == region:
            out[r.offset:r.offset + r.length] = fill(r.length)
    return out


# ---- the math --------------------------------------------------------------------------------------


def test_identical_values_have_zero_error():
    value = state(1)
    result = compare_values(value, value.copy(), LAYOUT)
    assert not result.divergent
    assert len(result.regions) == 2 * 4
    assert all(e.rel_l2 == 0 and e.max_abs == 0 and e.cosine == pytest.approx(1.0) for e in result.regions)


def test_noise_below_tolerance_is_not_divergent():
    value = state(2)
    result = compare_values(perturbed(value, 1e-4), value, LAYOUT)
    assert not result.divergent
    assert 0 < max(e.rel_l2 for e in result.regions) < 1e-3
    assert min(e.cosine for e in result.regions) > 0.9999


def test_relative_l2_and_cosine_are_exact():
    value = state(3)
    scaled = (value.view(np.float32) * np.float32(1.5)).view(np.uint8)
    result = compare_values(scaled, value, LAYOUT)
    # a scaled state: rel L2 0.5 everywhere, cosine 1 (direction kept): the rtol catches it
    assert result.divergent
    assert all(e.rel_l2 == pytest.approx(0.5, rel=1e-6) for e in result.regions)
    assert all(e.cosine == pytest.approx(1.0, abs=1e-9) for e in result.regions)
    assert all(e.max_abs > 0 for e in result.regions)


def test_one_wrong_region_is_the_worst_layer():
    value = state(4)
    wrong = with_region(value, 2, "ssm", lambda n: state(5)[:n])
    result = compare_values(wrong, value, LAYOUT)
    assert result.divergent
    assert [(e.layer, e.region) for e in result.regions if e.divergent] == [(2, "ssm")]
    assert result.worst.layer == 2
    evidence = result.evidence("ref-key", Tolerances())
    assert evidence["worst_layer"] == 2 and evidence["regions_divergent"] == 1
    assert evidence["worst_region"]["cosine"] < 0.5
    json.dumps(evidence)


def test_zero_production_state_is_divergent_with_infinite_nothing():
    value = state(6)
    zero = np.zeros_like(value)
    result = compare_values(zero, value, LAYOUT)
    assert result.divergent and all(e.divergent for e in result.regions)
    assert all(e.rel_l2 == pytest.approx(1.0) and e.cosine == 0.0 for e in result.regions)
    # a zero reference region with a non-zero production one: rel L2 is infinite, named in JSON
    flipped = compare_values(value, zero, LAYOUT)
    assert flipped.divergent and math.isinf(flipped.regions[0].rel_l2)
    assert flipped.evidence("r", Tolerances())["max_rel_l2"] == "inf"
    both = compare_values(zero, zero.copy(), LAYOUT)
    assert not both.divergent


def test_nan_where_the_reference_is_finite_is_divergent():
    value = state(7)
    nan = with_region(value, 0, "conv", lambda n: np.full(n // 4, np.nan, np.float32).view(np.uint8))
    result = compare_values(nan, value, LAYOUT)
    assert result.divergent and result.regions[0].nonfinite > 0


def test_sizes_that_differ_are_divergent_and_no_layout_is_bytes_only():
    value = state(8)
    assert compare_values(value[:-64], value, LAYOUT).divergent
    result = compare_values(perturbed(value, 1e-3), value, None)
    assert not result.divergent and not result.compared


def test_tolerances_decide():
    value = state(9)
    noisy = perturbed(value, 1e-3)
    assert not compare_values(noisy, value, LAYOUT, Tolerances(1e-2, 0.999)).divergent
    assert compare_values(noisy, value, LAYOUT, Tolerances(1e-5, 0.999)).divergent
    assert compare_values(noisy, value, LAYOUT, Tolerances(1.0, 0.99999999)).divergent


# ---- pairing ------------------------------------------------------------------------------------------


def test_pairing_by_every_field_but_the_cache_prefix():
    keys = [KeyInfo(vllm_key(MODEL, HASHES[0], cache_prefix="ref"), 10),
            KeyInfo(vllm_key(MODEL, HASHES[0]), 10),
            KeyInfo(vllm_key(MODEL, HASHES[0], cache_prefix="prod-a"), 10),      # another prod namespace
            KeyInfo(vllm_key(MODEL, HASHES[0], tp_rank=1), 10),                  # another rank: no twin
            KeyInfo(vllm_key(MODEL, HASHES[1], cache_prefix="ref"), 10),         # no production twin
            KeyInfo(vllm_key("other", HASHES[0]), 10),                           # another model: no twin
            KeyInfo("lmcache-ish-opaque", 10)]
    pairing = pair_keys(keys, "ref@")
    assert [(p.name, r.name) for p, r in pairing.pairs] == [(keys[1].name, keys[0].name), (keys[2].name, keys[0].name)]
    assert {k.name for k in pairing.unverified} == {keys[3].name, keys[5].name}
    assert [k.name for k in pairing.uncovered] == [keys[4].name]
    assert [k.name for k in pairing.not_vllm] == ["lmcache-ish-opaque"]
    assert pairing.summary()["coverage"] == 0.5
    only_a = pair_keys(keys, "ref", keep=lambda name: name.startswith("prod-a@"))
    assert [p.name for p, _ in only_a.pairs] == [keys[2].name]


def test_pair_batches_never_split_a_pair():
    pairs = [(KeyInfo(f"p{i}", 1000), KeyInfo(f"r{i}", 1000)) for i in range(7)]
    batches = list(pair_batches(pairs, capacity=4200))
    assert all(len(b) % 2 == 0 for b in batches)
    assert [s.key.name for b in batches for s in b] == [k.name for pair in pairs for k in pair]
    assert all(s.offset % 64 == 0 for b in batches for s in b)
    big = list(pair_batches([(KeyInfo("p", 10_000), KeyInfo("r", 10_000))], capacity=4200))
    assert len(big) == 1 and len(big[0]) == 2


def test_read_prompts(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('[1, 2, 3]\n\n{"prompt_token_ids": [4, 5]}\n')
    assert read_prompts(path) == [[1, 2, 3], [4, 5]]
    path.write_text('["a"]\n')
    with pytest.raises(Exception, match="token ids"):
        read_prompts(path)


def test_driver_engine_kwargs_never_look_up_and_use_the_prefix():
    from audit.verify.driver import engine_kwargs

    kwargs = engine_kwargs({"model": "/m/x", "cache_prefix": "ref", "block_size": 16, "mamba_cache_mode": "align"})
    extra = kwargs["kv_transfer_config"]["kv_connector_extra_config"]
    assert extra == {"cache_prefix": "ref", "enable_lookup": False}
    assert kwargs["max_num_seqs"] == 1 and kwargs["block_size"] == 16 and kwargs["enable_prefix_caching"]


def test_driver_engine_kwargs_take_the_operators_engine_args_and_fit_the_longest_prompt():
    from audit.verify.driver import engine_kwargs

    spec = {"model": "/m/x", "cache_prefix": "ref", "prompts": [[1] * 3000, [2] * 5], "max_tokens": 2,
            "gpu_memory_utilization": 0.3, "enforce_eager": False}
    kwargs = engine_kwargs(spec)
    assert kwargs["gpu_memory_utilization"] == 0.3 and kwargs["enforce_eager"] is False  # --engine-arg
    assert kwargs["max_model_len"] == 3002 and "prompts" not in kwargs and "cache_prefix" not in kwargs
    assert engine_kwargs({"model": "/m/x", "cache_prefix": "ref", "prompts": [[1] * 10]})["max_model_len"] == 2048


def test_the_reference_engine_is_sized_to_its_prompts_not_to_the_machine():
    from audit.verify.driver import sized_to_work

    kwargs = {"max_model_len": 2048, "max_num_seqs": 1}
    # a 2-layer Mamba2 at block 16: every group (one per layer at most) holds a whole request, + the null block
    assert sized_to_work(kwargs, 16, 2, None) == {"num_gpu_blocks_override": 4 * 2 * 128 + 1,
                                                   "kv_cache_memory_bytes": 1 << 20}
    # a hybrid's raised block: fewer, larger blocks; two requests at once: twice the blocks
    assert sized_to_work({"max_model_len": 1200, "max_num_seqs": 2}, 544, 4, None)["num_gpu_blocks_override"] == 97
    # on a GPU: vLLM checks for a share of the whole device at start; ask only for what is free now
    gpu = sized_to_work(kwargs, 16, 2, (20 << 30, 141 << 30))
    assert gpu["gpu_memory_utilization"] == 0.13
    # the operator's own memory arguments stand
    for given in ({"kv_cache_memory_bytes": 1 << 30}, {"gpu_memory_utilization": 0.5},
                  {"num_gpu_blocks_override": 64}):
        assert sized_to_work({**kwargs, **given}, 16, 2, None) == {}


# ---- cutting prompts at block boundaries (the reference driver) ------------------------------------------


@pytest.mark.parametrize("length, block, cuts", [
    (149, 16, [17, 33, 49, 65, 81, 97, 113, 129, 145, 149]),   # 9 boundaries, then the whole prompt
    (145, 16, [17, 33, 49, 65, 81, 97, 113, 129, 145]),        # the whole prompt is the last cut
    (144, 16, [17, 33, 49, 65, 81, 97, 113, 129, 144]),        # ends on a boundary: publishes block 8 only
    (33, 16, [17, 33]), (32, 16, [17, 32]), (17, 16, [17]), (16, 16, [16]), (5, 16, [5]), (1, 16, [1]),
    (1200, 544, [545, 1089, 1200]),                             # a hybrid's raised block
])
def test_boundary_cuts_one_token_after_each_boundary_then_the_whole(length, block, cuts):
    assert boundary_cuts(length, block) == cuts
    # a cut of k * block + 1 tokens publishes the state after its first k blocks: one cut per boundary
    boundaries = [(c - 1) // block for c in cuts if c > 1 and (c - 1) % block == 0]
    assert boundaries == list(range(1, (length - 1) // block + 1))


def test_boundary_cuts_refuse_a_non_positive_block():
    with pytest.raises(ValueError):
        boundary_cuts(10, 0)


def test_cut_prompts_order_and_dedupe():
    a = list(range(100, 140))                    # 40 tokens: cuts 17, 33, 40
    b = a[:20] + list(range(300, 320))           # shares a's first 20 tokens: its 17-token cut is a's
    c = list(a)                                  # a given twice
    d = a[:17]                                   # exactly a's first cut
    assert cut_prompts([a, b, c, d], 16) == [(0, 17), (0, 33), (0, 40), (1, 33), (1, 40)]
    assert cut_prompts([a, b, c, d], None) == [(0, 40), (1, 40), (3, 17)]   # whole prompts, a's twin dropped
    # same length, other tokens: kept (the digest covers every token, not only the last block's)
    e = [7] + a[1:]
    assert cut_prompts([a, e], 16) == [(0, 17), (0, 33), (0, 40), (1, 17), (1, 33), (1, 40)]


def test_cut_prompts_of_hand_cut_prompts_run_each_once():
    """The e2e's boundary_prompts (each writer prompt cut by hand) cut again: nothing new, each once."""
    rng = np.random.default_rng(0)
    writers = [list(map(int, rng.integers(3, 512, 149))) for _ in range(4)]
    by_hand = [w[:k * 16 + 1] for w in writers for k in range(1, 10)]
    requests = cut_prompts(by_hand, 16)
    assert len(requests) == len(by_hand) == 36
    assert sorted(tuple(by_hand[i][:n]) for i, n in requests) == sorted(map(tuple, by_hand))
    # the writers themselves: the same 36 cuts plus each whole prompt (149 tokens)
    assert len(cut_prompts(writers, 16)) == 40


class _Manifests:
    def __init__(self, *documents):
        import types
        self.manifests = [types.SimpleNamespace(document=d, path=Path(f"/r/manifest-h-{i}.json"))
                          for i, d in enumerate(documents)]


def _groups(model, *groups):
    return {"model": model, "groups": [dict(group=i, **g) for i, g in enumerate(groups)]}


def test_cut_block_size_operator_then_manifest_mamba_groups_then_engine():
    hybrid = _Manifests(_groups(MODEL, {"kind": "attention", "block_size": 544},
                                {"kind": "mamba2", "block_size": 272, "mamba_type": "MAMBA2", "states": []},
                                {"kind": "mamba2", "block_size": 544, "mamba_type": "MAMBA2", "states": []}),
                        _groups("another-model", {"kind": "mamba2", "block_size": 8, "states": []}))
    assert cut_block_size(16, hybrid, MODEL) == (16, "--block-size")
    size, source = cut_block_size(None, hybrid, MODEL)
    assert size == 272 and source.startswith("manifest /r/manifest-h-0.json") and "group 1" in source
    attention_only = _Manifests(_groups(MODEL, {"kind": "attention", "block_size": 32},
                                        {"kind": "attention", "block_size": 64}))
    assert cut_block_size(None, attention_only, MODEL)[0] == 32
    assert cut_block_size(None, hybrid, "unknown") == (None, "engine")
    assert cut_block_size(None, None, MODEL) == (None, "engine")
    assert manifest_engine_block_size(hybrid, MODEL) is None            # groups differ: not a guess
    assert manifest_engine_block_size(_Manifests(_groups(MODEL, {"block_size": 16, "states": []})), MODEL) == 16
    assert manifest_engine_block_size(None, MODEL) is None


def test_cut_block_size_from_a_recorded_manifest(monkeypatch, tmp_path):
    from audit.layouts.manifest import read_manifests
    from audit.recorder.manifest import describe_worker, write_manifest
    from tests.recorder import fake_vllm

    fake_vllm.install_fake_vllm(monkeypatch)
    write_manifest(tmp_path, describe_worker(*fake_vllm.hybrid_worker()))
    manifests = read_manifests([tmp_path])
    size, source = cut_block_size(None, manifests, "falcon-h1-tiny")
    assert size == 64 and "(group 1)" in source                         # the Mamba2 group
    assert manifest_engine_block_size(manifests, "falcon-h1-tiny") == 64


# ---- production keys without a twin: named, with the reason ----------------------------------------------


def test_unverified_keys_are_named_with_their_reason():
    keys = [KeyInfo(vllm_key(MODEL, HASHES[0], cache_prefix="ref"), 10),
            KeyInfo(vllm_key(MODEL, HASHES[0]), 10),                              # paired
            KeyInfo(vllm_key(MODEL, HASHES[0], tp_rank=1), 10),                   # its chunk, another rank
            KeyInfo(vllm_key(MODEL, HASHES[1], group=1), 10),                     # no reference key at all
            KeyInfo(vllm_key(MODEL, HASHES[2]), 10)]
    pairing = pair_keys(keys, "ref")
    summary = pairing.unverified_summary()
    assert summary["unverified_keys"] == [
        {"key": keys[2].name, "reason": "the reference published this chunk, but not this key's tp_rank 1 "
                                        "(the reference's: 0)"},
        {"key": keys[3].name, "reason": PROMPT_NOT_GIVEN},
        {"key": keys[4].name, "reason": PROMPT_NOT_GIVEN}]
    assert summary["unverified_listed"] == 3
    assert list(summary["unverified_reasons"].items())[0] == (PROMPT_NOT_GIVEN, 2)   # most common first
    assert sum(summary["unverified_reasons"].values()) == len(pairing.unverified) == 3


def test_unverified_keys_are_bounded_and_every_one_counted():
    keys = [KeyInfo(vllm_key(MODEL, f"{i:064x}"), 10) for i in range(UNVERIFIED_LISTED + 50)]
    keys.append(KeyInfo(vllm_key(MODEL, HASHES[4], cache_prefix="ref"), 10))
    pairing = pair_keys(keys, "ref")
    summary = pairing.unverified_summary(NOT_CUT)
    assert summary["unverified_listed"] == len(summary["unverified_keys"]) == UNVERIFIED_LISTED
    assert [k["key"] for k in summary["unverified_keys"]] == [k.name for k in keys[:UNVERIFIED_LISTED]]
    # no production key pairs with any reference key: the reason says so, not "not given"
    reason = NOTHING_PAIRS.format(n=1)
    assert summary["unverified_reasons"] == {reason: UNVERIFIED_LISTED + 50}
    assert "block size" in reason
    assert pair_keys(keys[:3], "ref").unverified_summary()["unverified_reasons"] == {NO_REFERENCE: 3}


def test_the_absent_reason_follows_how_the_reference_was_made():
    assert _absent_reason(None) == NOT_PUBLISHED
    assert _absent_reason({"cut_at_boundaries": True}) == PROMPT_NOT_GIVEN
    assert _absent_reason({"cut_at_boundaries": False}) == NOT_CUT
    assert _absent_reason({}) == NOT_CUT  # a driver of before the cuts


# ---- the command on a real cluster ---------------------------------------------------------------------


@pytest.fixture
def model_dir(tmp_path):
    path = tmp_path / MODEL
    path.mkdir()
    (path / "config.json").write_text(json.dumps(TINY_MAMBA2))
    return path


def _verify(cli_args, model_dir, namespace, *extra):
    result = run_cli("verify", *cli_args, "--model-config", str(model_dir), "--state-dtype", "float32",
                     "--ssm-dtype", "float32", "--reference-prefix", f"{namespace}ref", "--prefix", f"{namespace}prod@",
                     "--format", "json", "--all", *extra)
    assert result.exit_code in (0, 1, 3), result.output
    document = json.loads(result.stdout)
    jsonschema.validate(document, report_schema())
    return result.exit_code, document


def test_verify_flags_exactly_the_divergent_twin(publisher, cli_args, namespace, model_dir):
    prod, ref = f"{namespace}prod", f"{namespace}ref"
    good, bad, lonely_prod, lonely_ref = HASHES[0], HASHES[1], HASHES[2], HASHES[3]
    publisher.put(vllm_key(MODEL, good, cache_prefix=ref), state(10))
    publisher.put(vllm_key(MODEL, good, cache_prefix=prod), perturbed(state(10), 1e-5))
    publisher.put(vllm_key(MODEL, bad, cache_prefix=ref), state(11))
    publisher.put(vllm_key(MODEL, bad, cache_prefix=prod), with_region(state(11), 3, "conv", lambda n: state(12)[:n]))
    publisher.put(vllm_key(MODEL, lonely_prod, cache_prefix=prod), state(13))
    publisher.put(vllm_key(MODEL, lonely_ref, cache_prefix=ref), state(14))
    code, document = _verify(cli_args, model_dir, namespace)
    assert code == 1
    flagged = {r["key"] for r in document["findings"] if "DIVERGENT_STATE" in r["verdicts"]}
    assert flagged == {vllm_key(MODEL, bad, cache_prefix=prod)}
    record = next(r for r in document["findings"] if r["key"] in flagged)
    evidence = record["evidence"]["divergent_state"]
    assert evidence["worst_layer"] == 3 and evidence["worst_region"]["region"] == "conv"
    assert evidence["reference_key"] == vllm_key(MODEL, bad, cache_prefix=ref)
    summary = document["summary"]["verify"]
    assert (summary["pairs"], summary["unverified"], summary["reference_without_twin"], summary["divergent"]) == (2, 1, 1, 1)
    assert summary["unverified_keys"] == [{"key": vllm_key(MODEL, lonely_prod, cache_prefix=prod),
                                           "reason": NOT_PUBLISHED}]
    assert summary["unverified_reasons"] == {NOT_PUBLISHED: 1}
    assert summary["reference_keys"] == 3 and summary["production_keys"] == 3
    assert 0 < summary["noise_floor"]["max_rel_l2"] < 1e-4
    assert document["summary"]["verdicts"] == {"DIVERGENT_STATE": 1}
    assert {r["key"] for r in document["keys"]} == {vllm_key(MODEL, h, cache_prefix=prod) for h in (good, bad)}


def test_verify_clean_exits_0_and_needs_a_prefix(publisher, cli_args, namespace, model_dir):
    for i, chunk in enumerate(HASHES[:3]):
        publisher.put(vllm_key(MODEL, chunk, cache_prefix=f"{namespace}ref"), state(20 + i))
        publisher.put(vllm_key(MODEL, chunk, cache_prefix=f"{namespace}prod"), state(20 + i))
    code, document = _verify(cli_args, model_dir, namespace)
    assert code == 0 and not document["findings"]
    assert document["summary"]["verify"]["noise_floor"] == {"max_rel_l2": 0.0, "min_cosine": 1.0, "max_abs": 0.0,
                                                            "over": 3}
    result = run_cli("verify", *cli_args, "--format", "json")
    assert result.exit_code == 2 and "--reference-prefix" in result.output


def test_verify_human_format_and_a_swapped_value(publisher, cli_args, namespace, model_dir):
    """A key whose bytes are another key's: flagged, and only it (SHARED_CONTENT marks the pair too)."""
    a, b = HASHES[0], HASHES[1]
    for chunk, seed in ((a, 30), (b, 31)):
        publisher.put(vllm_key(MODEL, chunk, cache_prefix=f"{namespace}ref"), state(seed))
    publisher.put(vllm_key(MODEL, a, cache_prefix=f"{namespace}prod"), state(31))  # b's bytes under a
    publisher.put(vllm_key(MODEL, b, cache_prefix=f"{namespace}prod"), state(31))
    code, document = _verify(cli_args, model_dir, namespace)
    assert code == 1
    assert {r["key"] for r in document["findings"] if "DIVERGENT_STATE" in r["verdicts"]} == {
        vllm_key(MODEL, a, cache_prefix=f"{namespace}prod")}
    result = run_cli("verify", *cli_args, "--model-config", str(model_dir), "--state-dtype", "float32",
                     "--ssm-dtype", "float32", "--reference-prefix", f"{namespace}ref", "--prefix", f"{namespace}prod@")
    assert result.exit_code == 1 and "DIVERGENT_STATE" in result.stdout


# ---- what `verify --engine` asks the reference driver for (a stub python stands in for vLLM's) ----------

STUB_ENGINE = """#!{python}
import json, os, sys
sys.path.insert(0, {repo!r})
from audit.verify.driver import cut_prompts
spec = json.load(open(sys.argv[2]))
json.dump(spec, open(os.environ["STUB_SPEC_OUT"], "w"))
cut = spec.get("cut_at_boundaries", True)
requests = cut_prompts(spec["prompts"], spec.get("cut_block_size") if cut else None)
json.dump({{"prompts": len(spec["prompts"]), "requests": len(requests), "cut_at_boundaries": cut,
           "block_size": spec.get("cut_block_size"), "block_size_from": spec.get("cut_block_size_from")}},
          open(spec["out"], "w"))
"""


@pytest.fixture
def stub_engine(tmp_path, monkeypatch):
    import sys

    path = tmp_path / "stub-python"
    path.write_text(STUB_ENGINE.format(python=sys.executable, repo=str(Path(__file__).resolve().parents[2])))
    path.chmod(0o755)
    spec_out = tmp_path / "spec-seen.json"
    monkeypatch.setenv("STUB_SPEC_OUT", str(spec_out))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps(list(range(100, 140))) + "\n" + json.dumps(list(range(100, 120)) + [9] * 20) + "\n")
    return path, prompts, lambda: json.loads(spec_out.read_text())


def test_verify_engine_cuts_at_the_operators_block_size_and_names_keys_without_a_twin(
        publisher, cli_args, namespace, model_dir, stub_engine):
    engine, prompts, seen = stub_engine
    lonely = vllm_key(MODEL, HASHES[0], cache_prefix=f"{namespace}prod")
    publisher.put(lonely, state(40))
    for side in ("prod", "ref"):  # one pair (the stub publishes nothing itself)
        publisher.put(vllm_key(MODEL, HASHES[1], cache_prefix=f"{namespace}{side}"), state(41))
    code, document = _verify(cli_args, model_dir, namespace, "--engine", str(engine), "--prompts", str(prompts),
                             "--block-size", "16")
    spec = seen()
    assert (spec["cut_at_boundaries"], spec["cut_block_size"], spec["cut_block_size_from"], spec["block_size"]) == (
        True, 16, "--block-size", 16)
    assert spec["prompts"][0] == list(range(100, 140))  # the prompts as given: the driver cuts them
    summary = document["summary"]["verify"]
    assert summary["reference_run"]["requests"] == 5    # 17, 33, 40 of the first; 33, 40 of the second
    assert summary["unverified_keys"] == [{"key": lonely, "reason": PROMPT_NOT_GIVEN}]
    assert code == 0

    code, document = _verify(cli_args, model_dir, namespace, "--engine", str(engine), "--prompts", str(prompts),
                             "--block-size", "16", "--no-cut-at-boundaries")
    spec = seen()
    assert spec["cut_at_boundaries"] is False and "cut_block_size" not in spec
    summary = document["summary"]["verify"]
    assert summary["reference_run"]["requests"] == 2
    assert summary["unverified_reasons"] == {NOT_CUT: 1}


def test_verify_engine_takes_the_block_size_from_the_producers_manifest(
        cli_args, namespace, model_dir, stub_engine, monkeypatch, tmp_path):
    from audit.recorder.manifest import describe_worker, write_manifest
    from tests.recorder import fake_vllm

    engine, prompts, seen = stub_engine
    records = tmp_path / "records"
    with monkeypatch.context() as patched:
        fake_vllm.install_fake_vllm(patched)
        mamba = fake_vllm.MambaSpec(block_size=16, shapes=((3, 128), (8, 8, 16)),
                                    dtypes=(fake_vllm.FLOAT32, fake_vllm.FLOAT32))
        layers = [f"model.layers.{i}.mixer" for i in range(4)]
        write_manifest(records, describe_worker(*fake_vllm.build_worker(MODEL, [(layers, mamba)], [layers])))
    code, document = _verify(cli_args, model_dir, namespace, "--engine", str(engine), "--prompts", str(prompts),
                             "--block-tables", str(records))
    spec = seen()
    assert spec["block_size"] == 16 and spec["cut_block_size"] == 16    # the producer's, for both
    assert spec["cut_block_size_from"].startswith(f"manifest {records}/manifest-")
    assert document["summary"]["verify"]["reference_run"]["requests"] == 5
    # without a manifest or --block-size: the driver is left to cut at its engine's own block size
    _verify(cli_args, model_dir, namespace, "--engine", str(engine), "--prompts", str(prompts))
    spec = seen()
    assert spec["cut_at_boundaries"] is True and "cut_block_size" not in spec and "block_size" not in spec
