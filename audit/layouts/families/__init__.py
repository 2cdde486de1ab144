"""Which family a config is, by its (text) model type or, failing that, its architecture.

The second step of laying a model out (docs/layouts.md §11). A family is one module of this
package; a new one is that module and one line below. Model types vLLM refuses, or whose caches
the audit does not model, are refused by name with the reason (`audit.layouts.vllm_models`);
a config of no known type gets the generic attention layout only if it has attention fields only.
"""

from __future__ import annotations

from ..hf_config import ModelConfig
from ..model import LayoutError
from ..vllm_models import refusal
from .attention import ATTENTION_MODEL_TYPES, ATTENTION_ONLY, is_plain_attention
from .base import Family, Options
from .gdn import OLMO_HYBRID, QWEN_GDN
from .linear_attention import BAILING_LINEAR
from .mamba1 import JAMBA, MAMBA1
from .mamba2 import FALCON_H1, GRANITE, MAMBA2, NEMOTRON_H, ZAMBA2
from .mla import MLA
from .short_conv import LFM2

# The families with recurrent state or a latent cache, by (text) model type.
BY_MODEL_TYPE: dict[str, Family] = {
    "mamba": MAMBA1,
    "falcon_mamba": MAMBA1,
    "mamba2": MAMBA2,
    "qwen3_next": QWEN_GDN,
    "qwen3_5": QWEN_GDN,
    "qwen3_5_text": QWEN_GDN,
    "qwen3_5_moe": QWEN_GDN,
    "qwen3_5_moe_text": QWEN_GDN,
    "lfm2": LFM2,
    "lfm2_moe": LFM2,
    "nemotron_h": NEMOTRON_H,
    "falcon_h1": FALCON_H1,
    "granitemoehybrid": GRANITE,
    "bamba": GRANITE,
    "jamba": JAMBA,
    "zamba2": ZAMBA2,
    "olmo_hybrid": OLMO_HYBRID,
    "deepseek_v2": MLA,
    "deepseek_v3": MLA,
    "kimi_k2": MLA,
}
# Multimodal wrappers (LFM2-VL, MiniCPM-V 4.6/4.7, Nemotron VL and Omni, Qwen3.5, Kimi-K2.5) are laid
# out by their text config's model_type (model_type_of).

# Architectures whose configs carry no model type of their own the audit could key on.
BY_ARCHITECTURE: dict[str, Family] = {
    "BailingMoeV2_5ForCausalLM": BAILING_LINEAR,
}
SUPPORTED_MODEL_TYPES = (tuple(BY_MODEL_TYPE) + ATTENTION_MODEL_TYPES
                         + tuple(f"<architecture {name}>" for name in BY_ARCHITECTURE)
                         + ("<any attention-only config>",))


def registered_family(model: ModelConfig) -> Family | None:
    """The family registered for a config's (text) model type, else for its architecture."""
    if model.model_type in BY_MODEL_TYPE:
        return BY_MODEL_TYPE[model.model_type]
    return next((BY_ARCHITECTURE[name] for name in model.architectures if name in BY_ARCHITECTURE), None)


def family_of(model: ModelConfig, vllm_version: str | None = None) -> Family:
    """The family that lays a config out as vLLM ``vllm_version`` would (None: any release), or a
    LayoutError naming why the audit does not."""
    own_type = model.config.get("model_type")
    reason = refusal([own_type, model.model_type], list(model.architectures), vllm_version)
    if reason is not None:
        raise LayoutError(f"model_type {own_type or model.model_type!r} is not supported: {reason}; "
                          f"describe its values in a layout file instead")
    family = registered_family(model)
    if family is not None:
        return family
    if model.model_type not in ATTENTION_MODEL_TYPES and not is_plain_attention(model.text):
        raise LayoutError(f"model_type {model.model_type!r} is not supported "
                          f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)}); "
                          f"describe its values in a layout file instead")
    return ATTENTION_ONLY


__all__ = ["ATTENTION_MODEL_TYPES", "BY_ARCHITECTURE", "BY_MODEL_TYPE", "SUPPORTED_MODEL_TYPES", "Family", "Options",
           "family_of", "is_plain_attention", "registered_family"]
