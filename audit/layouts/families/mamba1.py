"""Mamba (v1) layers: ``mamba.py`` (Mamba, Falcon-Mamba: every layer state) and ``jamba.py``
(Jamba: Mamba layers and attention layers)."""

from __future__ import annotations

from ..hf_config import config_int, layer_kinds
from ..hybrid import ATTENTION, STATE
from ..model import Layout
from ..states import mamba1_states
from .base import Family, Options, build_layouts


def _mamba(config: dict, options: Options) -> list[Layout]:
    intermediate = (config_int(config, "intermediate_size") if "intermediate_size" in config
                    else config_int(config, "expand") * config_int(config, "hidden_size"))
    states = mamba1_states(
        intermediate_size=intermediate, state_size=config_int(config, "state_size"),
        conv_kernel=config_int(config, "conv_kernel"), tp_size=options.tp_size,
        conv_dtype=options.conv_dtype, ssm_dtype=options.ssm_dtype,
        conv_layout=options.conv_layout)
    return build_layouts(config, options, "mamba1", states, [STATE] * config_int(config, "num_hidden_layers"))


def _jamba(config: dict, options: Options) -> list[Layout]:
    """Jamba: Mamba1 layers, attention where ``layer % attn_layer_period == attn_layer_offset``."""
    if config.get("layers_block_type"):
        kinds = layer_kinds(config["layers_block_type"], "layers_block_type", {"mamba", "attention"})
    else:
        period, offset = config_int(config, "attn_layer_period"), config.get("attn_layer_offset", 0)
        kinds = [ATTENTION if layer % period == offset else STATE
                 for layer in range(config_int(config, "num_hidden_layers"))]
    states = mamba1_states(
        intermediate_size=config_int(config, "mamba_expand") * config_int(config, "hidden_size"),
        state_size=config_int(config, "mamba_d_state"), conv_kernel=config_int(config, "mamba_d_conv"),
        tp_size=options.tp_size, conv_dtype=options.conv_dtype, ssm_dtype=options.ssm_dtype,
        conv_layout=options.conv_layout)
    return build_layouts(config, options, "mamba1", states, kinds)


MAMBA1 = Family("mamba1", _mamba)
JAMBA = Family("jamba", _jamba)
