"""Short-convolution layers (conv state only) and full attention: ``lfm2.py``, ``lfm2_moe.py``
(and LFM2-VL's text model)."""

from __future__ import annotations

import numpy as np

from ..hf_config import config_int, layer_kinds
from ..hybrid import ATTENTION, STATE
from ..images import TokenImages
from ..model import Layout, LayoutError
from ..states import short_conv_states
from .base import Family, Options, build_layouts


def _lfm2(config: dict, options: Options) -> list[Layout]:
    if config.get("layer_types"):
        kinds = layer_kinds(config["layer_types"], "layer_types", {"conv", "full_attention"})
    else:
        attention_layers = set(config.get("full_attn_idxs") or ())
        kinds = [ATTENTION if layer in attention_layers else STATE
                 for layer in range(config_int(config, "num_hidden_layers"))]
    states = short_conv_states(
        conv_dim=_conv_dim(config), conv_kernel=config_int(config, "conv_L_cache"), tp_size=options.tp_size,
        conv_dtype=options.conv_dtype, conv_layout=options.conv_layout)
    return build_layouts(config, options, "short_conv", states, kinds)


def _conv_dim(config: dict) -> int:
    # vLLM's ShortConv layer reads hf_config.conv_dim (LFM2-VL's page alignment reads hidden_size:
    # the two agree wherever vLLM starts); checkpoints that omit conv_dim convolve over hidden_size.
    return config_int(config, "conv_dim" if "conv_dim" in config else "hidden_size")


def _lfm2_images(config: dict, checkpoint, model: str, tp_size: int, tp_rank: int) -> TokenImages:
    """Layer 0's ShortConv (vLLM ``lfm2.py``, ``short_conv.py``): ``operator_norm`` (an RMSNorm), then
    ``in_proj``, whose outputs are ``B, C, x`` (``conv_dim`` each); the conv state holds ``B * x``.
    ``in_proj`` is a MergedColumnParallelLinear: a TP rank holds the same share of B, C and x, so
    its conv columns are its share of ``conv_dim``, and its image is its B rows' times its x rows'."""
    dim = _conv_dim(config)
    in_proj = "model.layers.0.conv.in_proj.weight"  # HF's name (vLLM renames .conv. to .short_conv.)
    weight = checkpoint.tensor(in_proj)
    if weight.shape[0] != 3 * dim or dim % tp_size:
        raise LayoutError(f"{in_proj} has {weight.shape[0]} rows, not B, C, x of {dim} sharded over TP {tp_size}")
    share = dim // tp_size
    columns = np.arange(tp_rank * share, (tp_rank + 1) * share)
    embeddings, norm = "model.embed_tokens.weight", "model.layers.0.operator_norm.weight"
    source = {"embeddings": embeddings, "norm": norm, "projection": in_proj + " (B * x)"}
    bias_name, bias = in_proj.replace(".weight", ".bias"), None
    if bias_name in checkpoint:  # (``conv_bias``: B and x each biased before their product)
        bias = np.asarray(checkpoint.tensor(bias_name), dtype=np.float32)
        source["bias"] = bias_name + " (B, x)"
    return TokenImages(model, tp_size, tp_rank, checkpoint.matrix(embeddings), checkpoint.tensor(norm),
                       float(config.get("norm_eps", 1e-5)), np.ascontiguousarray(weight[2 * dim + columns]),
                       gate=np.ascontiguousarray(weight[columns]),
                       bias=None if bias is None else np.ascontiguousarray(bias[2 * dim + columns]),
                       gate_bias=None if bias is None else np.ascontiguousarray(bias[columns]),
                       source=source, checkpoint=checkpoint.identity)


LFM2 = Family("lfm2", _lfm2, token_images=_lfm2_images)
