"""Bytes per key derived by hand from vLLM's formulas, checked against layouts_from_hf_config.

Formulas (vLLM mamba_utils.py, kv_cache_interface.py, platforms/interface.py):
  Mamba1 page = (d_conv-1)*(d_inner/tp)*conv + (d_inner/tp)*d_state*ssm
  Mamba2 page = (d_conv-1)*((d_inner + 2*G*N)/tp)*conv + (H/tp)*P*N*ssm, G extended to tp if G % tp
  GDN page    = (k-1)*((2*Hk*Dk + Hv*Dv)/tp)*conv + (Hv/tp)*Dv*Dk*ssm
  attention bytes/token = 2 * max(1, kv_heads/tp) * head_dim * kv
  hybrid block = 16 * ceil(mamba_page / (16 * bytes/token)); page = block * bytes/token
"""

from __future__ import annotations

import json

import pytest

from audit.layouts import LayoutError, layouts_from_hf_config, load_hf_config

from .configs import CODESTRAL, LFM2_1_2B, MAMBA_130M, QWEN3_5_9B, QWEN3_NEXT


def _regions(segment):
    return {region.name: region for region in segment.regions}


def test_mamba_130m_tp1_bf16():
    # conv (3, 1536) = 4,608 el; ssm (1536, 16) = 24,576 el; 29,184 el x 2 B = 58,368 B/layer
    # 24 layers x 58,368 = 1,400,832 B per key.
    # (FACTS.md section 2 says 28,672 el / 1,376,256 B: it counts the conv state as 4,096 el,
    # but 3 x 1,536 = 4,608.)
    [layout] = layouts_from_hf_config(MAMBA_130M, model="state-spaces/mamba-130m-hf")
    assert (layout.model, layout.group, layout.kind, layout.tp_size) == ("mamba-130m-hf", 0, "mamba1", 1)
    assert len(layout.segments) == 24
    first = layout.segments[0]
    conv, ssm = first.regions
    assert (conv.name, conv.shape, conv.length, conv.offset) == ("conv", (3, 1536), 9_216, 0)
    assert (ssm.name, ssm.shape, ssm.length, ssm.offset) == ("ssm", (1536, 16), 49_152, 9_216)
    assert first.length == 58_368
    assert layout.segments[23].offset == 23 * 58_368
    assert layout.size == 1_400_832


def test_mamba_130m_tp2_halves_the_value():
    # d_inner/2 = 768: conv (3, 768) 4,608 B + ssm (768, 16) 24,576 B = 29,184 B; x 24 = 700,416
    [layout] = layouts_from_hf_config(MAMBA_130M, model="mamba-130m-hf", tp_size=2)
    assert _regions(layout.segments[0])["conv"].shape == (3, 768)
    assert layout.segments[0].length == 29_184
    assert layout.size == 700_416


def test_separate_ssm_dtype_float32():
    # conv stays bf16: 4,608 x 2 = 9,216; ssm float32: 24,576 x 4 = 98,304; 107,520 B/layer
    # x 24 = 2,580,480 B per key
    [layout] = layouts_from_hf_config(MAMBA_130M, model="mamba-130m-hf", ssm_dtype="float32")
    regions = _regions(layout.segments[0])
    assert (regions["conv"].dtype, regions["ssm"].dtype) == ("bfloat16", "float32")
    assert regions["ssm"].offset == 9_216 and regions["ssm"].length == 98_304
    assert layout.size == 2_580_480


def test_conv_layout_ds_transposes_shape_not_bytes():
    [sd] = layouts_from_hf_config(MAMBA_130M, model="m", conv_layout="SD")
    [ds] = layouts_from_hf_config(MAMBA_130M, model="m", conv_layout="DS")
    assert _regions(sd.segments[0])["conv"].shape == (3, 1536)
    assert _regions(ds.segments[0])["conv"].shape == (1536, 3)
    assert ds.size == sd.size == 1_400_832
    with pytest.raises(LayoutError, match="conv layout"):
        layouts_from_hf_config(MAMBA_130M, model="m", conv_layout="XY")


def test_codestral_tp1():
    # d_inner = 2 x 4096 = 8192; conv dim = 8192 + 2*8*128 = 10,240
    # conv (3, 10240) bf16 = 61,440 B; ssm (128, 64, 128) = 1,048,576 el x 2 = 2,097,152 B
    # page 2,158,592 B x 64 layers = 138,149,888 B per key
    [layout] = layouts_from_hf_config(CODESTRAL, model="Mamba-Codestral-7B-v0.1")
    regions = _regions(layout.segments[0])
    assert regions["conv"].shape == (3, 10_240) and regions["conv"].length == 61_440
    assert regions["ssm"].shape == (128, 64, 128) and regions["ssm"].length == 2_097_152
    assert layout.kind == "mamba2" and len(layout.segments) == 64
    assert layout.size == 138_149_888


def test_codestral_tp2():
    # conv (3, 5120) = 30,720 B; ssm (64, 64, 128) = 1,048,576 B; 1,079,296 B x 64 = 69,074,944
    [layout] = layouts_from_hf_config(CODESTRAL, model="Mamba-Codestral-7B-v0.1", tp_size=2)
    assert layout.segments[0].length == 1_079_296
    assert layout.size == 69_074_944


def test_codestral_tp16_extends_groups():
    # 8 groups % 16 ranks != 0: vLLM adds 16 - 8 = 8 groups -> 16
    # conv dim = (8192 + 2*16*128) / 16 = 12,288 / 16 = 768: (3, 768) = 4,608 B
    # ssm (128/16 = 8, 64, 128) = 65,536 el x 2 = 131,072 B; page 135,680 B x 64 = 8,683,520
    [layout] = layouts_from_hf_config(CODESTRAL, model="c", tp_size=16)
    regions = _regions(layout.segments[0])
    assert regions["conv"].shape == (3, 768)
    assert regions["ssm"].shape == (8, 64, 128)
    assert layout.size == 8_683_520


def test_qwen3_next_tp1_groups_and_padding():
    # GDN conv dim = 2*16*128 + 32*128 = 8,192: conv (3, 8192) bf16 = 49,152 B
    # ssm (32, 128, 128) bf16 = 1,048,576 B; mamba page = 1,097,728 B
    # attention bytes/token = 2 * 2 kv heads * 256 * 2 B = 2,048
    # block = 16 * ceil(1,097,728 / 32,768 = 33.5) = 16 * 34 = 544 tokens (vLLM logs 544)
    # page = 544 * 2,048 = 1,114,112 B; padding = 1,114,112 - 1,097,728 = 16,384 B
    # 36 GDN + 12 attention layers -> group size 12 -> 3 GDN groups + 1 attention group,
    # 12 segments each: 12 x 1,114,112 = 13,369,344 B per key, every group
    layouts = layouts_from_hf_config(QWEN3_NEXT, model="Qwen/Qwen3-Next-80B-A3B-Instruct")
    assert [layout.kind for layout in layouts] == ["gdn", "gdn", "gdn", "attention"]
    assert [layout.group for layout in layouts] == [0, 1, 2, 3]
    # GDN layers [0,1,2,4,5,6,...] split as layers[g::3]; attention is every 4th layer
    for group, layout in enumerate(layouts):
        assert [segment.layer for segment in layout.segments] == list(range(group, 48, 4))
        assert len(layout.segments) == 12
        assert layout.size == 13_369_344
    conv, ssm, padding = layouts[0].segments[1].regions
    assert conv.offset == 1_114_112 and conv.shape == (3, 8192) and conv.length == 49_152
    assert ssm.shape == (32, 128, 128) and ssm.length == 1_048_576
    assert (padding.kind, padding.offset, padding.length) == ("padding", 1_114_112 + 1_097_728, 16_384)
    # attention page: K and V of 544 tokens x 2 heads x 256, bf16 = 1,114,112 B, one region
    (kv,) = layouts[3].segments[0].regions
    assert (kv.name, kv.kind, kv.shape, kv.length, kv.offset) == ("kv", "kv", (2, 544, 512), 1_114_112, 0)


def test_qwen3_next_tp2():
    # conv (3, 4096) = 24,576 B; ssm (16, 128, 128) bf16 = 524,288 B; mamba page 548,864 B
    # bytes/token = 2 * (2/2 = 1) * 256 * 2 = 1,024; block = 16 * ceil(548,864 / 16,384 = 33.5) = 544
    # page = 544 * 1,024 = 557,056; padding 8,192; 12 x 557,056 = 6,684,672 B per key
    layouts = layouts_from_hf_config(QWEN3_NEXT, model="Qwen3-Next-80B-A3B-Instruct", tp_size=2)
    assert all(layout.size == 6_684_672 for layout in layouts)
    assert layouts[0].segments[0].regions[-1].length == 8_192


def test_qwen3_next_block_size_as_logged_or_larger():
    default = layouts_from_hf_config(QWEN3_NEXT, model="q")
    # passing the 544 vLLM logged gives the same layout as its default (16)
    assert layouts_from_hf_config(QWEN3_NEXT, model="q", block_size=544) == default
    # --block-size 1024: align = 1024, ceil(1,097,728 / (1024 * 2,048)) = 1 -> 1024 tokens
    # page = 1024 * 2,048 = 2,097,152; padding = 2,097,152 - 1,097,728 = 999,424
    bigger = layouts_from_hf_config(QWEN3_NEXT, model="q", block_size=1024)
    assert bigger[0].segments[0].length == 2_097_152
    assert bigger[0].segments[0].regions[-1].length == 999_424
    assert bigger[3].segments[0].regions[0].shape == (2, 1024, 512)


def test_qwen3_next_fp8_kv_cache_needs_no_padding():
    # bytes/token = 2 * 2 * 256 * 1 = 1,024; block = 16 * ceil(1,097,728 / 16,384 = 67.0) = 1072
    # page = 1072 * 1,024 = 1,097,728 = the mamba page exactly: no padding region
    layouts = layouts_from_hf_config(QWEN3_NEXT, model="q", kv_cache_dtype="fp8")
    assert [region.name for region in layouts[0].segments[0].regions] == ["conv", "ssm"]
    kv = layouts[3].segments[0].regions[0]
    assert (kv.dtype, kv.shape, kv.length) == ("float8_e4m3fn", (2, 1072, 512), 1_097_728)


def test_kernel_block_size_is_the_hybrid_alignment():
    # ROCm AITER's kernel block 64: block = 64 * ceil(1,097,728 / (64 * 2,048) = 8.4) = 576
    layouts = layouts_from_hf_config(QWEN3_NEXT, model="q", kernel_block_size=64)
    assert layouts[3].segments[0].regions[0].shape == (2, 576, 512)
    assert layouts[0].size == 12 * 576 * 2_048
    # the CPU backend's 32: 32 * ceil(33.5 / 2) = 544, as with 16
    assert layouts_from_hf_config(QWEN3_NEXT, model="q", kernel_block_size=32)[0].size == 13_369_344


def test_qwen3_5_9b_tp2_matches_the_53084_report():
    # The #53084 report hashed 8,650,752-byte values of Qwen3.5-9B at TP 2.
    # conv (3, 8192/2 = 4096) bf16 = 24,576 B; ssm (32/2 = 16, 128, 128) float32 (config's
    # mamba_ssm_dtype) = 262,144 el x 4 = 1,048,576 B; mamba page = 1,073,152 B
    # bytes/token = 2 * (4/2 = 2) * 256 * 2 = 2,048; block = 16 * ceil(1,073,152 / 32,768 = 32.75)
    # = 528; page = 528 * 2,048 = 1,081,344; padding 8,192
    # 24 GDN + 8 attention layers -> 3 GDN groups + 1 attention group, 8 segments:
    # 8 x 1,081,344 = 8,650,752 B per key
    layouts = layouts_from_hf_config(QWEN3_5_9B, model="Qwen/Qwen3.5-9B", tp_size=2)
    assert [layout.kind for layout in layouts] == ["gdn", "gdn", "gdn", "attention"]
    assert all(layout.size == 8_650_752 for layout in layouts)
    conv, ssm, padding = layouts[2].segments[0].regions
    assert ssm.dtype == "float32" and ssm.length == 1_048_576
    assert padding.length == 8_192


def test_explicit_ssm_dtype_overrides_config():
    # ssm bf16: 16*128*128*2 = 524,288; page 24,576 + 524,288 = 548,864
    # block = 16 * ceil(548,864 / 32,768 = 16.75) = 272; page = 272 * 2,048 = 557,056; x 8 = 4,456,448
    layouts = layouts_from_hf_config(QWEN3_5_9B, model="Qwen3.5-9B", tp_size=2, ssm_dtype="bfloat16")
    assert layouts[0].size == 4_456_448


def test_lfm2_unused_slot_in_smaller_groups():
    # conv (3-1, 2048) bf16 = 8,192 B; bytes/token = 2 * 8 * (2048/32 = 64) * 2 = 2,048
    # block = 16 * ceil(8,192 / 32,768) = 16; page = 32,768; padding = 24,576
    # 10 conv + 6 attention: 10 < 1.5*6 is false -> group size 6 -> conv split in 2 groups of 5
    # conv layers [0,1,3,4,6,7,9,11,13,15]: [0::2] = 0,3,6,9,13  [1::2] = 1,4,7,11,15
    # 6 segments (the attention group has 6 layers): the conv groups' 6th slot holds no layer
    # of theirs. 6 x 32,768 = 196,608 B per key.
    layouts = layouts_from_hf_config(LFM2_1_2B, model="LFM2-1.2B")
    assert [layout.kind for layout in layouts] == ["short_conv", "short_conv", "attention"]
    assert [[s.layer for s in layout.segments] for layout in layouts] == [
        [0, 3, 6, 9, 13, -1], [1, 4, 7, 11, 15, -1], [2, 5, 8, 10, 12, 14]]
    conv, padding = layouts[0].segments[0].regions
    assert conv.shape == (2, 2048) and conv.length == 8_192 and padding.length == 24_576
    unused = layouts[1].segments[5]
    assert unused.name == "unused.5"
    [region] = unused.regions
    assert (region.kind, region.offset, region.length) == ("padding", 5 * 32_768, 32_768)
    assert all(layout.size == 196_608 for layout in layouts)


def test_nemotron_h_pattern():
    # Synthetic Nemotron-H: pattern M-M*M-M* -> mamba at 0,2,4,6; attention at 3,7; MLP none
    # conv dim = 8*16 + 2*2*16 = 192: (3, 192) bf16 = 1,152 B; ssm (8, 16, 16) bf16 = 4,096 B
    # mamba page 5,248; bytes/token = 2*2*32*2 = 256; block = 16*ceil(5,248/4,096) = 32
    # page = 32*256 = 8,192; padding 2,944. group size 2: mamba [0,4], [2,6]; attention [3,7]
    config = {"model_type": "nemotron_h", "hybrid_override_pattern": "M-M*M-M*",
              "mamba_num_heads": 8, "mamba_head_dim": 16, "n_groups": 2, "ssm_state_size": 16,
              "conv_kernel": 4, "num_key_value_heads": 2, "head_dim": 32}
    layouts = layouts_from_hf_config(config, model="nemotron", ssm_dtype="bfloat16")
    assert [[s.layer for s in layout.segments] for layout in layouts] == [[0, 4], [2, 6], [3, 7]]
    assert [layout.kind for layout in layouts] == ["mamba2", "mamba2", "attention"]
    assert [r.length for r in layouts[0].segments[0].regions] == [1_152, 4_096, 2_944]
    assert layouts[0].size == 16_384
    # without --ssm-dtype vLLM keeps Nemotron-H's ssm state in float32 (8,192 B): mamba page
    # 9,344; block = 16*ceil(9,344/4,096) = 48; page 12,288
    default = layouts_from_hf_config(config, model="nemotron")
    assert [r.length for r in default[0].segments[0].regions] == [1_152, 8_192, 2_944]
    # transformers 5 names: layers_block_type with linear_attention / full_attention / mlp
    named = dict(config, layers_block_type=["linear_attention", "mlp", "linear_attention", "full_attention"] * 2)
    del named["hybrid_override_pattern"]
    assert layouts_from_hf_config(named, model="nemotron") == default


def test_unknown_model_type():
    with pytest.raises(LayoutError, match="model_type 'plamo2' is not supported") as error:
        layouts_from_hf_config({"model_type": "plamo2", "mamba_d_state": 64}, model="x")
    assert "\n" not in str(error.value)


def test_missing_field_is_named():
    config = dict(MAMBA_130M)
    del config["state_size"]
    with pytest.raises(LayoutError, match="'state_size'"):
        layouts_from_hf_config(config, model="x")


def test_tp_that_does_not_divide():
    with pytest.raises(LayoutError, match="not divisible by tp_size=5"):
        layouts_from_hf_config(MAMBA_130M, model="x", tp_size=5)


def test_unknown_dtype():
    with pytest.raises(LayoutError, match="unknown dtype 'int4'"):
        layouts_from_hf_config(MAMBA_130M, model="x", state_dtype="int4")


def test_load_hf_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(MAMBA_130M))
    assert load_hf_config(tmp_path) == MAMBA_130M
    assert load_hf_config(tmp_path / "config.json") == MAMBA_130M
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(LayoutError, match="config.json: not JSON"):
        load_hf_config(tmp_path)
    with pytest.raises(LayoutError, match="cannot read"):
        load_hf_config(tmp_path / "missing.json")
