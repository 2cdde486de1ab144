"""An attention key (no state region: KV pages, MLA latents) is judged by its layers' KV: every layer
zero is ZERO_VALUE, some layers zero PARTIAL_ZERO (issue #30 §4: one MLA layer's latent planted as
zeros beside real keys was no finding)."""

from __future__ import annotations

import numpy as np
import pytest

from audit.checks.host import HostChecker
from audit.judge.key import judge_read
from audit.layouts import layouts_from_hf_config
from audit.records import KeyInfo, Verdict
from tests.layouts.test_families import LLAMA_TINY

DEEPSEEK_TINY = {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 64,
                 "num_hidden_layers": 3, "num_attention_heads": 2, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
                 "qk_nope_head_dim": 32, "v_head_dim": 32, "q_lora_rank": None, "dtype": "bfloat16",
                 "first_k_dense_replace": 3, "n_routed_experts": 4, "num_experts_per_tok": 2}


def _judged(layout, zero_layers: set[int]):
    value = np.tile(np.array([0x80, 0x3F], np.uint8), layout.size // 2)  # bfloat16 1.0 everywhere
    for segment in layout.segments:
        if segment.layer in zero_layers:
            for region in segment.regions:
                value[region.offset: region.offset + region.length] = 0
    (check,) = HostChecker().check_values(value, [(0, layout.size, layout)])
    return judge_read(KeyInfo("k", layout.size), layout.size, check, layout=layout)


@pytest.mark.parametrize("config", [dict(LLAMA_TINY, num_hidden_layers=3), DEEPSEEK_TINY], ids=["llama", "mla"])
def test_one_layer_of_kv_zero_is_partial_zero_and_every_layer_zero_value(config):
    (layout,) = layouts_from_hf_config(config, model="m", block_size=16)
    assert layout.kind == "attention" and [segment.layer for segment in layout.segments] == [0, 1, 2]
    assert _judged(layout, set()).verdicts == []
    one = _judged(layout, {2})
    assert one.verdicts == [Verdict.PARTIAL_ZERO]
    assert one.evidence["partial_zero"] == {"zero_layers": [2], "layers": 3, "regions": "kv"}
    assert _judged(layout, {0, 2}).evidence["partial_zero"]["zero_layers"] == [0, 2]
    assert _judged(layout, {0, 1, 2}).verdicts == [Verdict.ZERO_VALUE]
