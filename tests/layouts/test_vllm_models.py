"""The audit's table of vLLM's stateful architectures (``audit.layouts.vllm_models``): every entry
is laid out or refused, and a refused one says why (issue #30 §1). Runs on CPU, without vLLM;
``test_vllm_registry.py`` checks the table against vLLM's own registry."""

from __future__ import annotations

import pytest

from audit.layouts import LayoutError, layouts_from_hf_config
from audit.layouts.hf_config import _builder
from audit.layouts.vllm_models import REFUSED_MODEL_TYPES, STATEFUL_MODELS, refusal

LAID_OUT = [model for model in STATEFUL_MODELS if model.refused is None]
REFUSED = [model for model in STATEFUL_MODELS if model.refused is not None]


def test_table_counts():
    assert len({model.architecture for model in STATEFUL_MODELS}) == len(STATEFUL_MODELS) == 39
    assert (len(LAID_OUT), len(REFUSED)) == (28, 11)


@pytest.mark.parametrize("model", LAID_OUT, ids=lambda model: model.architecture)
def test_laid_out_architectures_have_a_builder(model):
    config = {"architectures": [model.architecture]}
    assert _builder(config, model.model_type) is not None
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
