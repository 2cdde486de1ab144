"""vLLM 0.32.0's dtype rules, attention-only layouts and the hybrid families beyond Mamba/GDN.

Every number here is also checked against vLLM's own code by tests/layouts/test_against_vllm.py
(run in .venv-vllm); these run without vLLM.
"""

from __future__ import annotations

import pytest

from audit.layouts import LayoutError, layouts_from_hf_config
from audit.layouts.dtypes import resolve_dtypes

# The e2e harness's tiny models (tests/e2e/models.py), as transformers 5 saves them
MAMBA2_TINY = {"model_type": "mamba2", "hidden_size": 64, "num_hidden_layers": 2, "state_size": 16,
               "num_heads": 8, "head_dim": 16, "expand": 2, "n_groups": 1, "conv_kernel": 4}
LLAMA_TINY = {"model_type": "llama", "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
              "num_key_value_heads": 1, "head_dim": 64, "dtype": "bfloat16"}
NEMOTRON_TINY = {"model_type": "nemotron_h", "hidden_size": 64, "dtype": "bfloat16",
                 "layers_block_type": ["linear_attention", "full_attention", "linear_attention", "mlp"],
                 "num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": 64, "ssm_state_size": 16,
                 "mamba_num_heads": 8, "mamba_head_dim": 16, "n_groups": 1, "conv_kernel": 4,
                 "mamba_ssm_cache_dtype": "float32"}
FALCON_H1_TINY = {"model_type": "falcon_h1", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 1,
                  "num_key_value_heads": 1, "mamba_d_ssm": 128, "mamba_n_heads": 8, "mamba_d_head": 16,
                  "mamba_n_groups": 1, "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_expand": 2,
                  "dtype": "bfloat16"}
LFM2_TINY = {"model_type": "lfm2", "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 1,
             "num_key_value_heads": 1, "conv_L_cache": 3, "layer_types": ["conv", "full_attention", "conv"],
             "conv_dim": 64, "dtype": "bfloat16"}


def test_mamba2_tiny_sizes_vllm_published():
    # conv (3, 128 + 2*16) = 480 elements, ssm (8, 16, 16) = 2,048 elements; 2 layers
    # float32 model: (480 + 2,048) * 4 * 2 = 20,224 B (FACTS §8)
    config = dict(MAMBA2_TINY, dtype="float32")
    assert layouts_from_hf_config(config, model="m", model_dtype="float32")[0].size == 20_224
    # vLLM's --dtype auto runs a float32 checkpoint in bfloat16: 2,528 * 2 * 2 = 10,112 B (CUDA)
    assert layouts_from_hf_config(config, model="m")[0].size == 10_112
    # bfloat16 model on the CPU build: ssm forced to float32: (960 + 8,192) * 2 = 18,304 B
    bf16 = dict(MAMBA2_TINY, dtype="bfloat16")
    assert layouts_from_hf_config(bf16, model="m", platform="cpu")[0].size == 18_304


@pytest.mark.parametrize("model_type, text, platform, ssm, expected", [
    ("mamba2", {"dtype": "bfloat16"}, "cuda", None, ("bfloat16", "bfloat16", "bfloat16")),
    ("mamba2", {"dtype": "float32"}, "cuda", None, ("bfloat16", "bfloat16", "bfloat16")),
    ("mamba2", {"torch_dtype": "float16"}, "cuda", None, ("float16", "float16", "float16")),
    ("mamba2", {"dtype": "bfloat16"}, "cpu", None, ("bfloat16", "bfloat16", "float32")),
    ("mamba2", {"dtype": "bfloat16"}, "cpu", "bfloat16", ("bfloat16", "bfloat16", "float32")),
    ("nemotron_h", {"dtype": "bfloat16"}, "cuda", None, ("bfloat16", "bfloat16", "float32")),
    ("nemotron_h", {"dtype": "bfloat16", "mamba_ssm_cache_dtype": "bfloat16"}, "cuda", None,
     ("bfloat16", "bfloat16", "bfloat16")),
    ("qwen3_5_text", {"dtype": "bfloat16", "mamba_ssm_dtype": "float32"}, "cuda", None,
     ("bfloat16", "bfloat16", "float32")),
    ("qwen3_next", {"dtype": "bfloat16"}, "cuda", "float16", ("bfloat16", "bfloat16", "float16")),
    # CPU GDN keeps a 16-bit ssm dtype the operator (or the model) asked for
    ("qwen3_next", {"dtype": "bfloat16", "layer_types": ["linear_attention", "full_attention"]}, "cpu",
     "bfloat16", ("bfloat16", "bfloat16", "bfloat16")),
    ("qwen3_next", {"dtype": "bfloat16", "layer_types": ["linear_attention", "full_attention"]}, "cpu",
     None, ("bfloat16", "bfloat16", "float32")),
])
def test_dtype_rules(model_type, text, platform, ssm, expected):
    dtypes = resolve_dtypes(model_type=model_type, text=text, ssm_dtype=ssm, platform=platform)
    assert (dtypes.model, dtypes.conv, dtypes.ssm) == expected
    assert dtypes.kv == dtypes.model


def test_llama_attention_only():
    # one segment per layer, one page per block: 2 (K,V) x 32 tokens x 1 head x 64 x bf16 = 8,192 B
    (layout,) = layouts_from_hf_config(LLAMA_TINY, model="llama-tiny", block_size=32)
    assert (layout.kind, layout.group, len(layout.segments), layout.size) == ("attention", 0, 2, 16_384)
    (kv,) = layout.segments[1].regions
    assert (kv.name, kv.kind, kv.offset, kv.shape, kv.dtype) == ("kv", "kv", 8_192, (1, 32, 128), "bfloat16")
    # the FACTS §8 Llama (2 KV heads) published 32,768 B per block at block 32
    assert layouts_from_hf_config(dict(LLAMA_TINY, num_key_value_heads=2), model="l", block_size=32)[0].size == 32_768
    # GQA at TP 4 with 2 KV heads: each rank (and key) holds one head
    four = layouts_from_hf_config(dict(LLAMA_TINY, num_key_value_heads=2), model="l", block_size=32, tp_size=4)
    assert four[0].segments[0].regions[0].shape == (1, 32, 128)
    # block size defaults: 16 on CUDA, 128 on the CPU build
    assert layouts_from_hf_config(LLAMA_TINY, model="l")[0].size == 2 * 16 * 256
    assert layouts_from_hf_config(LLAMA_TINY, model="l", platform="cpu")[0].size == 2 * 128 * 256


def test_generic_attention_config_and_sliding_groups():
    generic = {"model_type": "some_new_llm", "num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 4}
    (layout,) = layouts_from_hf_config(generic, model="x", block_size=16)
    # MHA (no num_key_value_heads), head_dim 256/4; no dtype: float32, run in bfloat16 (--dtype auto)
    assert layout.size == 4 * 16 * 2 * 4 * 64 * 2
    gemma2 = {"model_type": "gemma2", "num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 64, "sliding_window": 4096, "dtype": "bfloat16"}
    layouts = layouts_from_hf_config(gemma2, model="g", block_size=16)
    # sliding layers 0, 2 and full layers 1, 3: two groups of two, sharing two segments
    assert [[s.layer for s in layout.segments] for layout in layouts] == [[0, 2], [1, 3]]


def test_unknown_state_config_is_refused():
    with pytest.raises(LayoutError, match="not supported"):
        layouts_from_hf_config({"model_type": "new_ssm", "num_hidden_layers": 2, "hidden_size": 64,
                                "num_attention_heads": 2, "mamba_d_state": 16}, model="x")


def test_nemotron_h_tiny_on_cpu():
    # conv (3, 160) bf16 = 960 B, ssm (8, 16, 16) float32 = 8,192 B (the config says float32)
    # CPU: block = max(32, 128) * ceil(9,152 / (128 * 256)) = 128; page 32,768; 1 segment
    layouts = layouts_from_hf_config(NEMOTRON_TINY, model="n", platform="cpu")
    assert [(layout.group, layout.kind, layout.size) for layout in layouts] == [
        (0, "mamba2", 32_768), (1, "mamba2", 32_768), (2, "attention", 32_768)]
    # CUDA: block = 16 * ceil(9,152 / 4,096) = 48; page 12,288
    assert layouts_from_hf_config(NEMOTRON_TINY, model="n")[0].size == 12_288


def test_falcon_h1_every_layer_holds_attention_and_mamba():
    layouts = layouts_from_hf_config(FALCON_H1_TINY, model="f", platform="cpu")
    assert [(layout.group, layout.kind, layout.size) for layout in layouts] == [
        (0, "attention", 65_536), (1, "mamba2", 65_536)]
    assert [segment.layer for segment in layouts[1].segments] == [0, 1]
    conv, ssm, padding = layouts[1].segments[0].regions
    assert (conv.shape, ssm.shape, ssm.dtype, padding.length) == ((3, 160), (8, 16, 16), "float32", 32_768 - 9_152)


def test_lfm2_tiny_on_cpu():
    layouts = layouts_from_hf_config(LFM2_TINY, model="l", platform="cpu")
    assert [layout.kind for layout in layouts] == ["short_conv", "short_conv", "attention"]
    assert {layout.size for layout in layouts} == {32_768}


def test_jamba_and_granite():
    jamba = {"model_type": "jamba", "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
             "num_key_value_heads": 4, "attn_layer_period": 2, "attn_layer_offset": 1, "mamba_d_state": 16,
             "mamba_d_conv": 4, "mamba_expand": 2, "dtype": "bfloat16"}
    layouts = layouts_from_hf_config(jamba, model="j")
    assert [(layout.kind, [s.layer for s in layout.segments]) for layout in layouts] == [
        ("mamba1", [0, 2]), ("attention", [1, 3])]
    conv, ssm = layouts[0].segments[0].regions[:2]
    assert (conv.shape, ssm.shape) == ((3, 128), (128, 16))
    granite = {"model_type": "granitemoehybrid", "hidden_size": 64, "num_hidden_layers": 4,
               "num_attention_heads": 4, "num_key_value_heads": 4,
               "layer_types": ["linear_attention", "full_attention", "linear_attention", "linear_attention"],
               "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_n_groups": 1, "mamba_d_state": 16,
               "mamba_d_conv": 4, "mamba_expand": 2, "dtype": "bfloat16"}
    layouts = layouts_from_hf_config(granite, model="g")
    assert [layout.kind for layout in layouts] == ["mamba2", "mamba2", "mamba2", "attention"]
