"""Gated DeltaNet layers with full attention between them: ``qwen3_next.py`` and ``qwen3_5.py``
(Qwen3-Next, Qwen3.5 and the wrappers around a Qwen3.5 text model), ``olmo_hybrid.py``."""

from __future__ import annotations

import numpy as np

from ..hf_config import config_int, layer_kinds
from ..hybrid import ATTENTION, STATE
from ..images import TokenImages
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


def _qwen_kinds(config: dict) -> list[str | None]:
    if config.get("layer_types"):
        return layer_kinds(config["layer_types"], "layer_types", _LAYER_TYPES)
    # transformers' default: layer i is full attention when (i+1) % interval == 0
    interval = config_int(config, "full_attention_interval")
    return [ATTENTION if (layer + 1) % interval == 0 else STATE
            for layer in range(config_int(config, "num_hidden_layers"))]


def _qwen(config: dict, options: Options) -> list[Layout]:
    """Qwen3-Next / Qwen3.5: Gated DeltaNet layers, full attention every few layers."""
    return build_layouts(config, options, "gdn", _states(config, options), _qwen_kinds(config))


def _olmo_kinds(config: dict) -> list[str | None]:
    if not config.get("layer_types"):
        raise LayoutError("olmo_hybrid config.json has no 'layer_types'")
    return layer_kinds(config["layer_types"], "layer_types", _LAYER_TYPES)


def _olmo_hybrid(config: dict, options: Options) -> list[Layout]:
    """OLMo Hybrid (``olmo_hybrid.py``): GDN layers and full attention by ``layer_types``; its
    attention heads are ``hidden_size // num_attention_heads`` wide whatever ``head_dim`` says."""
    kinds = _olmo_kinds(config)
    states = _states(config, options)
    heads = config_int(config, "num_attention_heads")
    kv_heads = config.get("num_key_value_heads") or heads
    attention = AttentionShape(max(1, kv_heads // options.tp_size), config_int(config, "hidden_size") // heads,
                               options.kv_dtype)
    return build_layouts(config, options, "gdn", states, kinds, attention)


def _heads(config: dict, tp_size: int) -> tuple[int, int, int, int]:
    """(key heads, value heads, key head dim, value head dim), the heads split evenly over the ranks
    as vLLM's GDN layers require."""
    k_heads, v_heads = config_int(config, "linear_num_key_heads"), config_int(config, "linear_num_value_heads")
    if k_heads % tp_size or v_heads % tp_size or v_heads % k_heads:
        raise LayoutError(f"gdn: {k_heads} key and {v_heads} value heads do not shard over TP {tp_size}")
    return k_heads, v_heads, config_int(config, "linear_key_head_dim"), config_int(config, "linear_value_head_dim")


def stacked_qkv_columns(config: dict, tp_size: int, tp_rank: int) -> np.ndarray:
    """The rows of a stacked ``[q; k; v]`` projection one TP rank's conv state holds, in its order:
    vLLM's ``MergedColumnParallelLinear`` gives each rank its share of every output (q, k, v, then
    the gate), and the conv input is the rank's first three (OLMo Hybrid's ``in_proj_qkvg``)."""
    k_heads, v_heads, k_dim, v_dim = _heads(config, tp_size)
    key, value = k_heads * k_dim // tp_size, v_heads * v_dim // tp_size
    starts = (tp_rank * key, k_heads * k_dim + tp_rank * key, 2 * k_heads * k_dim + tp_rank * value)
    return np.concatenate([np.arange(start, start + size) for start, size in zip(starts, (key, key, value))])


def interleaved_qkv_columns(config: dict, tp_size: int, tp_rank: int) -> np.ndarray:
    """The rows of Qwen3-Next's ``in_proj_qkvz`` one TP rank's conv state holds, in its order. The
    checkpoint interleaves it by key-head group, ``[q_g, k_g, v_g, z_g]`` per group; vLLM loads it as
    one shard (a rank gets whole groups) and ``fix_query_key_value_ordering`` concatenates the rank's
    q of every group, then its k, then its v."""
    k_heads, v_heads, k_dim, v_dim = _heads(config, tp_size)
    v_group = v_heads // k_heads * v_dim
    width = 2 * k_dim + 2 * v_group
    groups = np.arange(tp_rank * k_heads // tp_size, (tp_rank + 1) * k_heads // tp_size)[:, None] * width
    return np.concatenate([(groups + offset + np.arange(size)).ravel()
                           for offset, size in ((0, k_dim), (k_dim, k_dim), (2 * k_dim, v_group))])


def _layer0_is_gdn(kinds: list, family: str) -> None:
    if kinds[0] != STATE:
        raise LayoutError(f"{family}: layer 0 is attention, its keys hold no layer-0 conv rows (not bound)")


def _qwen_images(config: dict, checkpoint, model: str, tp_size: int, tp_rank: int) -> TokenImages:
    """Qwen3-Next and Qwen3.5: layer 0's ``input_layernorm`` (vLLM's GemmaRMSNorm, which scales by
    1 + weight), then the q, k and v rows of the input projection: Qwen3-Next's interleaved
    ``in_proj_qkvz`` (`interleaved_qkv_columns`), Qwen3.5's flat ``in_proj_qkv``, which vLLM loads
    as the q, k and v shards of ``in_proj_qkvz`` (``gqa_interleaved_layout=False``: each rank its
    share of each, `stacked_qkv_columns`). Qwen3.5's released checkpoints are vision-language
    ones, their text model under ``model.language_model.``."""
    _layer0_is_gdn(_qwen_kinds(config), str(config.get("model_type")))
    if config.get("model_type") == "qwen3_next":
        prefix = "model."
        in_proj, columns = "layers.0.linear_attn.in_proj_qkvz.weight", interleaved_qkv_columns(config, tp_size, tp_rank)
    else:
        prefix = checkpoint.first("model.embed_tokens.weight", "model.language_model.embed_tokens.weight")[
            :-len("embed_tokens.weight")]
        in_proj, columns = "layers.0.linear_attn.in_proj_qkv.weight", stacked_qkv_columns(config, tp_size, tp_rank)
    embeddings, norm, in_proj = prefix + "embed_tokens.weight", prefix + "layers.0.input_layernorm.weight", prefix + in_proj
    return TokenImages(model, tp_size, tp_rank, checkpoint.matrix(embeddings),
                       1 + checkpoint.tensor(norm), float(config.get("rms_norm_eps", 1e-6)),
                       np.ascontiguousarray(checkpoint.tensor(in_proj)[columns]),
                       source={"embeddings": embeddings, "norm": norm + " (1 + weight)",
                               "projection": in_proj + " (q, k, v)"},
                       checkpoint=checkpoint.identity)


def _olmo_hybrid_images(config: dict, checkpoint, model: str, tp_size: int, tp_rank: int) -> TokenImages:
    """OLMo Hybrid: a GDN layer's ``input_layernorm`` (a plain RMSNorm; the attention layers use post-norms
    only), then its ``q_proj``, ``k_proj`` and ``v_proj``, which vLLM stacks into ``in_proj_qkvg``."""
    _layer0_is_gdn(_olmo_kinds(config), "olmo_hybrid")
    prefix = "model.layers.0.linear_attn."
    projections = [f"{prefix}{name}.weight" for name in ("q_proj", "k_proj", "v_proj")]
    stacked = np.concatenate([checkpoint.tensor(name) for name in projections])
    norm = "model.layers.0.input_layernorm.weight"
    return TokenImages(model, tp_size, tp_rank, checkpoint.matrix("model.embed_tokens.weight"), checkpoint.tensor(norm),
                       float(config.get("rms_norm_eps", 1e-6)),
                       np.ascontiguousarray(stacked[stacked_qkv_columns(config, tp_size, tp_rank)]),
                       source={"embeddings": "model.embed_tokens.weight", "norm": norm,
                               "projection": ", ".join(projections)},
                       checkpoint=checkpoint.identity)


QWEN_GDN = Family("qwen_gdn", _qwen, token_images=_qwen_images)
OLMO_HYBRID = Family("olmo_hybrid", _olmo_hybrid, token_images=_olmo_hybrid_images)
