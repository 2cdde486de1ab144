"""Families laid out since issue #30, worked out by hand: OLMo Hybrid (GDN), DeepSeek-V3 / Kimi-K2
(MLA), Bailing MoE V2.5 (linear attention + MLA) and the multimodal wrappers read by their text
config. ``test_against_vllm.py`` checks the same builders against vLLM's own code."""

from __future__ import annotations

from audit.layouts import layouts_from_hf_config
from audit.layouts.candidates import LayoutRequest
from audit.layouts.config_shapes import attention_kv_shape, hybrid_pools, mla_latent_shape

# allenai/Olmo-Hybrid-7B's geometry (transformers' OlmoHybridConfig defaults): every 4th layer attends
OLMO_HYBRID = {
    "model_type": "olmo_hybrid", "architectures": ["OlmoHybridForCausalLM"], "hidden_size": 3840,
    "num_hidden_layers": 32, "num_attention_heads": 30, "num_key_value_heads": 30, "linear_num_key_heads": 30,
    "linear_num_value_heads": 30, "linear_key_head_dim": 96, "linear_value_head_dim": 192,
    "linear_conv_kernel_dim": 4, "dtype": "bfloat16",
    "layer_types": ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(32)],
}

# deepseek-ai/DeepSeek-V3's cache fields (transformers' DeepseekV3Config defaults)
DEEPSEEK_V3 = {
    "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 7168,
    "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128, "kv_lora_rank": 512,
    "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "dtype": "bfloat16",
}

BAILING_TINY = {
    "model_type": "bailing_hybrid", "architectures": ["BailingMoeV2_5ForCausalLM"], "hidden_size": 128,
    "num_hidden_layers": 4, "num_attention_heads": 8, "head_dim": 64, "layer_group_size": 2,
    "kv_lora_rank": 64, "qk_rope_head_dim": 16, "dtype": "bfloat16",
}

QWEN35_TEXT = {
    "model_type": "qwen3_5_text", "hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 8,
    "num_key_value_heads": 2, "head_dim": 64, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_num_key_heads": 8, "linear_num_value_heads": 8,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"], "mamba_ssm_dtype": "float32",
    "dtype": "bfloat16",
}

NEMOTRON_TEXT = {
    "model_type": "nemotron_h", "hidden_size": 64, "layers_block_type": ["mamba", "attention", "mamba", "mlp"],
    "num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 64, "ssm_state_size": 16,
    "mamba_num_heads": 8, "mamba_head_dim": 16, "n_groups": 2, "conv_kernel": 4, "dtype": "bfloat16",
}


def _regions(layout):
    segment = next(segment for segment in layout.segments if segment.layer >= 0)
    return [(region.name, region.shape, region.dtype, region.length) for region in segment.regions]


def test_olmo_hybrid_released_geometry():
    layouts = layouts_from_hf_config(OLMO_HYBRID, model="allenai/Olmo-Hybrid-7B")
    # 24 GDN layers in 3 groups of 8, 8 attention layers: 8 segments a key
    assert [(layout.group, layout.kind, len(layout.segments)) for layout in layouts] == [
        (0, "gdn", 8), (1, "gdn", 8), (2, "gdn", 8), (3, "attention", 8)]
    # conv (3, 2*30*96 + 30*192) = 69,120 B, ssm (30, 192, 96) = 1,105,920 B: a 1,175,040 B state;
    # attention 2 x 30 heads x 128 (3840 // 30) x 2 B = 15,360 B a token; block 16 * ceil(4.78) = 80
    assert _regions(layouts[0]) == [("conv", (3, 11520), "bfloat16", 69_120),
                                    ("ssm", (30, 192, 96), "bfloat16", 1_105_920),
                                    ("padding", (53_760,), "raw", 53_760)]
    assert _regions(layouts[3]) == [("kv", (30, 80, 256), "bfloat16", 1_228_800)]
    assert {layout.size for layout in layouts} == {8 * 1_228_800}
    # TP 2: conv (3, 5760), ssm (15, 192, 96) = 587,520 B; 15 KV heads, 7,680 B a token; block 80
    tp2 = layouts_from_hf_config(OLMO_HYBRID, model="m", tp_size=2)
    assert [region[:2] for region in _regions(tp2[0])] == [("conv", (3, 5760)), ("ssm", (15, 192, 96)),
                                                           ("padding", (26_880,))]
    assert tp2[0].size == 8 * 614_400


def test_olmo_hybrid_attention_heads_ignore_head_dim():
    # vLLM's OlmoHybridAttention takes hidden_size // num_attention_heads, whatever head_dim says
    with_head_dim = layouts_from_hf_config({**OLMO_HYBRID, "head_dim": 64}, model="m")
    assert _regions(with_head_dim[3]) == [("kv", (30, 80, 256), "bfloat16", 1_228_800)]


def test_deepseek_v3_one_latent_a_token_and_layer():
    (layout,) = layouts_from_hf_config(DEEPSEEK_V3, model="DeepSeek-V3")
    # 512 + 64 = 576 elements a token, bfloat16, MLA's default block 16: 18,432 B a layer, 61 layers
    assert (layout.kind, layout.group, len(layout.segments)) == ("attention", 0, 61)
    assert _regions(layout) == [("kv", (1, 16, 576), "bfloat16", 18_432)]
    assert layout.size == 61 * 18_432 == 1_124_352
    # the latent is not split by TP: every rank holds the same bytes (the connector writes tp_rank:0)
    assert layouts_from_hf_config(DEEPSEEK_V3, model="m", tp_size=8)[0].size == 1_124_352
    assert layouts_from_hf_config(DEEPSEEK_V3, model="m", block_size=64)[0].size == 61 * 73_728
    assert layouts_from_hf_config(DEEPSEEK_V3, model="m", kv_cache_dtype="fp8")[0].size == 61 * 9_216
    assert layouts_from_hf_config(DEEPSEEK_V3, model="m", platform="cpu")[0].size == 1_124_352  # CPU_MLA: 16
    # what a reading says it assumed: MLA's block, not the platform's default (128 on the CPU build)
    for platform in ("cpu", "cuda"):
        assert LayoutRequest(DEEPSEEK_V3, "m", platform=platform).described()["block_size"] == 16


def test_kimi_k2_and_deepseek_v2_are_mla_too():
    kimi = layouts_from_hf_config({**DEEPSEEK_V3, "model_type": "kimi_k2"}, model="Kimi-K2", block_size=64)
    assert _regions(kimi[0]) == [("kv", (1, 64, 576), "bfloat16", 73_728)]
    v2_lite = {"model_type": "deepseek_v2", "num_hidden_layers": 27, "kv_lora_rank": 512, "q_lora_rank": None,
               "qk_rope_head_dim": 64, "num_attention_heads": 16, "hidden_size": 2048, "dtype": "bfloat16"}
    assert layouts_from_hf_config(v2_lite, model="m")[0].size == 27 * 18_432


def test_mla_is_not_plain_kv_for_other_producers():
    assert attention_kv_shape(DEEPSEEK_V3) is None and hybrid_pools(DEEPSEEK_V3, 1) is None
    assert mla_latent_shape(DEEPSEEK_V3) == (61, 576)


def test_bailing_v2_5_linear_attention_and_mla():
    layouts = layouts_from_hf_config(BAILING_TINY, model="Ring-2.5")
    # layers 0, 2 linear attention ((i+1) % 2 != 0), 1, 3 MLA; state (8, 64, 64) bf16 = 65,536 B;
    # MLA (64 + 16) x 2 B = 160 B a token; a hybrid with MLA aligns to 128: block 128 * ceil(3.2) = 512
    assert [(layout.kind, [s.layer for s in layout.segments]) for layout in layouts] == [
        ("linear_attention", [0, 2]), ("attention", [1, 3])]
    assert _regions(layouts[0]) == [("ssm", (8, 64, 64), "bfloat16", 65_536), ("padding", (16_384,), "raw", 16_384)]
    assert _regions(layouts[1]) == [("kv", (1, 512, 80), "bfloat16", 81_920)]
    # the state takes --mamba-cache-dtype, not the ssm dtype (the CPU build's float32 ssm rule does not apply)
    cpu = layouts_from_hf_config(BAILING_TINY, model="m", platform="cpu", tp_size=8)
    assert _regions(cpu[0])[0] == ("ssm", (1, 64, 64), "bfloat16", 8_192)
    assert layouts_from_hf_config(BAILING_TINY, model="m", state_dtype="float32")[0].segments[0].regions[0].dtype \
        == "float32"


def test_wrappers_follow_their_text_config_and_their_architecture_s_dtype_rule():
    def ssm_dtype(config):
        return _regions(layouts_from_hf_config(config, model="m")[0])[1][2]

    # Qwen3.5's own wrapper takes the text config's mamba_ssm_dtype; MiniCPM-V 4.6 gets no rule in vLLM
    qwen = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": QWEN35_TEXT}
    minicpm = {"model_type": "minicpmv4_6", "architectures": ["MiniCPMV4_6ForConditionalGeneration"],
               "text_config": QWEN35_TEXT}
    assert (ssm_dtype(qwen), ssm_dtype(minicpm)) == ("float32", "bfloat16")
    # Nemotron Nano VL V2 (released with "llm_config") keeps Nemotron-H's float32; the Omni models do not
    nano_vl = {"model_type": "NemotronH_Nano_VL_V2", "architectures": ["NemotronH_Nano_VL_V2"],
               "llm_config": NEMOTRON_TEXT}
    omni = {"model_type": "nemotron_h_omni", "architectures": ["NemotronH_Nano_Omni_Reasoning_V3"],
            "text_config": NEMOTRON_TEXT}
    assert (ssm_dtype(nano_vl), ssm_dtype(omni)) == ("float32", "bfloat16")
    assert [layout.kind for layout in layouts_from_hf_config(nano_vl, model="m")] == ["mamba2", "mamba2", "attention"]


def test_lfm2_vl_is_its_lfm2_text_model():
    text = {"model_type": "lfm2", "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 8,
            "num_key_value_heads": 8, "conv_L_cache": 3, "layer_types": ["conv", "full_attention", "conv"],
            "dtype": "bfloat16"}
    wrapped = {"model_type": "lfm2_vl", "architectures": ["Lfm2VlForConditionalGeneration"], "text_config": text}
    ours, plain = (layouts_from_hf_config(config, model="m", platform="cpu") for config in (wrapped, text))
    assert [_regions(layout) for layout in ours] == [_regions(layout) for layout in plain]
    assert _regions(ours[0])[0] == ("conv", (2, 64), "bfloat16", 256)


def test_an_mla_scan_fits_the_block_to_the_listed_sizes():
    from audit.keys import vllm_key
    from audit.layouts.infer import LayoutRequest, infer_layouts, observed_sizes
    from audit.records import KeyInfo

    # DeepSeek-V3 at TP 8 on a backend with block 64: every key tp_rank:0, 61 x 64 x 576 x 2 B
    keys = [KeyInfo(vllm_key("DeepSeek-V3", f"{index:04x}", group=0, tp_rank=0), 61 * 73_728) for index in range(4)]
    inference = infer_layouts(LayoutRequest(DEEPSEEK_V3, "DeepSeek-V3", tp_size=8, tp_given=True),
                              observed_sizes(keys))
    (row,) = inference.rows
    assert (row["status"], inference.layouts[0].size, row["assumed"]["block_size"]) == ("ambiguous", 61 * 73_728, 64)
    # as for any attention page: 16-bit at block 64, float32 at block 32 or fp8 at 128, the bytes decide
    readings = inference.readings[("DeepSeek-V3", 0)]
    assert sorted((r.assumed["kv_dtype"], r.assumed["block_size"]) for r in readings) == [
        ("bfloat16", 64), ("float16", 64), ("float32", 32), ("float8_e4m3fn", 128)]


def test_layout_command_prints_deepseek_v3_and_names_a_refusal(tmp_path):
    import json

    from tests.helpers import run_cli

    (tmp_path / "DeepSeek-V3").mkdir()
    (tmp_path / "DeepSeek-V3" / "config.json").write_text(json.dumps(DEEPSEEK_V3))
    result = run_cli("layout", "--model-config", str(tmp_path / "DeepSeek-V3"), "--format", "json")
    assert result.exit_code == 0, result.output
    (layout,) = json.loads(result.stdout)["layouts"]
    assert (layout["kind"], layout["segments"]["count"], layout["segments"]["regions"][0]["shape"]) == (
        "attention", 61, [1, 16, 576])
    (tmp_path / "kimi").mkdir()
    (tmp_path / "kimi" / "config.json").write_text(json.dumps({"model_type": "kimi_linear",
                                                               "architectures": ["KimiLinearForCausalLM"]}))
    refused = run_cli("layout", "--model-config", str(tmp_path / "kimi"))
    assert refused.exit_code == 2 and "'kimi_linear' is not supported: Kimi Delta Attention" in refused.stderr


def test_a_vllm_0_33_qwen3_5_size_is_one_of_the_readings():
    # vLLM 0.33 aligns Qwen GDN hybrids' blocks to 64 as well (FlashInfer GDN prefill on SM90):
    # Qwen3.5-9B at TP 2 goes from block 528 (8,650,752 B keys) to 576 (9,437,184 B). 0.33 on
    # SM90 is a candidate (audit.layouts.versions; as are 0.32's --block-size 64 and kernel block
    # 64, with the same bytes), so such keys are fitted (a reading the bytes then choose), never
    # SIZE_MISMATCH.
    from audit.keys import vllm_key
    from audit.layouts.infer import LayoutRequest, infer_layouts, observed_sizes
    from audit.records import KeyInfo
    from tests.layouts.configs import QWEN3_5_9B

    keys = [KeyInfo(vllm_key("q", f"{group:02x}{index:04x}", group=group, tp_rank=rank), 9_437_184)
            for group in range(4) for index in range(3) for rank in (0, 1)]
    inference = infer_layouts(LayoutRequest(QWEN3_5_9B, "q", tp_size=2, tp_given=True), observed_sizes(keys))
    assert {row["status"] for row in inference.rows} == {"ambiguous"}
    gdn = [[(region.name, region.dtype, region.length) for region in reading.layout.segments[0].regions]
           for reading in inference.readings[("q", 0)]]
    assert [("conv", "bfloat16", 24_576), ("ssm", "float32", 1_048_576), ("padding", "raw", 106_496)] in gdn
    assert any("0.33" in str(reading.assumed["vllm_version"]) for reading in inference.readings[("q", 0)])
