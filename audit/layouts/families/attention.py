"""Attention in every layer (full, sliding or chunked): one segment per layer, one page per block.

The generic K/V layout of any config with attention fields only; a config with recurrent-state or
latent fields that no family knows is refused rather than guessed (`is_plain_attention`).
"""

from __future__ import annotations

from ..hf_config import config_int, layer_kinds
from ..hybrid import ATTENTION, SLIDING
from ..model import LayoutError, Layout
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


ATTENTION_ONLY = Family("attention", _attention_only)
