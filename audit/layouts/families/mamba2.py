"""Mamba2 layers, and the hybrids built on them: ``mamba2.py``, ``nemotron_h.py``, ``falcon_h1.py``,
``granitemoehybrid.py`` (and Bamba), ``zamba2.py``. They share the state shapes and differ in the
names of their config fields and in how their layers are laid out."""

from __future__ import annotations

import numpy as np

from ..hf_config import config_int, layer_kinds
from ..hybrid import ATTENTION, STATE
from ..images import TokenImages
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


def _falcon_h1_intermediate(config: dict) -> int:
    return (config_int(config, "mamba_d_ssm") if config.get("mamba_d_ssm") is not None
            else int(config_int(config, "mamba_expand") * config_int(config, "hidden_size")))


def _falcon_h1(config: dict, options: Options) -> list[Layout]:
    """Falcon-H1: every layer runs attention and a Mamba2 mixer side by side (two caches per
    layer; vLLM builds ``self_attn`` before ``mamba``, so attention is group 0)."""
    intermediate = _falcon_h1_intermediate(config)
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


def conv_columns(intermediate: int, n_groups: int, state_size: int, tp_size: int, tp_rank: int) -> np.ndarray:
    """The columns of the unsharded ``xBC`` (x, then B, then C) one TP rank's conv state holds, in its
    order: vLLM's ``mamba_v2_sharded_weight_loader`` gives each rank its share of x and of the
    groups, and every rank the whole group when there is one."""
    groups = n_groups * state_size
    if intermediate % tp_size or (n_groups % tp_size and n_groups != 1):
        raise LayoutError(f"mamba2: {intermediate} channels and {n_groups} groups do not shard over TP {tp_size}")
    share = intermediate // tp_size
    x = np.arange(tp_rank * share, (tp_rank + 1) * share)
    if n_groups % tp_size == 0:
        own = np.arange(tp_rank * groups // tp_size, (tp_rank + 1) * groups // tp_size)
    else:  # one group, replicated onto every rank
        own = np.arange(groups)
    return np.concatenate([x, intermediate + own, intermediate + groups + own])


def _mamba2_rule(config: dict, checkpoint, model: str, tp_size: int, tp_rank: int, *, intermediate: int,
                 groups: str, state: str, heads: str, embeddings: tuple[str, ...], norm: str, in_proj: str,
                 eps: str, embedding_scale: float = 1.0, xbc_scale: np.ndarray | None = None) -> TokenImages:
    """Layer 0 of a model built on vLLM's MambaMixer2: its pre-norm, then ``in_proj``, whose outputs
    are ``[2 * d_mlp, z (d_inner), xBC (conv_dim), dt (heads)]``; the conv state holds ``xBC``. The
    families differ in the names of their fields and tensors, Granite scales its embeddings, and
    Falcon-H1 each ``xBC`` column (`xbc_scale`, over the unsharded columns: its rows scaled)."""
    n_groups, state_size = config_int(config, groups), config_int(config, state)
    embeddings = checkpoint.first(*embeddings)
    weight = checkpoint.tensor(in_proj)
    conv_dim = intermediate + 2 * n_groups * state_size
    d_mlp = (weight.shape[0] - intermediate - conv_dim - config_int(config, heads)) // 2
    if d_mlp < 0:
        raise LayoutError(f"{in_proj} has {weight.shape[0]} rows: fewer than z, xBC and dt need")
    xbc_rows = slice(2 * d_mlp + intermediate, 2 * d_mlp + intermediate + conv_dim)
    xbc = weight[xbc_rows]
    columns = conv_columns(intermediate, n_groups, state_size, tp_size, tp_rank)
    source = {"embeddings": embeddings, "norm": norm, "projection": in_proj + " (xBC)"}
    bias_name, bias = in_proj.replace(".weight", ".bias"), None
    if bias_name in checkpoint:  # (``use_bias``: MambaMixer2's in_proj adds it before the conv sees xBC)
        if tp_size > 1 and n_groups % tp_size:
            raise LayoutError(f"{bias_name}: with one group replicated over TP {tp_size}, vLLM 0.32 cannot load "
                              f"this checkpoint (the bias is sharded as a plain column of the replicated groups' "
                              f"width, past the tensor's end on the last rank): it publishes no such key (not bound)")
        bias = checkpoint.tensor(bias_name)[xbc_rows]
        source["bias"] = bias_name + " (xBC)"
    if xbc_scale is not None:  # (the projection's output scaled: its bias with it)
        xbc = xbc * xbc_scale[:, None]
        bias = None if bias is None else bias * xbc_scale
    return TokenImages(model, tp_size, tp_rank, checkpoint.matrix(embeddings), checkpoint.tensor(norm),
                       float(config.get(eps, 1e-5)), np.ascontiguousarray(xbc[columns]), embedding_scale,
                       bias=None if bias is None else np.ascontiguousarray(bias[columns], dtype=np.float32),
                       source=source, checkpoint=checkpoint.identity)


def _mamba2_images(config: dict, checkpoint, model: str, tp_size: int, tp_rank: int) -> TokenImages:
    """HF Mamba2 (``Mamba2ForCausalLM``)."""
    return _mamba2_rule(config, checkpoint, model, tp_size, tp_rank, intermediate=_expanded(config, "expand"),
                        groups="n_groups", state="state_size", heads="num_heads",
                        embeddings=("backbone.embeddings.weight", "backbone.embedding.weight"),
                        norm="backbone.layers.0.norm.weight", in_proj="backbone.layers.0.mixer.in_proj.weight",
                        eps="layer_norm_epsilon")


def _nemotron_h_images(config: dict, checkpoint, model: str, tp_size: int, tp_rank: int) -> TokenImages:
    """Nemotron-H, where layer 0 is a Mamba2 mixer."""
    return _mamba2_rule(config, checkpoint, model, tp_size, tp_rank,
                        intermediate=config_int(config, "mamba_num_heads") * config_int(config, "mamba_head_dim"),
                        groups="n_groups", state="ssm_state_size", heads="mamba_num_heads",
                        embeddings=("backbone.embeddings.weight",), norm="backbone.layers.0.norm.weight",
                        in_proj="backbone.layers.0.mixer.in_proj.weight", eps="layer_norm_epsilon")


def _granite_images(config: dict, checkpoint, model: str, tp_size: int, tp_rank: int) -> TokenImages:
    """GraniteMoeHybrid and Bamba, where layer 0 is Mamba2: vLLM scales the embeddings by the
    config's ``embedding_multiplier`` (12 in the released Granite 4.0 models) before layer 0."""
    return _mamba2_rule(config, checkpoint, model, tp_size, tp_rank, intermediate=_expanded(config, "mamba_expand"),
                        groups="mamba_n_groups", state="mamba_d_state", heads="mamba_n_heads",
                        embeddings=("model.embed_tokens.weight",), norm="model.layers.0.input_layernorm.weight",
                        in_proj="model.layers.0.mamba.in_proj.weight", eps="rms_norm_eps",
                        embedding_scale=float(config.get("embedding_multiplier", 1.0)))


def _zamba2_images(config: dict, checkpoint, model: str, tp_size: int, tp_rank: int) -> TokenImages:
    """Zamba2: every layer's Mamba2 mixer after its ``input_layernorm``."""
    return _mamba2_rule(config, checkpoint, model, tp_size, tp_rank, intermediate=_expanded(config, "mamba_expand"),
                        groups="mamba_ngroups", state="mamba_d_state", heads="n_mamba_heads",
                        embeddings=("model.embed_tokens.weight",), norm="model.layers.0.input_layernorm.weight",
                        in_proj="model.layers.0.mamba.in_proj.weight", eps="rms_norm_eps")


def _falcon_h1_images(config: dict, checkpoint, model: str, tp_size: int, tp_rank: int) -> TokenImages:
    """Falcon-H1's Mamba2 mixer of layer 0 (vLLM ``falcon_h1.py``): the embeddings times
    ``embedding_multiplier``, ``input_layernorm``, times ``ssm_in_multiplier``, ``in_proj``, then its
    muP vector: x, B and C times ``ssm_multipliers[1]``, ``[2]`` and ``[3]`` (``[0]`` is z's, ``[4]``
    dt's). Both multipliers follow the norm, so they scale ``xBC``'s columns."""
    intermediate = _falcon_h1_intermediate(config)
    groups = config_int(config, "mamba_n_groups") * config_int(config, "mamba_d_state")
    _, x, b, c, _ = (float(m) for m in config.get("ssm_multipliers") or [1.0] * 5)
    xbc_scale = float(config.get("ssm_in_multiplier", 1.0)) * np.repeat(
        np.array([x, b, c], dtype=np.float32), [intermediate, groups, groups])
    return _mamba2_rule(config, checkpoint, model, tp_size, tp_rank, intermediate=intermediate,
                        groups="mamba_n_groups", state="mamba_d_state", heads="mamba_n_heads",
                        embeddings=("model.embed_tokens.weight",), norm="model.layers.0.input_layernorm.weight",
                        in_proj="model.layers.0.mamba.in_proj.weight", eps="rms_norm_eps",
                        embedding_scale=float(config.get("embedding_multiplier", 1.0)), xbc_scale=xbc_scale)


MAMBA2 = Family("mamba2", _mamba2, token_images=_mamba2_images)
NEMOTRON_H = Family("nemotron_h", _nemotron_h, token_images=_nemotron_h_images)
FALCON_H1 = Family("falcon_h1", _falcon_h1, token_images=_falcon_h1_images)
GRANITE = Family("granite_mamba2", _granite, token_images=_granite_images)
ZAMBA2 = Family("zamba2", _zamba2, token_images=_zamba2_images)
