"""Gated DeltaNet layers with full attention between them: ``qwen3_next.py`` and ``qwen3_5.py``
(Qwen3-Next, Qwen3.5 and the wrappers around a Qwen3.5 text model), ``olmo_hybrid.py``."""

from __future__ import annotations

from ..hf_config import config_int, layer_kinds
from ..hybrid import ATTENTION, STATE
from ..model import LayoutError, Layout
from ..pages import AttentionShape
from ..states import gdn_states
from .base import Family, Options, build_layouts

_LAYER_TYPES = {"linear_attention", "full_attention"}


def _states(config: dict, options: Options):
    """The GDN states of the Qwen3-Next family's ``linear_*`` config keys (OLMo Hybrid uses them too)."""
    return gdn_states(
        num_k_heads=config_int(config, "linear_num_key_heads"),
        num_v_heads=config_int(config, "linear_num_value_heads"),
        head_k_dim=config_int(config, "linear_key_head_dim"),
        head_v_dim=config_int(config, "linear_value_head_dim"),
        conv_kernel=config_int(config, "linear_conv_kernel_dim"), tp_size=options.tp_size,
        conv_dtype=options.conv_dtype, ssm_dtype=options.ssm_dtype,
        conv_layout=options.conv_layout)


def _qwen(config: dict, options: Options) -> list[Layout]:
    """Qwen3-Next / Qwen3.5: Gated DeltaNet layers, full attention every few layers."""
    if config.get("layer_types"):
        kinds = layer_kinds(config["layer_types"], "layer_types", _LAYER_TYPES)
    else:  # transformers' default: layer i is full attention when (i+1) % interval == 0
        interval = config_int(config, "full_attention_interval")
        kinds = [ATTENTION if (layer + 1) % interval == 0 else STATE
                 for layer in range(config_int(config, "num_hidden_layers"))]
    return build_layouts(config, options, "gdn", _states(config, options), kinds)


def _olmo_hybrid(config: dict, options: Options) -> list[Layout]:
    """OLMo Hybrid (``olmo_hybrid.py``): GDN layers and full attention by ``layer_types``; its
    attention heads are ``hidden_size // num_attention_heads`` wide whatever ``head_dim`` says."""
    if not config.get("layer_types"):
        raise LayoutError("olmo_hybrid config.json has no 'layer_types'")
    kinds = layer_kinds(config["layer_types"], "layer_types", _LAYER_TYPES)
    states = _states(config, options)
    heads = config_int(config, "num_attention_heads")
    kv_heads = config.get("num_key_value_heads") or heads
    attention = AttentionShape(max(1, kv_heads // options.tp_size), config_int(config, "hidden_size") // heads,
                               options.kv_dtype)
    return build_layouts(config, options, "gdn", states, kinds, attention)


QWEN_GDN = Family("qwen_gdn", _qwen)
OLMO_HYBRID = Family("olmo_hybrid", _olmo_hybrid)
