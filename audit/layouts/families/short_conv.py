"""Short-convolution layers (conv state only) and full attention: ``lfm2.py``, ``lfm2_moe.py``
(and LFM2-VL's text model)."""

from __future__ import annotations

from ..hf_config import config_int, layer_kinds
from ..hybrid import ATTENTION, STATE
from ..model import Layout
from ..states import short_conv_states
from .base import Family, Options, build_layouts


def _lfm2(config: dict, options: Options) -> list[Layout]:
    if config.get("layer_types"):
        kinds = layer_kinds(config["layer_types"], "layer_types", {"conv", "full_attention"})
    else:
        attention_layers = set(config.get("full_attn_idxs") or ())
        kinds = [ATTENTION if layer in attention_layers else STATE
                 for layer in range(config_int(config, "num_hidden_layers"))]
    # vLLM's ShortConv layer reads hf_config.conv_dim (LFM2-VL's page alignment reads hidden_size:
    # the two agree wherever vLLM starts); checkpoints that omit conv_dim convolve over hidden_size.
    conv_dim = config_int(config, "conv_dim" if "conv_dim" in config else "hidden_size")
    states = short_conv_states(
        conv_dim=conv_dim, conv_kernel=config_int(config, "conv_L_cache"), tp_size=options.tp_size,
        conv_dtype=options.conv_dtype, conv_layout=options.conv_layout)
    return build_layouts(config, options, "short_conv", states, kinds)


LFM2 = Family("lfm2", _lfm2)
