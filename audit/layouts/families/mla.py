"""Multi-head latent attention in every layer: ``deepseek_v2.py`` (DeepSeek-V2/V3, Kimi-K2).

One region per layer. Multi-token-prediction layers (speculative decoding) are not modelled.
"""

from __future__ import annotations

from ..hf_config import config_int
from ..hybrid import ATTENTION
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


MLA = Family("mla", _mla, default_block=MLA_DEFAULT_BLOCK)
