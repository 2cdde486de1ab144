"""The audit's table of vLLM's stateful architectures (``audit.layouts.vllm_models``): every entry
is laid out or refused, and a refused one says why (issue #30 §1). Runs on CPU, without vLLM;
``test_vllm_registry.py`` checks the table against vLLM's own registry."""

from __future__ import annotations

import pytest

from audit.layouts import LayoutError, layouts_from_hf_config
from audit.layouts.families import registered_family
from audit.layouts.hf_config import read_config
from audit.layouts.vllm_models import REFUSED_MODEL_TYPES, STATEFUL_MODELS, refusal, unserved

LAID_OUT = [model for model in STATEFUL_MODELS if model.refused is None]
REFUSED = [model for model in STATEFUL_MODELS if model.refused is not None]


def test_table_counts():
    assert len({model.architecture for model in STATEFUL_MODELS}) == len(STATEFUL_MODELS) == 43  # 0.32: 39, 0.33: +4
    assert (len(LAID_OUT), len(REFUSED)) == (31, 12)


@pytest.mark.parametrize("model", LAID_OUT, ids=lambda model: model.architecture)
def test_laid_out_architectures_have_a_builder(model):
    config = {"architectures": [model.architecture], "model_type": model.model_type}
    assert registered_family(read_config(config)) is not None
    assert refusal([model.model_type], [model.architecture]) is None


@pytest.mark.parametrize("model", REFUSED, ids=lambda model: model.architecture)
def test_refused_architectures_say_why(model):
    config = {"model_type": model.model_type or "unknown", "architectures": [model.architecture],
              "num_hidden_layers": 2, "num_attention_heads": 2, "hidden_size": 64}
    with pytest.raises(LayoutError) as error:
        layouts_from_hf_config(config, model="m")
    message = str(error.value)
    assert message.startswith(f"model_type {config['model_type']!r} is not supported: {model.refused};")
    assert "\n" not in message


def test_refused_by_model_type_without_architectures():
    # a KDA wrapper's text config, no architectures field: the model type alone says why
    with pytest.raises(LayoutError, match="'kimi_linear' is not supported: Kimi Delta Attention"):
        layouts_from_hf_config({"model_type": "kimi_linear", "num_hidden_layers": 2}, model="m")
    with pytest.raises(LayoutError, match="'deepseek_v32' is not supported: sparse MLA with an indexer"):
        layouts_from_hf_config({"model_type": "deepseek_v32", "kv_lora_rank": 512, "qk_rope_head_dim": 64,
                                "num_hidden_layers": 2}, model="m")
    assert set(REFUSED_MODEL_TYPES) >= {"plamo2", "deepseek_v32", "deepseek_v4"}


def test_terratorch_plain_looking_config_is_still_refused():
    # its config has attention-like fields; the architecture refuses it before the generic layout
    config = {"model_type": "terratorch", "architectures": ["Terratorch"], "num_hidden_layers": 2,
              "num_attention_heads": 2, "hidden_size": 64}
    with pytest.raises(LayoutError, match="publishes nothing"):
        layouts_from_hf_config(config, model="m", block_size=16)


def test_a_model_only_a_later_release_registers_says_so_for_the_earlier():
    ocr, alice = ["MiniCPMOcrForConditionalGeneration"], ["AliceAIForCausalLM"]
    assert unserved(ocr, "0.32") == ("vLLM 0.32 does not serve MiniCPMOcrForConditionalGeneration "
                                     "(registered from vLLM 0.33)")
    assert unserved(ocr, "0.33") is unserved(ocr, None) is unserved(["LlamaForCausalLM"], "0.32") is None
    assert refusal([], alice, "0.32").endswith("vLLM 0.32 does not serve AliceAIForCausalLM (registered from vLLM 0.33)")
    assert refusal([], alice, "0.33").startswith("Kimi Delta Attention") and "0.32" not in refusal([], alice, "0.33")
    assert refusal([], alice).endswith("vLLM 0.33 registers it first")  # no release named


@pytest.mark.xfail(strict=True, reason="layouts_from_hf_config does not ask vllm_models.unserved yet: it needs "
                                       "versions.rules_key to keep 0.32 and 0.33 apart for a model only 0.33 serves "
                                       "(else a 0.33 producer's candidates are dropped with 0.32's refusal)")
def test_a_laid_out_model_only_0_33_serves_is_refused_for_0_32():
    config = {"model_type": "minicpm_ocr", "architectures": ["MiniCPMOcrForConditionalGeneration"],
              "text_config": {"model_type": "qwen3_5_text", "hidden_size": 128, "num_hidden_layers": 4,
                              "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
                              "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                              "linear_num_key_heads": 8, "linear_num_value_heads": 8,
                              "layer_types": ["linear_attention"] * 3 + ["full_attention"]}}
    assert len(layouts_from_hf_config(config, model="m", vllm_version="0.33")) == 2
    with pytest.raises(LayoutError, match="vLLM 0.32 does not serve MiniCPMOcrForConditionalGeneration"):
        layouts_from_hf_config(config, model="m", vllm_version="0.32")
