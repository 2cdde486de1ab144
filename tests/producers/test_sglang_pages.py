"""SGLang pages read by their model's config: one rank's page of an MHA pool's K or V, or of an MLA
pool's latent, sized `page tokens x layers x numbers per token and layer` in a dtype the key does
not say; the bytes choose the dtype before any NaN verdict rests on it."""

import numpy as np
import pytest

from audit.judge.plan import CheckPlan
from audit.judge.values import SAMPLE_BYTES, value_reading
from audit.layouts.infer import LayoutRequest
from audit.producers.sglang.pages import page_geometry
from tests.helpers import check_in_buffer
from audit.records import Verdict

PREFIX = "probe_Qwen-Qwen3-0.6B"
PAGE = f"{0xABC000:064x}"


def qwen(**extra) -> dict:
    """A small Qwen3: 2 layers, 2 KV heads of 64 (1 per rank at TP 2), bfloat16."""
    return {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": 256,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "num_hidden_layers": 2,
            "intermediate_size": 512, "vocab_size": 1000, "torch_dtype": "bfloat16", **extra}


def deepseek(**extra) -> dict:
    """A small MLA model: 2 layers, a latent of 64 + 16."""
    return {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 256,
            "num_attention_heads": 4, "num_key_value_heads": 4, "num_hidden_layers": 2, "kv_lora_rank": 64,
            "qk_rope_head_dim": 16, "qk_nope_head_dim": 32, "v_head_dim": 32, "vocab_size": 1000,
            "torch_dtype": "bfloat16", **extra}


CONFIGS = {"Qwen3-0.6B": qwen()}


def page(rng, numbers: int, dtype=np.float32, *, bfloat16: bool = True) -> bytes:
    """`numbers` random KV numbers: bfloat16 (float32's high halves) or `dtype`."""
    values = rng.standard_normal(numbers).astype(np.float32)
    if bfloat16:
        return (values.view(np.uint32) >> 16).astype(np.uint16).tobytes()
    return values.astype(dtype).tobytes()


def reading(name: str, value: bytes, configs=CONFIGS):
    found = value_reading(name, np.frombuffer(value, dtype=np.uint8), configs)
    return None if found is None else found[1]


def scan(values: dict[str, bytes], config: dict, model: str = "Qwen3-0.6B") -> dict:
    """check_batch over the values in one host buffer, as a scan with --model-config."""
    plan = CheckPlan(requests=[LayoutRequest(config, f"/models/{model}", block_size=16)], keep_regions=True)
    return check_in_buffer(values, plan)


def test_an_mha_page_at_tp_2_fits_and_its_bytes_choose_bfloat16():
    value = page(np.random.default_rng(0), 4 * 2 * 1 * 64)  # 4 tokens x 2 layers x 1 head x 64
    found = reading(f"{PREFIX}_{PAGE}_1_k", value)
    assert len(value) == 1024 and found.disagreements == () and found.layout.size == 1024
    [(_, region)] = list(found.layout.regions())
    assert (region.name, region.dtype, region.shape) == ("k", "bfloat16", (512,))
    # float16 reads bfloat16's bytes as sane numbers too: both stay, the config's first; float32
    # and fp8 are out (a float32 word's low half is noise, fp8 reads NaN patterns in it).
    assert [region.dtype for layout in found.alternatives for _, region in layout.regions()] == ["float16"]
    decoded = found.decoded["sglang_page"]
    assert decoded["pool"] == "MHA" and decoded["dtypes"][0] == "bfloat16"
    assert {"bytes_per_number": 2, "page_tokens": 4, "layers": 2, "numbers_per_token_and_layer": 64} in decoded["fits"]
    assert found.decoded["reading"]["dtypes"] == ["bfloat16", "float16"]


def test_a_float32_page_is_read_as_float32_by_its_bytes_not_as_the_configs_bfloat16():
    value = page(np.random.default_rng(1), 4 * 2 * 128, bfloat16=False)  # served with --dtype float32
    found = reading(f"{PREFIX}_{PAGE}_0_v", value)
    assert [region.dtype for _, region in found.layout.regions()] == ["float32"]
    assert found.decoded["sglang_page"]["dtypes"][0] == "bfloat16"  # the config's, tried first
    records = scan({f"{PREFIX}_{PAGE}_0_k": value, f"{PREFIX}_{PAGE}_0_v": value[::-1][::-1]}, qwen())
    assert all(record.verdicts == [] for record in records.values())


def test_nan_in_a_bfloat16_page_is_nonfinite_and_a_clean_page_beside_it_is_not():
    rng = np.random.default_rng(2)
    clean, broken = page(rng, 4 * 2 * 128), bytearray(page(rng, 4 * 2 * 128))
    broken[100:102] = np.array([0x7FC0], dtype=np.uint16).tobytes()  # one bfloat16 NaN
    records = scan({f"{PREFIX}_{PAGE}_0_k": clean, f"{PREFIX}_{PAGE}_0_v": bytes(broken)}, qwen())
    assert records[f"{PREFIX}_{PAGE}_0_k"].verdicts == []
    assert records[f"{PREFIX}_{PAGE}_0_v"].verdicts == [Verdict.NONFINITE]


def test_a_truncated_page_is_a_size_mismatch_with_what_was_tried():
    value = page(np.random.default_rng(3), 64 * 2 * 128)[:-20]  # 32,748 B: no whole geometry
    found = reading(f"{PREFIX}_{PAGE}_0_k", value)
    assert found.layout is None
    [disagreement] = found.disagreements
    assert disagreement.kind == "size" and disagreement.evidence["value_size"] == 32_748
    assert disagreement.evidence["numbers_per_token_and_layer"] == [64, 128]
    records = scan({f"{PREFIX}_{PAGE}_0_k": value}, qwen())
    assert records[f"{PREFIX}_{PAGE}_0_k"].verdicts == [Verdict.SIZE_MISMATCH]


def test_a_zero_page_stays_zero_value_under_a_config():
    records = scan({f"{PREFIX}_{PAGE}_0_k": bytes(1024)}, qwen())
    assert Verdict.ZERO_VALUE in records[f"{PREFIX}_{PAGE}_0_k"].verdicts


def test_an_mla_page_at_a_pp_stage_reads_the_lone_number_as_the_stage():
    config = {"DeepSeek-V3-tiny": deepseek()}
    value = page(np.random.default_rng(4), 4 * 1 * 80)  # stage 1 of 2 holds 1 layer
    found = reading(f"t_org-DeepSeek-V3-tiny_{PAGE}_1_k", value, config)
    assert found.disagreements == () and found.decoded["sglang_page"]["pool"] == "MLA"
    assert found.decoded["sglang_page"]["layers"] == [1, 1]
    assert reading(f"t_org-DeepSeek-V3-tiny_{PAGE}__k", page(np.random.default_rng(5), 4 * 2 * 80), config) \
        .disagreements == ()


def test_heads_per_rank_follow_the_rank_in_the_key():
    # 8 KV heads: rank 5 needs a TP size above 5, so 8 heads (TP 1), 4 (TP 2) and 2 (TP 4) are out.
    assert page_geometry({"part": "k", "tp_rank": 5}, qwen(num_key_value_heads=8)).rows == (64,)
    assert page_geometry({"part": "k", "tp_rank": 0}, qwen(num_key_value_heads=8)).rows == (64, 128, 256, 512)
    assert page_geometry({"part": "v", "tp_rank": 0, "pp_rank": 1}, qwen()).layers == (1,)


def test_a_v_page_of_a_model_with_another_v_head_dim_is_sized_by_it():
    # MiMo-V2-like: K heads of 64, V heads of 32 (SGLang's AsymmetricMHATokenToKVPoolHost).
    config = qwen(v_head_dim=32)
    assert page_geometry({"part": "k", "tp_rank": 1}, config).rows == (64,)
    assert page_geometry({"part": "v", "tp_rank": 1}, config).rows == (32,)
    value = page(np.random.default_rng(9), 4 * 2 * 32)  # 4 tokens x 2 layers x 1 head x 32
    assert reading(f"{PREFIX}_{PAGE}_1_v", value, {"Qwen3-0.6B": config}).disagreements == ()


@pytest.mark.parametrize("fields, config", [
    ({"part": "draft_k", "tp_rank": 0}, qwen()),                          # a draft model's pool
    ({"part": "swa_k", "tp_rank": 0}, qwen()),                            # SWA pool
    ({"part": "temporal", "tp_rank": 0}, qwen()),                         # Mamba pool
    ({"part": "k", "tp_rank": 0}, qwen(layer_types=["full_attention", "sliding_attention"])),
    ({"part": "k", "tp_rank": 0}, {"model_type": "qwen3_next", "num_hidden_layers": 4}),  # hybrid
    ({"part": "k"}, qwen()),                                              # `__k`: not an MHA pool's
    ({"part": "v", "tp_rank": 0}, deepseek()),                            # MLA writes no `_v`
    ({"part": "k", "dcp_rank": 0, "cp_rank": 0}, deepseek()),             # DCP shard
])
def test_pages_the_config_does_not_size_are_left_to_their_bytes(fields, config):
    assert page_geometry(fields, config) is None


def test_only_the_model_the_prefix_names_is_used():
    value = page(np.random.default_rng(6), 4 * 2 * 64)
    assert reading(f"probe_Qwen-Qwen3-1.7B_{PAGE}_1_k", value) is None
    assert reading(f"{PAGE}_1_k", value) is None  # no prefix: no model named
    assert reading(f"Qwen3-0.6B_{PAGE}_1_k", value) is not None  # the model as the whole prefix


def test_a_verdict_only_one_undecided_dtype_gives_is_withheld():
    # 0x7C01 is a float16 NaN but a finite bfloat16 (about 2.6e36, far out of any KV's range,
    # which the bytes' test sees: neither reading is clean, both stay). Only float16 finds a NaN:
    # the verdict rests on a dtype the bytes did not confirm, so it is withheld, and the key is
    # AMBIGUOUS_LAYOUT rather than clean.
    value = bytearray(page(np.random.default_rng(7), 4 * 2 * 128))
    value[0:2] = np.array([0x7C01], dtype=np.uint16).tobytes()
    record = scan({f"{PREFIX}_{PAGE}_0_k": bytes(value)}, qwen())[f"{PREFIX}_{PAGE}_0_k"]
    assert Verdict.NONFINITE not in record.verdicts and Verdict.AMBIGUOUS_LAYOUT in record.verdicts
    assert record.evidence["ambiguous_layout"]["withheld"] == [Verdict.NONFINITE]


@pytest.mark.parametrize("pattern", [0x7FC0, 0x7F80])  # every number a bfloat16 NaN, or +Inf
def test_a_page_of_nothing_but_nan_or_inf_is_nonfinite_under_every_dtype(pattern):
    # No dtype decodes it plausibly, so the bytes choose none; every reading finds non-finite
    # numbers in it, so the verdict stands.
    value = np.full(4 * 2 * 128, pattern, dtype=np.uint16).tobytes()
    record = scan({f"{PREFIX}_{PAGE}_0_k": value}, qwen())[f"{PREFIX}_{PAGE}_0_k"]
    assert record.verdicts == [Verdict.NONFINITE]
    assert len(record.evidence["decoded"]["reading"]["dtypes"]) >= 2


def test_a_large_page_is_read_by_its_leading_bytes_and_checked_whole():
    # Twice SAMPLE_BYTES of float32 (2 layers x 2 heads x 64, a whole number of tokens): the dtype
    # is chosen from the first SAMPLE_BYTES, and the NaN past them is still found.
    value = bytearray(page(np.random.default_rng(8), SAMPLE_BYTES // 2, bfloat16=False))
    value[-4:] = np.array([np.nan], dtype=np.float32).tobytes()
    found = reading(f"{PREFIX}_{PAGE}_0_k", bytes(value))
    assert len(value) == 2 * SAMPLE_BYTES and found.decoded["reading"]["dtypes"] == ["float32"]
    record = scan({f"{PREFIX}_{PAGE}_0_k": bytes(value)}, qwen())[f"{PREFIX}_{PAGE}_0_k"]
    assert record.verdicts == [Verdict.NONFINITE]


# A Nemotron-H: 2 Mamba2 layers (ssm 8 heads x 16 x 16, conv (128 + 2 x 16) x 3 at TP 1), 1 attention
# layer of 1 KV head of 64. SGLang's Mamba pool: one state slot a page, its layers back to back.
NEMOTRON = {"model_type": "nemotron_h", "hidden_size": 64, "dtype": "bfloat16",
            "layers_block_type": ["linear_attention", "full_attention", "linear_attention", "mlp"],
            "num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": 64, "ssm_state_size": 16,
            "mamba_num_heads": 8, "mamba_head_dim": 16, "n_groups": 1, "conv_kernel": 4}
HYBRID = {"Nemotron-H-tiny": NEMOTRON}
HYBRID_PREFIX = "t_nvidia-Nemotron-H-tiny"


def test_a_mamba_pools_temporal_page_is_one_segment_per_state_layer():
    value = page(np.random.default_rng(10), 2 * 2048, bfloat16=False)  # float32 ssm, 2 layers
    found = reading(f"{HYBRID_PREFIX}_{PAGE}_0_temporal", value, HYBRID)
    assert found.disagreements == () and found.decoded["sglang_page"]["pool"] == "Mamba"
    assert [(segment.name, region.kind, region.dtype, region.shape) for segment, region in found.layout.regions()] \
        == [("layers.0", "state", "float32", (2048,)), ("layers.1", "state", "float32", (2048,))]


def test_a_zero_state_layer_in_a_mamba_page_is_partial_zero_and_a_zero_page_zero_state():
    rng = np.random.default_rng(11)
    half = bytearray(page(rng, 2 * 2048, bfloat16=False))
    half[2048 * 4:] = bytes(2048 * 4)  # the second state layer all zero
    other = f"{0xABC001:064x}"
    records = scan({f"{HYBRID_PREFIX}_{PAGE}_0_temporal": bytes(half), f"{HYBRID_PREFIX}_{other}_1_temporal":
                    bytes(2 * 1024 * 4), f"{HYBRID_PREFIX}_{PAGE}_0_conv_0": page(rng, 2 * 480)},
                   NEMOTRON, "Nemotron-H-tiny")
    assert records[f"{HYBRID_PREFIX}_{PAGE}_0_temporal"].verdicts == [Verdict.PARTIAL_ZERO]
    assert records[f"{HYBRID_PREFIX}_{PAGE}_0_temporal"].evidence["partial_zero"]["zero_layers"] == [1]
    assert Verdict.ZERO_STATE in records[f"{HYBRID_PREFIX}_{other}_1_temporal"].verdicts
    assert records[f"{HYBRID_PREFIX}_{PAGE}_0_conv_0"].verdicts == []


def test_a_hybrids_kv_page_holds_its_attention_layers_only():
    geometry = page_geometry({"part": "k", "tp_rank": 0}, NEMOTRON)
    assert (geometry.pool, geometry.layers, geometry.rows) == ("MHA", (1, 2, 3, 4, 5), (64,))
    value = page(np.random.default_rng(12), 4 * 1 * 64)  # 4 tokens x 1 attention layer x 64
    assert reading(f"{HYBRID_PREFIX}_{PAGE}_0_k", value, HYBRID).disagreements == ()


def test_a_mamba_page_of_no_state_size_is_a_size_mismatch_and_other_conv_states_are_left_alone():
    found = reading(f"{HYBRID_PREFIX}_{PAGE}_0_temporal", page(np.random.default_rng(13), 2 * 2048)[:-8], HYBRID)
    assert [d.kind for d in found.disagreements] == ["size"]
    assert found.disagreements[0].evidence["numbers_per_token_and_layer"] == [256, 512, 1024, 2048]
    assert page_geometry({"part": "conv_1", "tp_rank": 0}, NEMOTRON) is None  # one conv state per layer
    # At TP 2 a rank holds half the ssm heads: rank 1 is never TP 1.
    assert page_geometry({"part": "temporal", "tp_rank": 1}, NEMOTRON).rows == (256, 512, 1024)
