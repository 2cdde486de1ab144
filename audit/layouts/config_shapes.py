"""A config's caches as producers other than vLLM size them (LMCache, SGLang): plain K/V shapes,
MLA latents, sliding layers, and a hybrid's recurrent-state pools from vLLM's own layouts."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .candidates import layouts_from_hf_config
from .families import ATTENTION_MODEL_TYPES, BY_MODEL_TYPE, is_plain_attention
from .hf_config import head_dim, model_type_of
from .hybrid import ATTENTION
from .model import LayoutError


def _positive(*numbers) -> bool:
    return all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in numbers)


def attention_kv_shape(config: dict) -> tuple[int, int, int] | None:
    """(layers, KV heads, head dim) of a config whose every layer keeps plain K and V, for
    producers other than vLLM that size their KV from it (LMCache, SGLang); None for hybrids
    (recurrent state), MLA (a latent, not K and V), and configs missing the fields."""
    text, model_type = model_type_of(config)
    if model_type in BY_MODEL_TYPE or (model_type not in ATTENTION_MODEL_TYPES and not is_plain_attention(text)):
        return None
    if any("kv_lora_rank" in name for name in text):  # MLA, whatever its model type says
        return None
    heads = attention_heads(config)
    layers = text.get("num_hidden_layers")
    return (layers, *heads) if heads is not None and _positive(layers) else None


def attention_heads(config: dict) -> tuple[int, int] | None:
    """(KV heads, head dim) of a config's attention layers (vLLM's `get_num_kv_heads` before TP,
    `get_head_size`), or None where the config does not say."""
    text, _ = model_type_of(config)
    try:
        heads = text.get("num_key_value_heads") or text["num_attention_heads"]
        width = head_dim(text)
    except (KeyError, LayoutError):
        return None
    return (heads, width) if _positive(heads, width) else None


def mla_latent_shape(config: dict) -> tuple[int, int] | None:
    """(layers, latent width: ``kv_lora_rank + qk_rope_head_dim``) of an MLA config (DeepSeek
    V2/V3 and kin), the one row per token and layer an MLA cache keeps; None for any other."""
    text, _ = model_type_of(config)
    layers, rank, rope = (text.get(name) for name in ("num_hidden_layers", "kv_lora_rank", "qk_rope_head_dim"))
    return (layers, rank + rope) if _positive(layers, rank, rope) else None


def mixes_sliding_layers(config: dict) -> bool:
    """Whether some layers attend over a sliding window and others over everything (Gemma 2/3,
    GPT-OSS): producers that pool the two apart (SGLang) keep fewer layers in each pool."""
    text, _ = model_type_of(config)
    kinds = {str(kind) for kind in text.get("layer_types") or ()}
    return ("sliding_attention" in kinds and len(kinds) > 1) or text.get("sliding_window_pattern") is not None


@dataclass(frozen=True, slots=True)
class HybridPools:
    """A hybrid model's caches on one TP rank, as producers that pool them apart (SGLang) hold
    them: how many layers keep recurrent state and how many attention KV, and the numbers one
    layer's states take (``{"conv": n, "ssm": m}``; a short-conv model has no ``ssm``), and the
    state's family (``mamba1``, ``mamba2``, ``gdn``, ``short_conv``)."""

    state_layers: int
    attention_layers: int
    state_numbers: dict
    family: str


def hybrid_pools(config: dict, tp_size: int) -> HybridPools | None:
    """`HybridPools` of a hybrid config (Mamba, Mamba2, GDN, short-conv layers; with attention or
    not) at `tp_size`, from the layouts vLLM's rules give it; None for a config of no hybrid
    family, or whose state does not divide by `tp_size`."""
    _, model_type = model_type_of(config)
    if model_type not in BY_MODEL_TYPE:
        return None
    try:
        layouts = layouts_from_hf_config(config, model="m", tp_size=tp_size, block_size=16)
    except LayoutError:
        return None
    counts = {"state": 0, "attention": 0}
    numbers: dict = {}
    family = next((layout.kind for layout in layouts if layout.kind != ATTENTION), None)
    if family is None:  # attention only (MLA)
        return None
    for layout in layouts:
        kind = "attention" if layout.kind == ATTENTION else "state"
        for segment in layout.segments:
            if segment.layer < 0:
                continue
            counts[kind] += 1
            for region in segment.regions:
                if region.kind == "state":
                    numbers.setdefault(region.name, math.prod(region.shape))
    return HybridPools(counts["state"], counts["attention"], numbers, family) if counts["state"] else None
