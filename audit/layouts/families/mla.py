"""Multi-head latent attention in every layer: ``deepseek_v2.py`` (DeepSeek-V2/V3, Kimi-K2).

One region per layer. Multi-token-prediction layers (speculative decoding) are not modelled. Layer
0's latent, before its rotary part, is the image of its token (`_latent_images`: issue #40's binding).
"""

from __future__ import annotations

import numpy as np

from ..hf_config import config_int
from ..hybrid import ATTENTION
from ..images import TokenImages
from ..model import Layout
from ..pages import AttentionShape
from .base import Family, Options, build_layouts

# An MLA model's block when --block-size is not given: the preferred block of its attention backend,
# 16 for CPU_MLA and for FlashAttention MLA (vLLM's first choice on Hopper); Blackwell's FlashInfer
# MLA takes 32 (a scan fits the block to the listed sizes either way).
MLA_DEFAULT_BLOCK = 16


def _latent_shape(config: dict, options: Options) -> AttentionShape:
    """vLLM's ``MLAAttentionSpec``: one latent of ``kv_lora_rank + qk_rope_head_dim`` a token,
    one head on every TP rank (the same bytes on each: the connector writes ``tp_rank:0``)."""
    return AttentionShape(1, config_int(config, "kv_lora_rank") + config_int(config, "qk_rope_head_dim"),
                          options.kv_dtype, vectors=1)


def _mla(config: dict, options: Options) -> list[Layout]:
    kinds = [ATTENTION] * config_int(config, "num_hidden_layers")
    return build_layouts(config, options, ATTENTION, None, kinds, _latent_shape(config, options))


def _latent_images(config: dict, checkpoint, model: str, tp_size: int, tp_rank: int) -> TokenImages:
    """Layer 0's latent (vLLM ``deepseek_v2.py``, ``DeepseekV2MLAAttention``): ``input_layernorm``
    (RMSNorm) of the token's embedding, ``kv_a_proj_with_mqa`` (replicated: every rank the same),
    split into ``kv_c`` (its first ``kv_lora_rank`` rows) and ``k_pe``; the cache holds
    ``kv_a_layernorm(kv_c)`` then ``k_pe`` after rotary. The first is the token's image; ``k_pe``
    carries its position and is not bound. With ``q_lora_rank`` vLLM fuses ``q_a_proj`` and this
    projection into ``fused_qkv_a_proj``, loading each from its own checkpoint tensor."""
    rank = config_int(config, "kv_lora_rank")
    prefix = "model.layers.0."
    projection, latent_norm = prefix + "self_attn.kv_a_proj_with_mqa.weight", prefix + "self_attn.kv_a_layernorm.weight"
    eps = float(config.get("rms_norm_eps", 1e-6))
    return TokenImages(model, tp_size, tp_rank, checkpoint.matrix("model.embed_tokens.weight"),
                       checkpoint.tensor(prefix + "input_layernorm.weight"), eps,
                       np.ascontiguousarray(checkpoint.tensor(projection)[:rank]),
                       post_norm=checkpoint.tensor(latent_norm), post_eps=eps, region="latent",
                       source={"embeddings": "model.embed_tokens.weight", "norm": prefix + "input_layernorm.weight",
                               "projection": projection + f" (kv_c: first {rank} rows)", "latent_norm": latent_norm},
                       checkpoint=checkpoint.identity)


MLA = Family("mla", _mla, default_block=MLA_DEFAULT_BLOCK, token_images=_latent_images)
