"""Mamba (v1) layers: ``mamba.py`` (Mamba, Falcon-Mamba: every layer state) and ``jamba.py``
(Jamba: Mamba layers and attention layers)."""

from __future__ import annotations

import numpy as np

from ..hf_config import config_int, layer_kinds
from ..hybrid import ATTENTION, STATE
from ..images import TokenImages
from ..model import Layout, LayoutError
from ..states import mamba1_states
from .base import Family, Options, build_layouts


def _mamba(config: dict, options: Options) -> list[Layout]:
    intermediate = _intermediate(config)
    states = mamba1_states(
        intermediate_size=intermediate, state_size=config_int(config, "state_size"),
        conv_kernel=config_int(config, "conv_kernel"), tp_size=options.tp_size,
        conv_dtype=options.conv_dtype, ssm_dtype=options.ssm_dtype,
        conv_layout=options.conv_layout)
    return build_layouts(config, options, "mamba1", states, [STATE] * config_int(config, "num_hidden_layers"))


def _intermediate(config: dict) -> int:
    return (config_int(config, "intermediate_size") if "intermediate_size" in config
            else config_int(config, "expand") * config_int(config, "hidden_size"))


def _jamba_kinds(config: dict) -> list:
    if config.get("layers_block_type"):
        return layer_kinds(config["layers_block_type"], "layers_block_type", {"mamba", "attention"})
    period, offset = config_int(config, "attn_layer_period"), config.get("attn_layer_offset", 0)
    return [ATTENTION if layer % period == offset else STATE for layer in range(config_int(config, "num_hidden_layers"))]


def _jamba(config: dict, options: Options) -> list[Layout]:
    """Jamba: Mamba1 layers, attention where ``layer % attn_layer_period == attn_layer_offset``."""
    kinds = _jamba_kinds(config)
    states = mamba1_states(
        intermediate_size=config_int(config, "mamba_expand") * config_int(config, "hidden_size"),
        state_size=config_int(config, "mamba_d_state"), conv_kernel=config_int(config, "mamba_d_conv"),
        tp_size=options.tp_size, conv_dtype=options.conv_dtype, ssm_dtype=options.ssm_dtype,
        conv_layout=options.conv_layout)
    return build_layouts(config, options, "mamba1", states, kinds)


def _mamba1_rule(config: dict, checkpoint, model: str, tp_size: int, tp_rank: int, *, intermediate: int,
                 embeddings: tuple[str, ...], norm: str, in_proj: str, eps: str) -> TokenImages:
    """Layer 0 of a model built on vLLM's MambaMixer (``mamba_mixer.py``): its pre-norm, then
    ``in_proj``, a ``MergedColumnParallelLinear`` of ``[x, z]`` (``intermediate`` rows each); the conv
    state holds ``x``, of which a TP rank holds its share. A bias (``use_bias``, Jamba's
    ``mamba_proj_bias``) is added after the projection."""
    if intermediate % tp_size:
        raise LayoutError(f"mamba1: {intermediate} channels do not shard over TP {tp_size}")
    share = intermediate // tp_size
    rows = np.arange(tp_rank * share, (tp_rank + 1) * share)
    embeddings = checkpoint.first(*embeddings)
    source = {"embeddings": embeddings, "norm": norm, "projection": in_proj + " (x)"}
    bias_name = in_proj.replace(".weight", ".bias")
    bias = None
    if bias_name in checkpoint:
        bias = np.ascontiguousarray(checkpoint.tensor(bias_name)[rows], dtype=np.float32)
        source["bias"] = bias_name + " (x)"
    return TokenImages(model, tp_size, tp_rank, checkpoint.matrix(embeddings), checkpoint.tensor(norm),
                       float(config.get(eps, 1e-5)), np.ascontiguousarray(checkpoint.tensor(in_proj)[rows]),
                       bias=bias, source=source, checkpoint=checkpoint.identity)


def _mamba1_images(config: dict, checkpoint, model: str, tp_size: int, tp_rank: int) -> TokenImages:
    """HF Mamba and Falcon-Mamba (``mamba.py``: ``MambaDecoderLayer.norm``, eps
    ``layer_norm_epsilon``; Falcon-Mamba's extra norms act on B, C and dt, after the conv)."""
    return _mamba1_rule(config, checkpoint, model, tp_size, tp_rank, intermediate=_intermediate(config),
                        embeddings=("backbone.embeddings.weight", "backbone.embedding.weight"),
                        norm="backbone.layers.0.norm.weight", in_proj="backbone.layers.0.mixer.in_proj.weight",
                        eps="layer_norm_epsilon")


def _jamba_images(config: dict, checkpoint, model: str, tp_size: int, tp_rank: int) -> TokenImages:
    """Jamba, where layer 0 is a Mamba layer (``jamba.py``: ``input_layernorm``, then ``mamba``)."""
    if _jamba_kinds(config)[0] != STATE:
        raise LayoutError("jamba: layer 0 is attention; its V has no image rule for Jamba yet (not bound)")
    return _mamba1_rule(config, checkpoint, model, tp_size, tp_rank,
                        intermediate=config_int(config, "mamba_expand") * config_int(config, "hidden_size"),
                        embeddings=("model.embed_tokens.weight",), norm="model.layers.0.input_layernorm.weight",
                        in_proj="model.layers.0.mamba.in_proj.weight", eps="rms_norm_eps")


MAMBA1 = Family("mamba1", _mamba, token_images=_mamba1_images)
JAMBA = Family("jamba", _jamba, token_images=_jamba_images)
