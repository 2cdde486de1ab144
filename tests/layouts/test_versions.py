"""The producer's vLLM release as an axis of the layout (issue #30 §2): the rules 0.33 changed,
worked out by hand. ``test_against_vllm.py`` checks the same rules against 0.32's and 0.33's code."""

from __future__ import annotations

import json

import pytest

from audit.keys import vllm_key
from audit.layouts import LayoutError, layouts_from_hf_config, parse_layout_document
from audit.layouts.infer import LayoutRequest, infer_layouts, observed_sizes
from audit.layouts.versions import prefill_checkpoint_alignment, vllm_version
from audit.layouts.vllm_models import refusal
from audit.records import KeyInfo
from tests.helpers import run_cli
from tests.layouts.configs import QWEN3_5_9B
from tests.layouts.test_new_families import OLMO_HYBRID

KEY_0_32, KEY_0_33 = 8_650_752, 9_437_184  # Qwen3.5-9B at TP 2: 8 pages of block 528, of block 576


def _sizes(config, version, platform, tp=2, **flags):
    return {layout.size for layout in layouts_from_hf_config(config, model="q", tp_size=tp, platform=platform,
                                                              vllm_version=version, **flags)}


@pytest.mark.parametrize("platform", ["cuda", "sm90", "sm100", "sm120"])
def test_qwen3_5_9b_key_bytes_per_release_and_gpu(platform):
    # 0.33: block lcm(16, 64) = 64 x ceil(1,073,152 B of state / (64 x 2,048 B a token)) = 576
    assert _sizes(QWEN3_5_9B, "0.32", platform) == {KEY_0_32}
    assert _sizes(QWEN3_5_9B, "0.33", platform) == {KEY_0_32 if platform == "cuda" else KEY_0_33}
    assert _sizes(QWEN3_5_9B, None, platform) == {KEY_0_32}  # no release named: 0.32's rules


def test_the_alignment_follows_the_gdn_kind_and_the_gpu():
    text = QWEN3_5_9B["text_config"]
    assert prefill_checkpoint_alignment("qwen3_5_text", text, "0.33", "sm90") == 64
    assert prefill_checkpoint_alignment("qwen3_5_text", dict(text, linear_key_head_dim=64), "0.33", "sm100") == 1
    assert prefill_checkpoint_alignment("qwen3_5_text", dict(text, linear_key_head_dim=64), "0.33", "sm90") == 64
    assert prefill_checkpoint_alignment("qwen3_5_text", text, "0.33", "cpu") == 1
    assert prefill_checkpoint_alignment("olmo_hybrid", OLMO_HYBRID, "0.33", "sm90") == 1  # its own GDN layer
    assert _sizes(OLMO_HYBRID, "0.33", "sm90", tp=1) == _sizes(OLMO_HYBRID, "0.32", "sm90", tp=1)


def _keys(size):
    return [KeyInfo(vllm_key("q", f"{group:02x}{index:04x}", group=group, tp_rank=rank), size)
            for group in range(4) for index in range(3) for rank in (0, 1)]


def _rows(size, **request):
    inference = infer_layouts(LayoutRequest(QWEN3_5_9B, "q", tp_size=2, tp_given=True, **request),
                              observed_sizes(_keys(size)))
    return inference, inference.rows


@pytest.mark.parametrize("platform", [None, "cuda", "sm90"])
def test_either_release_s_keys_fit_when_the_operator_names_none(platform):
    # the default covers both releases, and --platform cuda every CUDA GPU: no healthy key is a misfit
    for size, release in ((KEY_0_32, "0.32"), (KEY_0_33, "0.33")):
        inference, rows = _rows(size, platform=platform)
        assert {row["status"] for row in rows} <= {"inferred", "ambiguous"}, rows
        assert {layout.size for layout in inference.layouts} == {size}
        versions = {str(reading.assumed["vllm_version"]) for choices in inference.readings.values()
                    for reading in choices} or {str(rows[0]["assumed"]["vllm_version"])}
        assert any(release in value for value in versions), versions


def test_a_named_release_or_platform_settles_the_block():
    # (--block-size 64, or a kernel block of 64 (ROCm AITER), gives 0.32 the same block: both fixed here)
    _, rows = _rows(KEY_0_33, vllm_version="0.32", platform="sm90", kernel_block_size=16, block_size=16)
    assert {row["status"] for row in rows} == {"no_fit"}
    _, rows = _rows(KEY_0_33, vllm_version="0.33", platform="sm90", kernel_block_size=16, block_size=16)
    assert {row["status"] for row in rows} <= {"inferred", "ambiguous", "as_configured"}
    assert (rows[0]["assumed"]["vllm_version"], rows[0]["assumed"]["block_size"]) == ("0.33", 16)
    _, rows = _rows(KEY_0_33, platform="cpu", kernel_block_size=16, block_size=16)
    assert {row["status"] for row in rows} == {"no_fit"}


def test_vllm_0_33_refuses_a_16_bit_kv_dtype_unlike_the_model_s():
    with pytest.raises(LayoutError, match="vLLM 0.33 refuses --kv-cache-dtype float16 with model dtype bfloat16"):
        layouts_from_hf_config(QWEN3_5_9B, model="q", tp_size=2, kv_cache_dtype="float16", vllm_version="0.33")
    assert _sizes(QWEN3_5_9B, "0.32", "cuda", kv_cache_dtype="float16") == {KEY_0_32}
    assert _sizes(QWEN3_5_9B, "0.33", "cuda", kv_cache_dtype="bfloat16") == {KEY_0_32}  # the model's: served
    # a reading may assume 0.33 only where the model runs in float16 too (then 0.33 serves the flag)
    inference, _ = _rows(KEY_0_32, kv_cache_dtype="float16")
    readings = [reading.assumed for choices in inference.readings.values() for reading in choices]
    assert any("0.33" in str(assumed["vllm_version"]) for assumed in readings)
    assert all(assumed["model_dtype"] == "float16" for assumed in readings if "0.33" in str(assumed["vllm_version"]))


def test_refused_families_say_what_each_release_changed():
    kimi, glm = (["KimiK3ForConditionalGeneration"], ["Glm5NextForCausalLM"])
    assert "lost 0.32's two extra tensors" in refusal([], kimi, "0.33")
    assert "two tensors more" in refusal([], kimi, "0.32") and "lost" not in refusal([], kimi, "0.32")
    assert "fp8 on SM10x" in refusal([], glm, "0.33") and "fp8" not in refusal([], glm, "0.32")
    assert "vLLM 0.32" in refusal([], kimi) and "vLLM 0.33" in refusal([], kimi)  # no release named: both


def test_release_names():
    assert [vllm_version(name) for name in ("0.33.0", "v0.32", "0.33.0+cu130", "auto", None)] == [
        "0.33", "0.32", "0.33", None, None]
    with pytest.raises(LayoutError, match="knows the rules of 0.32, 0.33"):
        vllm_version("0.31.2")


def test_layout_prints_each_release_where_they_differ(tmp_path):
    (tmp_path / "Qwen3.5-9B").mkdir()
    (tmp_path / "Qwen3.5-9B" / "config.json").write_text(json.dumps(QWEN3_5_9B))
    model = str(tmp_path / "Qwen3.5-9B")
    both = run_cli("layout", "--model-config", model, "-tp", "2")
    assert both.exit_code == 0, both.output
    assert "Qwen3.5-9B as vLLM 0.32 on any CUDA GPU; vLLM 0.33 on other CUDA GPUs:" in both.stdout
    assert "Qwen3.5-9B as vLLM 0.33 on sm90, sm100, sm120:" in both.stdout
    assert f"{KEY_0_32:,} bytes per key" in both.stdout and f"{KEY_0_33:,} bytes per key" in both.stdout
    one = run_cli("layout", "--model-config", model, "-tp", "2", "--vllm-version", "0.33", "--platform", "sm90")
    assert one.exit_code == 0 and " as vLLM" not in one.stdout
    assert f"{KEY_0_33:,} bytes per key" in one.stdout and f"{KEY_0_32:,}" not in one.stdout
    as_file = run_cli("layout", "--model-config", model, "-tp", "2", "--format", "json")
    assert {layout.size for layout in parse_layout_document(json.loads(as_file.stdout))} == {KEY_0_32}
    assert "vLLM 0.33 on sm90, sm100, sm120 registers others" in as_file.stderr
    refused = run_cli("layout", "--model-config", model, "--vllm-version", "0.33", "--kv-cache-dtype", "float16")
    assert refused.exit_code == 2 and "vLLM 0.33 refuses --kv-cache-dtype float16" in refused.stderr
    unknown = run_cli("layout", "--model-config", model, "--vllm-version", "0.31")
    assert unknown.exit_code == 2 and len(unknown.stderr.strip().splitlines()) == 1
