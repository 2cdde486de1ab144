"""`verify`: the comparison math, pairing, and the command on a real loopback cluster with synthetic
values (a tiny Mamba2 layout, float32 conv and ssm)."""

from __future__ import annotations

import json
import math

import jsonschema
import numpy as np
import pytest

from audit.keys import vllm_key
from audit.layouts import layouts_from_hf_config
from audit.records import KeyInfo
from audit.simulate import TINY_MAMBA2
from audit.verify import Tolerances, compare_values, pair_keys
from audit.verify.engine import read_prompts
from audit.verify.run import pair_batches
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
