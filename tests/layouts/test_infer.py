"""Inferring the producer's dtypes, platform, block size and TP size from the listed value sizes."""

from __future__ import annotations

from audit.judge.plan import CheckPlan, load_layouts
from audit.keys import vllm_key
from audit.layouts.infer import LayoutRequest, infer_layouts, observed_sizes
from audit.records import KeyInfo
from tests.layouts.test_families import LLAMA_TINY, MAMBA2_TINY, NEMOTRON_TINY


def _keys(model, sizes_by_group, tp_rank=0):
    return [KeyInfo(vllm_key(model, f"{group:02x}{index:04x}", group=group, tp_rank=tp_rank), size)
            for group, sizes in sizes_by_group.items() for index, size in enumerate(sizes)]


def _infer(request, keys):
    inference = infer_layouts(request, observed_sizes(keys))
    return inference.layouts, inference.rows


def test_bf16_mamba2_on_cpu_is_inferred_from_sizes():
    request = LayoutRequest(dict(MAMBA2_TINY, dtype="bfloat16"), "mamba2-tiny-bf16", model_dtype="bfloat16")
    layouts, rows = _infer(request, _keys("mamba2-tiny-bf16", {0: [18_304] * 3}))
    assert layouts[0].size == 18_304
    (row,) = rows
    assert row["status"] == "inferred" and row["from"] == "3 of 3 keys of 18,304 B"
    # CUDA with --mamba-ssm-cache-dtype float32 writes the same bytes: both are named
    assert (row["assumed"]["platform"], row["assumed"]["conv_dtype"], row["assumed"]["ssm_dtype"]) == (
        ["cpu", "cuda"], "bfloat16", "float32")


def test_a_size_that_fits_several_readings_is_ambiguous_with_its_candidates():
    # without --dtype, a float16 producer's conv state has the size of a bfloat16 one
    request = LayoutRequest(dict(MAMBA2_TINY, dtype="bfloat16"), "m")
    inference = infer_layouts(request, observed_sizes(_keys("m", {0: [18_304] * 3})))
    (row,) = inference.rows
    assert row["status"] == "ambiguous"
    assert [candidate["assumed"]["conv_dtype"] for candidate in row["candidates"]] == ["bfloat16", "float16"]
    assert "--dtype" in row["settle_with"] and "--block-size" not in row["settle_with"]
    assert [reading.layout.size for reading in inference.readings[("m", 0)]] == [18_304, 18_304]
    assert inference.layouts[0] is inference.readings[("m", 0)][0].layout  # the most likely reading leads


def test_attention_in_float32_16_bit_and_fp8_are_readings_of_one_size():
    """A page of b tokens in float32 has the bytes of 2b in a 16-bit dtype and of 4b in fp8
    (`--kv-cache-dtype fp8`, not given: a size alone never rules it out)."""
    inference = infer_layouts(LayoutRequest(LLAMA_TINY, "l"), observed_sizes(_keys("l", {0: [16_384]})))
    readings = inference.readings[("l", 0)]
    assert sorted((r.assumed["kv_dtype"], r.assumed["block_size"]) for r in readings) == [
        ("bfloat16", 32), ("float16", 32), ("float32", 16), ("float8_e4m3fn", 64)]
    given = LayoutRequest(LLAMA_TINY, "l", model_dtype="float32")
    inference = infer_layouts(given, observed_sizes(_keys("l", {0: [16_384]})))
    assert sorted((r.assumed["kv_dtype"], r.assumed["block_size"]) for r in inference.readings[("l", 0)]) == [
        ("float32", 16), ("float8_e4m3fn", 64)]
    given = LayoutRequest(LLAMA_TINY, "l", model_dtype="float32", kv_cache_dtype="float32")
    inference = infer_layouts(given, observed_sizes(_keys("l", {0: [16_384]})))
    assert inference.readings == {} and inference.rows[0]["assumed"]["block_size"] == 16


def test_float32_model_and_defaults():
    request = LayoutRequest(dict(MAMBA2_TINY, dtype="float32"), "m")
    layouts, rows = _infer(request, _keys("m", {0: [20_224] * 2}))
    assert layouts[0].size == 20_224 and rows[0]["assumed"]["model_dtype"] == "float32"
    # sizes that vLLM's CUDA defaults give: nothing inferred
    given = LayoutRequest(dict(MAMBA2_TINY, dtype="float32"), "m", model_dtype="bfloat16", ssm_dtype="bfloat16")
    layouts, rows = _infer(given, _keys("m", {0: [10_112]}))
    assert rows[0]["status"] == "as_configured"


def test_attention_block_size_from_sizes_and_a_second_producer():
    request = LayoutRequest(LLAMA_TINY, "llama-tiny")
    keys = _keys("llama-tiny", {0: [16_384] * 5 + [65_536]})
    layouts, (row,) = _infer(request, keys)
    assert layouts[0].size == 16_384 and row["assumed"]["block_size"] == 32
    assert row["other_sizes"] == {"65536": 1}  # stays SIZE_MISMATCH: another producer?


def test_per_group_and_no_fit():
    request = LayoutRequest(NEMOTRON_TINY, "n")
    layouts, rows = _infer(request, _keys("n", {0: [32_768], 1: [32_768], 2: [32_768]}))
    assert [row["status"] for row in rows] == ["ambiguous"] * 3
    assert all("cpu" in row["assumed"]["platform"] for row in rows)
    _, rows = _infer(request, _keys("n", {0: [12_345]}))
    assert rows[0]["status"] == "no_fit" and rows[0]["layout_size"] == 12_288


def test_tp_size_inferred_when_not_given():
    config = dict(MAMBA2_TINY, dtype="bfloat16", n_groups=2)
    # TP 2: conv (3, (128 + 2*2*16)/2 = 96) bf16 = 576, ssm (4, 16, 16) bf16 = 2,048; 2 layers = 5,248
    request = LayoutRequest(config, "m")
    layouts, rows = _infer(request, _keys("m", {0: [5_248]}))
    assert layouts[0].tp_size == 2 and rows[0]["assumed"]["tp_size"] == 2
    given = LayoutRequest(config, "m", tp_given=True)
    _, rows = _infer(given, _keys("m", {0: [5_248]}))
    assert rows[0]["status"] == "no_fit"


def test_plan_fit_sizes(tmp_path):
    import json

    model_dir = tmp_path / "mamba2-tiny-bf16"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(dict(MAMBA2_TINY, dtype="bfloat16")))
    plan = CheckPlan(load_layouts(model_configs=[model_dir], model_dtype="bfloat16"))
    keys = _keys("mamba2-tiny-bf16", {0: [18_304] * 2})
    assert plan.layout_for(keys[0]).size == 10_112  # before: vLLM's CUDA defaults
    rows = plan.fit_sizes(keys)
    assert plan.inference == rows and rows[0]["status"] == "inferred" and plan.readings == {}
    assert plan.layout_for(keys[0]).size == 18_304
    # keys of other schemes and Store-TP shards are not counted
    assert observed_sizes([KeyInfo("opaque-key", 5), KeyInfo(vllm_key("m", "ab", store_namespace=(
        "@store_tp:2@store_pp:1@store_format:tp_shared_lbhnc")), 7)]) == {}


def test_a_key_of_tp_rank_one_rules_out_tp_one():
    # n_groups 2 splits over TP 2: TP 2 in float32 has the bytes of TP 1 in bfloat16
    config = dict(MAMBA2_TINY, dtype="float32", n_groups=2)
    size = LayoutRequest(config, "m", tp_size=2, model_dtype="float32", ssm_dtype="float32").layouts()[0].size
    rank0 = infer_layouts(LayoutRequest(config, "m"), observed_sizes(_keys("m", {0: [size]})))
    assert 1 in {reading.assumed["tp_size"] for reading in rank0.readings[("m", 0)]}
    both = _keys("m", {0: [size]}) + _keys("m", {0: [size]}, tp_rank=1)
    ranks = infer_layouts(LayoutRequest(config, "m"), observed_sizes(both))
    readings = ranks.readings.get(("m", 0)) or []
    assert all(reading.assumed["tp_size"] != 1 for reading in readings) and ranks.layouts[0].tp_size >= 2
