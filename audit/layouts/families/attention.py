"""Attention in every layer (full, sliding or chunked): one segment per layer, one page per block.

The generic K/V layout of any config with attention fields only; a config with recurrent-state or
latent fields that no family knows is refused rather than guessed (`is_plain_attention`). Layer 0's
V of a Llama-like, Gemma, Granite, Phi-3 or OLMo2 model is the image of its token (`_v_images`: issue #40's
binding).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..hf_config import config_int, first_int, head_dim, layer_kinds
from ..hybrid import ATTENTION, SLIDING
from ..images import KeyImages, TokenImages
from ..model import Layout, LayoutError
from ..rotary import rotations_of
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


@dataclass(frozen=True)
class VImageRule:
    """How vLLM 0.32 computes layer 0's attention input for a model type, up to ``qkv_proj``."""

    norm: str | None = "plain"     # ``input_layernorm``: "plain" RMSNorm, "plus_one" (GemmaRMSNorm: 1 + w), None
    embedding_scale: Callable[[dict], float] = lambda config: 1.0
    fused_qkv: bool = False        # the checkpoint holds ``qkv_proj`` (q, k, v rows stacked), not ``v_proj``


# ``llama.py`` and the model types vLLM computes the same way under the same tensor names
# (``mistral``, ``mixtral``, ``qwen2``, ``qwen2_moe``, ``qwen3``, ``qwen3_moe``: q/k norms touch q and k
# only; Qwen2's ``qkv_bias`` is added to V); ``gemma*.py``: the embeddings times ``normalizer``
# (``hidden_size ** 0.5``), a GemmaRMSNorm; ``granite.py``: times ``embedding_multiplier``; ``phi3.py``
# (a ``LlamaForCausalLM``) loads the fused ``qkv_proj`` whole. OLMo2 has no norm before attention
# (post-norms only; q/k norms touch q and k, its ``k_norm`` over every KV head): vLLM 0.32 runs it on
# its Transformers backend.
_PLAIN = VImageRule()
_GEMMA = VImageRule(norm="plus_one", embedding_scale=lambda config: config_int(config, "hidden_size") ** 0.5)
V_IMAGE_RULES = {
    **dict.fromkeys(("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe"), _PLAIN),
    **dict.fromkeys(("gemma", "gemma2", "gemma3", "gemma3_text"), _GEMMA),
    "granite": VImageRule(embedding_scale=lambda config: float(config.get("embedding_multiplier", 1.0))),
    "phi3": VImageRule(fused_qkv=True),
    "olmo2": VImageRule(norm=None),
}


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
    """Layer 0's V: the token's embedding (scaled), ``input_layernorm``, then ``qkv_proj``'s v rows
    (and bias); rotary embedding and q/k norms touch q and k only, so each token's V, over the rank's
    KV heads, is an image of the token (`V_IMAGE_RULES`); K of the rank's first head too, before its
    rotation (`_k_images`)."""
    model_type = config.get("model_type")
    rule = V_IMAGE_RULES.get(model_type)
    if rule is None:
        raise LayoutError(f"model_type {model_type!r}: no layer-0 V image rule yet (not bound)")
    size = head_dim(config)
    total = first_int(config, "num_key_value_heads", "num_attention_heads")
    projection = "model.layers.0.self_attn." + ("qkv_proj" if rule.fused_qkv else "v_proj")
    weight = checkpoint.tensor(projection + ".weight")
    first = weight.shape[0] - total * size if rule.fused_qkv else 0  # q and k rows come first in qkv_proj
    if first < 0 or (not rule.fused_qkv and weight.shape[0] != total * size):
        raise LayoutError(f"{projection}.weight has {weight.shape[0]} rows, not {total} KV heads of {size}")
    rows = first + v_rows(total, size, tp_size, tp_rank)
    bias = (np.ascontiguousarray(checkpoint.tensor(projection + ".bias")[rows])
            if projection + ".bias" in checkpoint else None)
    embeddings, norm = "model.embed_tokens.weight", "model.layers.0.input_layernorm.weight"
    source = {"embeddings": embeddings, "projection": projection + ".weight" + (" (v rows)" if rule.fused_qkv else "")}
    norm_weight = None if rule.norm is None else checkpoint.tensor(norm)
    if norm_weight is not None:
        norm_weight = 1 + norm_weight if rule.norm == "plus_one" else norm_weight
        source["norm"] = norm + (" (1 + weight)" if rule.norm == "plus_one" else "")
    if bias is not None:
        source["bias"] = projection + ".bias"
    values = TokenImages(model, tp_size, tp_rank, checkpoint.matrix(embeddings), norm_weight,
                         float(config.get("rms_norm_eps", 1e-6)), np.ascontiguousarray(weight[rows]),
                         embedding_scale=rule.embedding_scale(config), bias=bias, source=source,
                         region="v", checkpoint=checkpoint.identity)
    try:
        keys = _k_images(config, checkpoint, rule, weight, rows[:size] - first, values)
    except LayoutError as error:
        return dataclasses.replace(values, keys_not_bound=str(error))
    return dataclasses.replace(values, keys=keys)


def _k_images(config: dict, checkpoint, rule: VImageRule, weight, head_rows, values: TokenImages) -> KeyImages:
    """Layer 0's K of the rank's first KV head before its rotation, and the rotation (``get_rope``
    with the layer's rope parameters; neox pairing, as ``llama.py`` and the other rules' models use):
    the same input as V, ``qkv_proj``'s k rows of that head (``head_rows`` index its V rows in
    ``v_proj`` alike: K and V heads shard alike), its bias, and a ``k_norm`` over the head, or over
    every KV head (OLMo2's: its weight as long as K of every head; vLLM gathers the ranks' K for it)."""
    size = head_dim(config)
    layer_kind = "sliding_attention" if _attention_kinds(config, str(config.get("model_type")))[0] == SLIDING \
        else "full_attention"
    rotations = rotations_of(config, size, layer_kind)
    total = first_int(config, "num_key_value_heads", "num_attention_heads")
    if rule.fused_qkv:
        projection, first = "model.layers.0.self_attn.qkv_proj", weight.shape[0] - 2 * total * size
        tensor = weight
    else:
        projection, first = "model.layers.0.self_attn.k_proj", 0
        tensor = checkpoint.tensor(projection + ".weight")
        if tensor.shape[0] != total * size:
            raise LayoutError(f"{projection}.weight has {tensor.shape[0]} rows, not {total} KV heads of {size}")
    rows = first + np.asarray(head_rows)
    bias = np.ascontiguousarray(checkpoint.tensor(projection + ".bias")[rows]) \
        if projection + ".bias" in checkpoint else None
    norm_name = "model.layers.0.self_attn.k_norm.weight"
    head_norm = checkpoint.tensor(norm_name) if norm_name in checkpoint else None
    norm_heads = None
    if head_norm is not None and head_norm.shape == (total * size,) and total > 1:  # over every KV head
        if bias is not None:
            raise LayoutError(f"{norm_name} spans every KV head of a biased {projection}: K not bound")
        norm_heads, head_norm = np.ascontiguousarray(tensor[first:first + total * size]), head_norm[rows - first]
    if head_norm is not None and head_norm.shape != (size,):
        raise LayoutError(f"{norm_name} has shape {head_norm.shape}, neither one head's {size} nor every "
                          f"KV head's {total * size}: K not bound")
    if head_norm is not None and rule.norm == "plus_one":
        head_norm = 1 + head_norm
    source = {"projection": projection + ".weight (k rows)", "rotary": rotations[0].describe()}
    if len(rotations) > 1:
        source["other_rotations"] = [rotary.describe() for rotary in rotations[1:]]
    if bias is not None:
        source["bias"] = projection + ".bias"
    if head_norm is not None:
        source["k_norm"] = norm_name + (" (1 + weight)" if rule.norm == "plus_one" else "") \
            + (" (over every KV head)" if norm_heads is not None else "")
    return KeyImages(values, np.ascontiguousarray(tensor[rows]), rotations[0], bias=bias, head_norm=head_norm,
                     head_eps=float(config.get("rms_norm_eps", 1e-6)), norm_heads=norm_heads,
                     other_rotations=rotations[1:], source=source)


ATTENTION_ONLY = Family("attention", _attention_only, token_images=_v_images)
