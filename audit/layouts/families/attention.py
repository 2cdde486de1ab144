"""Attention in every layer (full, sliding or chunked): one segment per layer, one page per block.

The generic K/V layout of any config with attention fields only; a config with recurrent-state or
latent fields that no family knows is refused rather than guessed (`is_plain_attention`). Layer 0's
V of a Llama-like model is the image of its token (`_v_images`: issue #40's binding).
"""

from __future__ import annotations

import numpy as np

from ..hf_config import config_int, first_int, head_dim, layer_kinds
from ..hybrid import ATTENTION, SLIDING
from ..images import TokenImages
from ..model import Layout, LayoutError
from .base import Family, Options, build_layouts

ATTENTION_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "mistral", "mixtral",
                         "gemma", "gemma2", "gemma3", "gemma3_text", "phi3", "granite", "olmo2")

# Fields that say a config has recurrent state or a cache the generic attention layout does not
# describe (MLA latents): such a config of an unknown model type is refused, never guessed.
_NOT_PLAIN_ATTENTION = ("mamba", "ssm", "conv_l_cache", "linear_", "state_size", "kv_lora_rank",
                        "layers_block_type", "hybrid_override_pattern")


def is_plain_attention(config: dict) -> bool:
    """Whether a (text) config of no known model type has plain attention layers only."""
    if any(marker in name.lower() for name in config for marker in _NOT_PLAIN_ATTENTION):
        return False
    if any(str(kind) not in ("full_attention", "sliding_attention", "attention")
           for kind in config.get("layer_types") or ()):
        return False
    return all(isinstance(config.get(name), int) for name in ("num_hidden_layers", "num_attention_heads")) and (
        isinstance(config.get("head_dim"), int) or isinstance(config.get("hidden_size"), int))


def _attention_kinds(config: dict, model_type: str) -> list[str | None]:
    layers = config_int(config, "num_hidden_layers")
    if config.get("layer_types"):
        kinds = layer_kinds(config["layer_types"], "layer_types",
                            {"full_attention", "sliding_attention", "chunked_attention", "attention"})
        if len(kinds) != layers:
            raise LayoutError(f"config.json layer_types has {len(kinds)} entries for {layers} layers")
        return kinds
    window = config.get("sliding_window")
    if model_type == "gemma2" and window:  # even layers slide, odd layers attend fully
        return [SLIDING if layer % 2 == 0 else ATTENTION for layer in range(layers)]
    if model_type in ("gemma3", "gemma3_text") and window:
        pattern = config_int(config, "sliding_window_pattern")
        return [ATTENTION if (layer + 1) % pattern == 0 else SLIDING for layer in range(layers)]
    if window and config.get("use_sliding_window", True) and model_type not in ("qwen2", "qwen3"):
        return [SLIDING] * layers
    return [ATTENTION] * layers


def _attention_only(config: dict, options: Options) -> list[Layout]:
    return build_layouts(config, options, ATTENTION, None, _attention_kinds(config, options.model_type))


# Model types whose layer 0 vLLM computes as Llama does (``llama.py``; ``mixtral.py``, ``qwen2.py``,
# ``qwen3.py``, ``qwen3_moe.py``, ``qwen2_moe.py``: no embedding scale, ``input_layernorm`` a plain
# RMSNorm, V untouched by rotary or q/k norms) under the same tensor names. Gemma (normalizer, 1 + w
# norm), Granite (embedding multiplier), Phi-3 (fused qkv_proj) and OLMo2 (no pre-norm) are not bound.
V_IMAGE_MODEL_TYPES = ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe")


def v_rows(total_kv_heads: int, head_size: int, tp_size: int, tp_rank: int) -> np.ndarray:
    """The rows of the unsharded ``v_proj`` one TP rank's V cache holds, in its order: vLLM's
    ``QKVParallelLinear`` gives each rank ``max(1, total // tp)`` KV heads, the heads of shard
    ``tp_rank // replicas`` where ``replicas = max(1, tp // total)`` ranks share a head
    (``weight_loader``: ``shard_rank = self.tp_rank // self.num_kv_head_replicas``)."""
    if total_kv_heads % tp_size and tp_size % total_kv_heads:
        raise LayoutError(f"attention: {total_kv_heads} KV heads do not shard over TP {tp_size}")
    heads = max(1, total_kv_heads // tp_size)
    shard = tp_rank // max(1, tp_size // total_kv_heads)
    return np.arange(shard * heads * head_size, (shard + 1) * heads * head_size)


def _v_images(config: dict, checkpoint, model: str, tp_size: int, tp_rank: int) -> TokenImages:
    """Layer 0's V (vLLM ``llama.py``): ``input_layernorm`` (RMSNorm) of the token's embedding, then
    ``qkv_proj``'s v rows; rotary embedding touches q and k only, so each token's V, over the rank's
    KV heads, is a linear image of the token. K is not bound (rotary at the token's position)."""
    model_type = config.get("model_type")
    if model_type not in V_IMAGE_MODEL_TYPES:
        raise LayoutError(f"model_type {model_type!r}: no layer-0 V image rule yet (not bound)")
    v_proj = "model.layers.0.self_attn.v_proj.weight"
    if v_proj.replace(".weight", ".bias") in checkpoint:
        raise LayoutError(f"{v_proj}: a biased v_proj has no image rule yet (not bound)")
    size = head_dim(config)
    weight = checkpoint.tensor(v_proj)
    total = first_int(config, "num_key_value_heads", "num_attention_heads")
    if weight.shape[0] != total * size:
        raise LayoutError(f"{v_proj} has {weight.shape[0]} rows, not {total} KV heads of {size}")
    embeddings, norm = "model.embed_tokens.weight", "model.layers.0.input_layernorm.weight"
    return TokenImages(model, tp_size, tp_rank, checkpoint.matrix(embeddings), checkpoint.tensor(norm),
                       float(config.get("rms_norm_eps", 1e-6)),
                       np.ascontiguousarray(weight[v_rows(total, size, tp_size, tp_rank)]),
                       source={"embeddings": embeddings, "norm": norm, "projection": v_proj}, region="v",
                       checkpoint=checkpoint.identity)


ATTENTION_ONLY = Family("attention", _attention_only, token_images=_v_images)
