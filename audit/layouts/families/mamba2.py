"""Mamba2 layers, and the hybrids built on them: ``mamba2.py``, ``nemotron_h.py``, ``falcon_h1.py``,
``granitemoehybrid.py`` (and Bamba), ``zamba2.py``. They share the state shapes and differ in the
names of their config fields and in how their layers are laid out."""

from __future__ import annotations

from ..hf_config import config_int, layer_kinds
from ..hybrid import ATTENTION, STATE
from ..model import LayoutError, Layout
from ..pages import AttentionShape
from ..states import mamba2_states
from .base import Family, Options, build_layouts


def _states(config: dict, options: Options, *, intermediate: int, groups: str, heads: str,
            head_dim: str, state: str, conv: str):
    """The Mamba2 states, read from this family's names of the fields."""
    return mamba2_states(
        intermediate_size=intermediate, n_groups=config_int(config, groups), num_heads=config_int(config, heads),
        head_dim=config_int(config, head_dim), state_size=config_int(config, state),
        conv_kernel=config_int(config, conv), tp_size=options.tp_size, conv_dtype=options.conv_dtype,
        ssm_dtype=options.ssm_dtype, conv_layout=options.conv_layout)


def _expanded(config: dict, expand: str) -> int:
    return config_int(config, expand) * config_int(config, "hidden_size")


def _mamba2(config: dict, options: Options) -> list[Layout]:
    states = _states(config, options, intermediate=_expanded(config, "expand"), groups="n_groups",
                     heads="num_heads", head_dim="head_dim", state="state_size", conv="conv_kernel")
    return build_layouts(config, options, "mamba2", states, [STATE] * config_int(config, "num_hidden_layers"))


def _nemotron_h(config: dict, options: Options) -> list[Layout]:
    """Nemotron-H: Mamba2 mixers, some attention layers, MLP/MoE layers with no cache."""
    field = next((name for name in ("layers_block_type", "hybrid_override_pattern", "layer_types")
                  if config.get(name)), None)
    if field is None:
        raise LayoutError("config.json has neither 'hybrid_override_pattern' nor 'layers_block_type'")
    kinds = layer_kinds(config[field], field, {"M", "*", "-", "E", "mamba", "attention", "mlp", "moe",
                                               "linear_attention", "full_attention"})
    heads, head_dim = config_int(config, "mamba_num_heads"), config_int(config, "mamba_head_dim")
    states = _states(config, options, intermediate=heads * head_dim, groups="n_groups",
                     heads="mamba_num_heads", head_dim="mamba_head_dim", state="ssm_state_size",
                     conv="conv_kernel")
    return build_layouts(config, options, "mamba2", states, kinds)


def _falcon_h1(config: dict, options: Options) -> list[Layout]:
    """Falcon-H1: every layer runs attention and a Mamba2 mixer side by side (two caches per
    layer; vLLM builds ``self_attn`` before ``mamba``, so attention is group 0)."""
    intermediate = (config_int(config, "mamba_d_ssm") if config.get("mamba_d_ssm") is not None
                    else int(config_int(config, "mamba_expand") * config_int(config, "hidden_size")))
    states = _states(config, options, intermediate=intermediate, groups="mamba_n_groups",
                     heads="mamba_n_heads", head_dim="mamba_d_head", state="mamba_d_state",
                     conv="mamba_d_conv")
    kinds = [(layer, kind) for layer in range(config_int(config, "num_hidden_layers"))
             for kind in (ATTENTION, STATE)]
    return build_layouts(config, options, "mamba2", states, kinds)


def _granite_kinds(config: dict) -> list[str | None]:
    if config.get("layer_types"):
        return layer_kinds(config["layer_types"], "layer_types", {"mamba", "attention"})
    if config.get("layers_block_type"):
        return layer_kinds(config["layers_block_type"], "layers_block_type", {"mamba", "attention"})
    attention = set(config.get("attn_layer_indices") or ())
    return [ATTENTION if layer in attention else STATE
            for layer in range(config_int(config, "num_hidden_layers"))]


def _granite(config: dict, options: Options) -> list[Layout]:
    """GraniteMoeHybrid and Bamba: Mamba2 layers (``mamba_*`` fields) and attention layers."""
    states = _states(config, options, intermediate=_expanded(config, "mamba_expand"), groups="mamba_n_groups",
                     heads="mamba_n_heads", head_dim="mamba_d_head", state="mamba_d_state", conv="mamba_d_conv")
    return build_layouts(config, options, "mamba2", states, _granite_kinds(config))


# Zamba2's layers_block_type: transformers 5 saves a Mamba layer as "linear_attention" (its remap of
# the older "mamba"); vLLM's zamba2.py builds a Mamba2 layer for every entry but "hybrid".
_ZAMBA2_BLOCK_TYPES = {"mamba", "linear_attention", "hybrid"}


def _zamba2(config: dict, options: Options) -> list[Layout]:
    """Zamba2 (vLLM ``zamba2.py``): every layer has a Mamba2 mixer (``mamba_*``/``n_mamba_heads``
    fields); a ``hybrid`` layer also runs a shared attention block, with a KV cache of its own per
    hybrid layer. vLLM constructs the shared blocks, and so registers every attention layer, before
    the Mamba layers: attention is group 0. Block ``b`` of ``num_mem_blocks`` serves hybrid layers
    ``b, b + num_mem_blocks, ...``, registered block by block. The attention is multi-head over
    ``num_attention_heads`` (``num_key_value_heads`` is not used) with heads of
    ``2 * hidden_size // num_attention_heads`` (transformers' ``attention_head_dim``, recomputed
    when the config is loaded)."""
    block_types = [str(kind) for kind in config.get("layers_block_type") or ()]
    if not block_types:
        raise LayoutError("zamba2 config.json has no 'layers_block_type'")
    unknown = sorted(set(block_types) - _ZAMBA2_BLOCK_TYPES)
    if unknown:
        raise LayoutError(f"config.json layers_block_type has unknown entries {unknown} "
                          f"(known: {sorted(_ZAMBA2_BLOCK_TYPES)})")
    states = _states(config, options, intermediate=_expanded(config, "mamba_expand"), groups="mamba_ngroups",
                     heads="n_mamba_heads", head_dim="mamba_headdim", state="mamba_d_state", conv="mamba_d_conv")
    hybrid = [layer for layer, kind in enumerate(block_types) if kind == "hybrid"]
    attention = None
    if hybrid:
        heads = config_int(config, "num_attention_heads")
        if heads % options.tp_size:
            raise LayoutError(f"zamba2: num_attention_heads {heads} is not divisible by tp_size {options.tp_size}")
        attention = AttentionShape(heads // options.tp_size, 2 * config_int(config, "hidden_size") // heads,
                                   options.kv_dtype)
        blocks = config.get("num_mem_blocks") or 1  # block b's attention layers register together
        hybrid = [hybrid[i] for i in sorted(range(len(hybrid)), key=lambda i: (i % blocks, i))]
    kinds = [(layer, ATTENTION) for layer in hybrid] + [(layer, STATE) for layer in range(len(block_types))]
    return build_layouts(config, options, "mamba2", states, kinds, attention)


MAMBA2 = Family("mamba2", _mamba2)
NEMOTRON_H = Family("nemotron_h", _nemotron_h)
FALCON_H1 = Family("falcon_h1", _falcon_h1)
GRANITE = Family("granite_mamba2", _granite)
ZAMBA2 = Family("zamba2", _zamba2)
