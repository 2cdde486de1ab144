"""Layouts built from a Hugging Face ``config.json``, the way vLLM reads the same fields.

Field choices follow each vLLM model's ``get_mamba_state_shape_from_config`` (``mamba.py``,
``mamba2.py``, ``qwen3_next.py``, ``lfm2.py``, ``nemotron_h.py``); unknown model types are
refused rather than guessed, because a wrong layout turns every verdict wrong.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .hybrid import ATTENTION, STATE, state_model_layouts
from .model import LayoutError, Layout, canonical_dtype
from .pages import AttentionShape
from .states import gdn_states, mamba1_states, mamba2_states, short_conv_states


@dataclass(frozen=True, slots=True)
class _Options:
    model: str
    tp_size: int
    conv_dtype: str
    ssm_dtype: str
    kv_dtype: str
    conv_layout: str
    block_size: int | None
    kernel_block_size: int | None


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


def _int(config: dict, name: str) -> int:
    value = config.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise LayoutError(f"config.json field {name!r} must be a positive integer, got {value!r}")
    return value


def _head_dim(config: dict) -> int:
    if config.get("head_dim") is not None:
        return _int(config, "head_dim")
    return _int(config, "hidden_size") // _int(config, "num_attention_heads")


def _attention(config: dict, options: _Options) -> AttentionShape:
    heads = max(1, _int(config, "num_key_value_heads") // options.tp_size)
    return AttentionShape(heads, _head_dim(config), options.kv_dtype)


def _layouts(config: dict, options: _Options, kind: str, states, layer_kinds) -> list[Layout]:
    attention = _attention(config, options) if ATTENTION in layer_kinds else None
    return state_model_layouts(
        model=options.model, kind=kind, tp_size=options.tp_size, layer_kinds=layer_kinds,
        states=states, attention=attention, block_size=options.block_size,
        kernel_block_size=options.kernel_block_size)


def _layer_kinds(config: dict, names: dict[str, str | None]) -> list[str | None]:
    kinds = []
    for layer_type in config["layer_types"]:
        if layer_type not in names:
            raise LayoutError(f"config.json layer_types has unknown entry {layer_type!r} "
                              f"(known: {sorted(names)})")
        kinds.append(names[layer_type])
    return kinds


def _mamba1(config: dict, options: _Options) -> list[Layout]:
    intermediate = (_int(config, "intermediate_size") if "intermediate_size" in config
                    else _int(config, "expand") * _int(config, "hidden_size"))
    states = mamba1_states(
        intermediate_size=intermediate, state_size=_int(config, "state_size"),
        conv_kernel=_int(config, "conv_kernel"), tp_size=options.tp_size,
        conv_dtype=options.conv_dtype, ssm_dtype=options.ssm_dtype,
        conv_layout=options.conv_layout)
    return _layouts(config, options, "mamba1", states, [STATE] * _int(config, "num_hidden_layers"))


def _mamba2(config: dict, options: _Options) -> list[Layout]:
    states = mamba2_states(
        intermediate_size=_int(config, "expand") * _int(config, "hidden_size"),
        n_groups=_int(config, "n_groups"), num_heads=_int(config, "num_heads"),
        head_dim=_int(config, "head_dim"), state_size=_int(config, "state_size"),
        conv_kernel=_int(config, "conv_kernel"), tp_size=options.tp_size,
        conv_dtype=options.conv_dtype, ssm_dtype=options.ssm_dtype,
        conv_layout=options.conv_layout)
    return _layouts(config, options, "mamba2", states, [STATE] * _int(config, "num_hidden_layers"))


def _gdn(config: dict, options: _Options) -> list[Layout]:
    """Qwen3-Next / Qwen3.5: Gated DeltaNet layers, full attention every few layers."""
    if config.get("layer_types"):
        kinds = _layer_kinds(config, {"linear_attention": STATE, "full_attention": ATTENTION})
    else:  # transformers' default: layer i is full attention when (i+1) % interval == 0
        interval = _int(config, "full_attention_interval")
        kinds = [ATTENTION if (layer + 1) % interval == 0 else STATE
                 for layer in range(_int(config, "num_hidden_layers"))]
    states = gdn_states(
        num_k_heads=_int(config, "linear_num_key_heads"),
        num_v_heads=_int(config, "linear_num_value_heads"),
        head_k_dim=_int(config, "linear_key_head_dim"),
        head_v_dim=_int(config, "linear_value_head_dim"),
        conv_kernel=_int(config, "linear_conv_kernel_dim"), tp_size=options.tp_size,
        conv_dtype=options.conv_dtype, ssm_dtype=options.ssm_dtype,
        conv_layout=options.conv_layout)
    return _layouts(config, options, "gdn", states, kinds)


def _lfm2(config: dict, options: _Options) -> list[Layout]:
    """LFM2: short-conv layers (conv state only) and full-attention layers."""
    if config.get("layer_types"):
        kinds = _layer_kinds(config, {"conv": STATE, "full_attention": ATTENTION})
    else:
        attention_layers = set(config.get("full_attn_idxs") or ())
        kinds = [ATTENTION if layer in attention_layers else STATE
                 for layer in range(_int(config, "num_hidden_layers"))]
    # vLLM reads hf_config.conv_dim; LFM2 checkpoints that omit it convolve over hidden_size.
    conv_dim = _int(config, "conv_dim" if "conv_dim" in config else "hidden_size")
    states = short_conv_states(
        conv_dim=conv_dim, conv_kernel=_int(config, "conv_L_cache"), tp_size=options.tp_size,
        conv_dtype=options.conv_dtype, conv_layout=options.conv_layout)
    return _layouts(config, options, "short_conv", states, kinds)


_NEMOTRON_BLOCKS = {"M": STATE, "*": ATTENTION, "-": None, "E": None,
                    "mamba": STATE, "attention": ATTENTION, "mlp": None, "moe": None}


def _nemotron_h(config: dict, options: _Options) -> list[Layout]:
    """Nemotron-H: Mamba2 mixers, some attention layers, MLP/MoE layers with no cache."""
    pattern = config.get("layers_block_type") or config.get("hybrid_override_pattern")
    if not pattern:
        raise LayoutError("config.json has neither 'hybrid_override_pattern' nor "
                          "'layers_block_type'")
    unknown = sorted({str(block) for block in pattern} - set(_NEMOTRON_BLOCKS))
    if unknown:
        raise LayoutError(f"config.json layer pattern has unknown entries {unknown}")
    kinds = [_NEMOTRON_BLOCKS[block] for block in pattern]
    heads, head_dim = _int(config, "mamba_num_heads"), _int(config, "mamba_head_dim")
    states = mamba2_states(
        intermediate_size=heads * head_dim, n_groups=_int(config, "n_groups"),
        num_heads=heads, head_dim=head_dim, state_size=_int(config, "ssm_state_size"),
        conv_kernel=_int(config, "conv_kernel"), tp_size=options.tp_size,
        conv_dtype=options.conv_dtype, ssm_dtype=options.ssm_dtype,
        conv_layout=options.conv_layout)
    return _layouts(config, options, "mamba2", states, kinds)


_BUILDERS: dict[str, Callable[[dict, _Options], list[Layout]]] = {
    "mamba": _mamba1,
    "falcon_mamba": _mamba1,
    "mamba2": _mamba2,
    "qwen3_next": _gdn,
    "qwen3_5": _gdn,
    "qwen3_5_text": _gdn,
    "qwen3_5_moe": _gdn,
    "qwen3_5_moe_text": _gdn,
    "lfm2": _lfm2,
    "nemotron_h": _nemotron_h,
}
SUPPORTED_MODEL_TYPES = tuple(_BUILDERS)


def layouts_from_hf_config(config: dict, *, model: str, tp_size: int = 1,
                           state_dtype: str = "bfloat16", ssm_dtype: str | None = None,
                           block_size: int | None = None, conv_layout: str = "SD",
                           kv_cache_dtype: str | None = None,
                           attention_kernel_block_size: int | None = None) -> list[Layout]:
    """One Layout per KV-cache group, in vLLM's group order (``@group:g`` is list index g).

    ``model``: the model path or name; its basename is what vLLM puts in keys.
    ``state_dtype``: vLLM's ``--mamba-cache-dtype`` resolved (the model dtype under "auto").
    ``ssm_dtype``: ``--mamba-ssm-cache-dtype``; None: the config's ``mamba_ssm_dtype`` if it has
    one (vLLM applies it for Qwen3.5), else ``state_dtype``.
    ``block_size``: vLLM's ``--block-size`` (None: 16); only hybrid models depend on it.
    ``kv_cache_dtype``: attention ``--kv-cache-dtype`` (None: same as ``state_dtype``).
    ``attention_kernel_block_size``: the attention backend's kernel block when it is smaller
    than the block size (None: equal, as with FlashAttention).
    """
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    model_type = text.get("model_type") or config.get("model_type")
    builder = _BUILDERS.get(model_type)
    if builder is None:
        raise LayoutError(f"model_type {model_type!r} is not supported "
                          f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)}); "
                          f"describe its values in a layout file instead")
    name = model.rstrip("/").split("/")[-1]
    if not name:
        raise LayoutError(f"model name {model!r} has no basename")
    if tp_size < 1:
        raise LayoutError(f"tp_size must be >= 1, got {tp_size}")
    conv_dtype = canonical_dtype(state_dtype)
    ssm = ssm_dtype or text.get("mamba_ssm_dtype")
    options = _Options(
        model=name, tp_size=tp_size, conv_dtype=conv_dtype,
        ssm_dtype=canonical_dtype(ssm) if ssm else conv_dtype,
        kv_dtype=canonical_dtype(kv_cache_dtype) if kv_cache_dtype else conv_dtype,
        conv_layout=conv_layout, block_size=block_size,
        kernel_block_size=attention_kernel_block_size)
    return builder(text, options)
