"""A model's Hugging Face ``config.json``, read the way vLLM 0.32.0 reads its fields.

The first step of laying a model out (config -> family -> candidate layouts -> chosen reading,
docs/layouts.md §11): the file itself, the text config a multimodal wrapper carries, its
architectures, and the field readers every family shares (a positive integer, the first of a
field's spellings, the attention head size, the layer kinds a config lists).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .hybrid import ATTENTION, SLIDING, STATE
from .model import LayoutError


def load_hf_config(path: str | Path) -> dict:
    """A model's ``config.json`` (``path`` may be the file or the model directory)."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    try:
        config = json.loads(path.read_text())
    except OSError as error:
        raise LayoutError(f"{path}: cannot read: {error.strerror}") from None
    except json.JSONDecodeError as error:
        raise LayoutError(f"{path}: not JSON: {error.msg} at line {error.lineno}") from None
    if not isinstance(config, dict):
        raise LayoutError(f"{path}: expected a JSON object")
    return config


def model_type_of(config: dict) -> tuple[dict, str | None]:
    """The text config (``text_config`` of a multimodal config, or ``llm_config``, the name
    released Nemotron VL checkpoints use; else the config) and its type."""
    text = next((config[name] for name in ("text_config", "llm_config") if isinstance(config.get(name), dict)),
                config)
    return text, text.get("model_type") or config.get("model_type")


# Fields by which a config says that an encoder's embeddings, not only tokens', reach its text
# model's layer 0 (a vision tower's, an audio encoder's), at the top or in an omni model's thinker
ENCODER_FIELDS = ("vision_config", "audio_config", "speech_config", "vision_tower", "visual",
                  "image_token_id", "image_token_index", "video_token_id", "audio_token_id", "audio_token_index")


def encoder_inputs(config: dict) -> tuple[str, ...]:
    """The fields of `config` (the whole file's) that say its model takes embeddings from an encoder
    (images, audio) into the positions of its placeholder tokens; empty for a text model."""
    thinker = config.get("thinker_config")
    scopes = [config, thinker] if isinstance(thinker, dict) else [config]
    return tuple(sorted({name for scope in scopes for name in ENCODER_FIELDS if scope.get(name) is not None}))


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """A config as the later steps read it, read once: the whole config (its own model type, its
    architectures, its dtype) and the text config that decides the layout."""

    config: dict
    text: dict
    model_type: str | None  # the text config's, else the config's
    architectures: tuple[str, ...]  # the config's ``architectures`` entries (vLLM's registry keys)


def read_config(config: dict) -> ModelConfig:
    text, model_type = model_type_of(config)
    names = config.get("architectures")
    return ModelConfig(config, text, model_type, tuple(map(str, names)) if isinstance(names, list) else ())


def config_int(config: dict, name: str) -> int:
    """Field ``name``, which vLLM sizes a cache by: a positive integer, or a LayoutError."""
    value = config.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise LayoutError(f"config.json field {name!r} must be a positive integer, got {value!r}")
    return value


def first_int(config: dict, *names: str) -> int:
    """The first of ``names`` the config has (vLLM reads the newer name, configs carry either)."""
    for name in names:
        if config.get(name) is not None:
            return config_int(config, name)
    raise LayoutError(f"config.json has none of the fields {list(names)}")


def head_dim(config: dict) -> int:
    """vLLM's ``get_head_size``: ``head_dim``, else ``hidden_size // num_attention_heads``."""
    if config.get("head_dim") is not None:
        return config_int(config, "head_dim")
    return config_int(config, "hidden_size") // config_int(config, "num_attention_heads")


# Names of layer kinds in configs: transformers 5 `layer_types` / `layers_block_type`, older
# patterns and per-family spellings. None: a layer with no cache (MLP, MoE).
LAYER_TYPE_NAMES: dict[str, str | None] = {
    "full_attention": ATTENTION, "attention": ATTENTION, "*": ATTENTION, "hybrid": ATTENTION,
    "sliding_attention": SLIDING, "chunked_attention": "chunked_attention",
    "linear_attention": STATE, "mamba": STATE, "mamba2": STATE, "M": STATE, "conv": STATE,
    "ssm": STATE,
    "mlp": None, "moe": None, "-": None, "E": None,
}


# transformers 5 writes these generic names for every hybrid family's layer_types
_GENERIC = {"linear_attention", "full_attention"}


def layer_kinds(values, field: str, allowed: set[str]) -> list[str | None]:
    """The kind of each layer a config's ``field`` lists (``allowed``: the family's own
    spellings, besides transformers 5's generic ones); an unknown entry is a LayoutError."""
    allowed = allowed | _GENERIC
    kinds = []
    for layer_type in values:
        layer_type = str(layer_type)
        if layer_type not in LAYER_TYPE_NAMES or layer_type not in allowed:
            raise LayoutError(f"config.json {field} has unknown entry {layer_type!r} (known: {sorted(allowed)})")
        kinds.append(LAYER_TYPE_NAMES[layer_type])
    return kinds
