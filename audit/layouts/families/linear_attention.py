"""Lightning-style linear attention with MLA layers between: ``bailing_moe_linear.py`` (Bailing MoE
V2.5), whose config names no model type of its own: it is known by its architecture."""

from __future__ import annotations

from ..hf_config import config_int
from ..hybrid import ATTENTION, STATE
from ..model import Layout
from ..pages import AttentionShape
from ..states import linear_attention_states
from .base import Family, Options, build_layouts


def _bailing_linear(config: dict, options: Options) -> list[Layout]:
    """Linear attention layers, except every ``layer_group_size``-th, which is MLA; one
    ``(heads, d, d)`` state a linear layer."""
    group = config.get("layer_group_size", 1)
    kinds = [STATE if group > 0 and (layer + 1) % group else ATTENTION
             for layer in range(config_int(config, "num_hidden_layers"))]
    heads = config_int(config, "num_attention_heads")
    head_dim = config_int(config, "head_dim") if "head_dim" in config else config_int(config, "hidden_size") // heads
    states = linear_attention_states(num_heads=heads, head_dim=head_dim, tp_size=options.tp_size,
                                     dtype=options.conv_dtype)
    latent = AttentionShape(1, config.get("kv_lora_rank", 512) + config.get("qk_rope_head_dim", 64),
                            options.kv_dtype, vectors=1)
    return build_layouts(config, options, "linear_attention", states, kinds, latent)


BAILING_LINEAR = Family("bailing_linear", _bailing_linear, no_token_rows=(
    "layer 0 is linear attention, whose one state is a decayed sum over every token of the prefix "
    "(heads, d, d): no row of it is one token's image"))
