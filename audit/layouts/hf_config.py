"""Layouts built from a Hugging Face ``config.json``, the way vLLM 0.32.0 reads the same fields.

Field choices follow each vLLM model's ``get_mamba_state_shape_from_config`` (``mamba.py``,
``mamba2.py``, ``jamba.py``, ``falcon_h1.py``, ``granitemoehybrid.py``, ``zamba2.py``,
``qwen3_next.py``, ``qwen3_5.py``, ``lfm2.py``, ``nemotron_h.py``) and, for attention, vLLM's
``ModelConfig.get_num_kv_heads`` / ``get_head_size``. A config with recurrent-state fields of an
unknown model type is refused rather than guessed, because a wrong layout turns every verdict
wrong; a config with attention fields only gets the generic K/V layout.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .dtypes import resolve_dtypes
from .hybrid import ATTENTION, PLATFORM_BLOCKS, SLIDING, STATE, state_model_layouts
from .model import LayoutError, Layout
from .pages import AttentionShape
from .states import gdn_states, linear_attention_states, mamba1_states, mamba2_states, short_conv_states
from .serve_flags import version_refusal
from .versions import DEFAULT_PLATFORM, DEFAULT_VLLM_VERSION, base_platform, prefill_checkpoint_alignment
from .vllm_models import refusal


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
    checkpoint_alignment: int = 1  # the Mamba layers' prefill checkpoint alignment (vLLM 0.33)


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


def _get(config: dict, *names: str) -> int:
    """The first of ``names`` the config has (vLLM reads the newer name, configs carry either)."""
    for name in names:
        if config.get(name) is not None:
            return _int(config, name)
    raise LayoutError(f"config.json has none of the fields {list(names)}")


def _head_dim(config: dict) -> int:
    if config.get("head_dim") is not None:
        return _int(config, "head_dim")
    return _int(config, "hidden_size") // _int(config, "num_attention_heads")


def _attention(config: dict, options: _Options) -> AttentionShape:
    # vLLM get_num_kv_heads: max(1, total // tp); a config without num_key_value_heads is MHA.
    total = _get(config, "num_key_value_heads", "num_attention_heads")
    heads = max(1, total // options.tp_size)
    return AttentionShape(heads, _head_dim(config), options.kv_dtype)


def _layouts(config: dict, options: _Options, kind: str, states, layer_kinds,
             attention: AttentionShape | None = None) -> list[Layout]:
    has_attention = any((entry[1] if isinstance(entry, tuple) else entry) not in (STATE, None)
                        for entry in layer_kinds)
    if attention is None and has_attention:
        attention = _attention(config, options)
    return state_model_layouts(
        model=options.model, kind=kind, tp_size=options.tp_size, layer_kinds=layer_kinds,
        states=states, attention=attention, block_size=options.block_size,
        kernel_block_size=options.kernel_block_size, checkpoint_alignment=options.checkpoint_alignment)


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


def _layer_kinds(values, field: str, allowed: set[str] | None = None) -> list[str | None]:
    allowed = None if allowed is None else allowed | _GENERIC
    kinds = []
    for layer_type in values:
        layer_type = str(layer_type)
        if layer_type not in LAYER_TYPE_NAMES or (allowed is not None and layer_type not in allowed):
            known = sorted(allowed if allowed is not None else LAYER_TYPE_NAMES)
            raise LayoutError(f"config.json {field} has unknown entry {layer_type!r} (known: {known})")
        kinds.append(LAYER_TYPE_NAMES[layer_type])
    return kinds


def _mamba2_states(config: dict, options: _Options, *, intermediate: int, groups: str, heads: str,
                   head_dim: str, state: str, conv: str):
    return mamba2_states(
        intermediate_size=intermediate, n_groups=_int(config, groups), num_heads=_int(config, heads),
        head_dim=_int(config, head_dim), state_size=_int(config, state), conv_kernel=_int(config, conv),
        tp_size=options.tp_size, conv_dtype=options.conv_dtype, ssm_dtype=options.ssm_dtype,
        conv_layout=options.conv_layout)


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
    states = _mamba2_states(config, options, intermediate=_int(config, "expand") * _int(config, "hidden_size"),
                            groups="n_groups", heads="num_heads", head_dim="head_dim", state="state_size",
                            conv="conv_kernel")
    return _layouts(config, options, "mamba2", states, [STATE] * _int(config, "num_hidden_layers"))


def _gdn(config: dict, options: _Options) -> list[Layout]:
    """Qwen3-Next / Qwen3.5: Gated DeltaNet layers, full attention every few layers."""
    if config.get("layer_types"):
        kinds = _layer_kinds(config["layer_types"], "layer_types", {"linear_attention", "full_attention"})
    else:  # transformers' default: layer i is full attention when (i+1) % interval == 0
        interval = _int(config, "full_attention_interval")
        kinds = [ATTENTION if (layer + 1) % interval == 0 else STATE
                 for layer in range(_int(config, "num_hidden_layers"))]
    states = _linear_gdn_states(config, options)
    return _layouts(config, options, "gdn", states, kinds)


def _linear_gdn_states(config: dict, options: _Options):
    """The GDN states of the Qwen3-Next family's ``linear_*`` config keys (OLMo Hybrid uses them too)."""
    return gdn_states(
        num_k_heads=_int(config, "linear_num_key_heads"),
        num_v_heads=_int(config, "linear_num_value_heads"),
        head_k_dim=_int(config, "linear_key_head_dim"),
        head_v_dim=_int(config, "linear_value_head_dim"),
        conv_kernel=_int(config, "linear_conv_kernel_dim"), tp_size=options.tp_size,
        conv_dtype=options.conv_dtype, ssm_dtype=options.ssm_dtype,
        conv_layout=options.conv_layout)


def _olmo_hybrid(config: dict, options: _Options) -> list[Layout]:
    """OLMo Hybrid (``olmo_hybrid.py``): GDN layers and full attention by ``layer_types``; its
    attention heads are ``hidden_size // num_attention_heads`` wide whatever ``head_dim`` says."""
    if not config.get("layer_types"):
        raise LayoutError("olmo_hybrid config.json has no 'layer_types'")
    kinds = _layer_kinds(config["layer_types"], "layer_types", {"linear_attention", "full_attention"})
    states = _linear_gdn_states(config, options)
    heads = _int(config, "num_attention_heads")
    kv_heads = config.get("num_key_value_heads") or heads
    attention = AttentionShape(max(1, kv_heads // options.tp_size), _int(config, "hidden_size") // heads,
                               options.kv_dtype)
    return _layouts(config, options, "gdn", states, kinds, attention)


def _mla_attention(config: dict, options: _Options) -> AttentionShape:
    """vLLM's ``MLAAttentionSpec``: one latent of ``kv_lora_rank + qk_rope_head_dim`` a token,
    one head on every TP rank (the same bytes on each: the connector writes ``tp_rank:0``)."""
    return AttentionShape(1, _int(config, "kv_lora_rank") + _int(config, "qk_rope_head_dim"),
                          options.kv_dtype, vectors=1)


# An MLA model's block when --block-size is not given: the preferred block of its attention backend,
# 16 for CPU_MLA and for FlashAttention MLA (vLLM's first choice on Hopper); Blackwell's FlashInfer
# MLA takes 32 (a scan fits the block to the listed sizes either way).
MLA_DEFAULT_BLOCK = 16


def _mla(config: dict, options: _Options) -> list[Layout]:
    """DeepSeek-V2/V3 and Kimi-K2 (``deepseek_v2.py``): multi-head latent attention in every layer,
    one region per layer. Multi-token-prediction layers (speculative decoding) are not modelled."""
    kinds = [ATTENTION] * _int(config, "num_hidden_layers")
    return _layouts(config, options, ATTENTION, None, kinds, _mla_attention(config, options))


def _bailing_linear(config: dict, options: _Options) -> list[Layout]:
    """Bailing MoE V2.5 (``bailing_moe_linear.py``): linear attention layers, except every
    ``layer_group_size``-th, which is MLA; one ``(heads, d, d)`` state a linear layer."""
    group = config.get("layer_group_size", 1)
    kinds = [STATE if group > 0 and (layer + 1) % group else ATTENTION
             for layer in range(_int(config, "num_hidden_layers"))]
    heads = _int(config, "num_attention_heads")
    head_dim = _int(config, "head_dim") if "head_dim" in config else _int(config, "hidden_size") // heads
    states = linear_attention_states(num_heads=heads, head_dim=head_dim, tp_size=options.tp_size,
                                     dtype=options.conv_dtype)
    latent = AttentionShape(1, config.get("kv_lora_rank", 512) + config.get("qk_rope_head_dim", 64),
                            options.kv_dtype, vectors=1)
    return _layouts(config, options, "linear_attention", states, kinds, latent)


def _lfm2(config: dict, options: _Options) -> list[Layout]:
    """LFM2 (and LFM2-VL's text model): short-conv layers (conv state only) and full-attention layers."""
    if config.get("layer_types"):
        kinds = _layer_kinds(config["layer_types"], "layer_types", {"conv", "full_attention"})
    else:
        attention_layers = set(config.get("full_attn_idxs") or ())
        kinds = [ATTENTION if layer in attention_layers else STATE
                 for layer in range(_int(config, "num_hidden_layers"))]
    # vLLM's ShortConv layer reads hf_config.conv_dim (LFM2-VL's page alignment reads hidden_size:
    # the two agree wherever vLLM starts); checkpoints that omit conv_dim convolve over hidden_size.
    conv_dim = _int(config, "conv_dim" if "conv_dim" in config else "hidden_size")
    states = short_conv_states(
        conv_dim=conv_dim, conv_kernel=_int(config, "conv_L_cache"), tp_size=options.tp_size,
        conv_dtype=options.conv_dtype, conv_layout=options.conv_layout)
    return _layouts(config, options, "short_conv", states, kinds)


def _nemotron_h(config: dict, options: _Options) -> list[Layout]:
    """Nemotron-H: Mamba2 mixers, some attention layers, MLP/MoE layers with no cache."""
    field = next((name for name in ("layers_block_type", "hybrid_override_pattern", "layer_types")
                  if config.get(name)), None)
    if field is None:
        raise LayoutError("config.json has neither 'hybrid_override_pattern' nor 'layers_block_type'")
    kinds = _layer_kinds(config[field], field, {"M", "*", "-", "E", "mamba", "attention", "mlp", "moe",
                                                "linear_attention", "full_attention"})
    heads, head_dim = _int(config, "mamba_num_heads"), _int(config, "mamba_head_dim")
    states = _mamba2_states(config, options, intermediate=heads * head_dim, groups="n_groups",
                            heads="mamba_num_heads", head_dim="mamba_head_dim", state="ssm_state_size",
                            conv="conv_kernel")
    return _layouts(config, options, "mamba2", states, kinds)


def _falcon_h1(config: dict, options: _Options) -> list[Layout]:
    """Falcon-H1: every layer runs attention and a Mamba2 mixer side by side (two caches per
    layer; vLLM builds ``self_attn`` before ``mamba``, so attention is group 0)."""
    intermediate = (_int(config, "mamba_d_ssm") if config.get("mamba_d_ssm") is not None
                    else int(_int(config, "mamba_expand") * _int(config, "hidden_size")))
    states = _mamba2_states(config, options, intermediate=intermediate, groups="mamba_n_groups",
                            heads="mamba_n_heads", head_dim="mamba_d_head", state="mamba_d_state",
                            conv="mamba_d_conv")
    kinds = [(layer, kind) for layer in range(_int(config, "num_hidden_layers"))
             for kind in (ATTENTION, STATE)]
    return _layouts(config, options, "mamba2", states, kinds)


def _granite_kinds(config: dict) -> list[str | None]:
    if config.get("layer_types"):
        return _layer_kinds(config["layer_types"], "layer_types", {"mamba", "attention"})
    if config.get("layers_block_type"):
        return _layer_kinds(config["layers_block_type"], "layers_block_type", {"mamba", "attention"})
    attention = set(config.get("attn_layer_indices") or ())
    return [ATTENTION if layer in attention else STATE for layer in range(_int(config, "num_hidden_layers"))]


def _granite_mamba2(config: dict, options: _Options) -> list[Layout]:
    """GraniteMoeHybrid and Bamba: Mamba2 layers (``mamba_*`` fields) and attention layers."""
    states = _mamba2_states(config, options, intermediate=_int(config, "mamba_expand") * _int(config, "hidden_size"),
                            groups="mamba_n_groups", heads="mamba_n_heads", head_dim="mamba_d_head",
                            state="mamba_d_state", conv="mamba_d_conv")
    return _layouts(config, options, "mamba2", states, _granite_kinds(config))


def _jamba(config: dict, options: _Options) -> list[Layout]:
    """Jamba: Mamba1 layers, attention where ``layer % attn_layer_period == attn_layer_offset``."""
    if config.get("layers_block_type"):
        kinds = _layer_kinds(config["layers_block_type"], "layers_block_type", {"mamba", "attention"})
    else:
        period, offset = _int(config, "attn_layer_period"), config.get("attn_layer_offset", 0)
        kinds = [ATTENTION if layer % period == offset else STATE
                 for layer in range(_int(config, "num_hidden_layers"))]
    states = mamba1_states(
        intermediate_size=_int(config, "mamba_expand") * _int(config, "hidden_size"),
        state_size=_int(config, "mamba_d_state"), conv_kernel=_int(config, "mamba_d_conv"),
        tp_size=options.tp_size, conv_dtype=options.conv_dtype, ssm_dtype=options.ssm_dtype,
        conv_layout=options.conv_layout)
    return _layouts(config, options, "mamba1", states, kinds)


# Zamba2's layers_block_type: transformers 5 saves a Mamba layer as "linear_attention" (its remap of
# the older "mamba"); vLLM's zamba2.py builds a Mamba2 layer for every entry but "hybrid".
_ZAMBA2_BLOCK_TYPES = {"mamba", "linear_attention", "hybrid"}


def _zamba2(config: dict, options: _Options) -> list[Layout]:
    """Zamba2 (vLLM ``zamba2.py``): every layer has a Mamba2 mixer (``mamba_*``/``n_mamba_heads``
    fields); a ``hybrid`` layer also runs a shared attention block, with a KV cache of its own per
    hybrid layer. vLLM constructs the shared blocks, and so registers every attention layer, before
    the Mamba layers: attention is group 0. Block ``b`` of ``num_mem_blocks`` serves hybrid layers
    ``b, b + num_mem_blocks, ...``, registered block by block. The attention is multi-head over
    ``num_attention_heads`` (``num_key_value_heads`` is not used) with heads of
    ``2 * hidden_size // num_attention_heads`` (transformers' ``attention_head_dim``, recomputed
    when the config is loaded)."""
    block_types = [str(kind) for kind in config.get("layers_block_type") or ()]
    if not block_types:
        raise LayoutError("zamba2 config.json has no 'layers_block_type'")
    unknown = sorted(set(block_types) - _ZAMBA2_BLOCK_TYPES)
    if unknown:
        raise LayoutError(f"config.json layers_block_type has unknown entries {unknown} "
                          f"(known: {sorted(_ZAMBA2_BLOCK_TYPES)})")
    states = _mamba2_states(config, options, intermediate=_int(config, "mamba_expand") * _int(config, "hidden_size"),
                            groups="mamba_ngroups", heads="n_mamba_heads", head_dim="mamba_headdim",
                            state="mamba_d_state", conv="mamba_d_conv")
    hybrid = [layer for layer, kind in enumerate(block_types) if kind == "hybrid"]
    attention = None
    if hybrid:
        heads = _int(config, "num_attention_heads")
        if heads % options.tp_size:
            raise LayoutError(f"zamba2: num_attention_heads {heads} is not divisible by tp_size {options.tp_size}")
        attention = AttentionShape(heads // options.tp_size, 2 * _int(config, "hidden_size") // heads,
                                   options.kv_dtype)
        blocks = config.get("num_mem_blocks") or 1  # block b's attention layers register together
        hybrid = [hybrid[i] for i in sorted(range(len(hybrid)), key=lambda i: (i % blocks, i))]
    kinds = [(layer, ATTENTION) for layer in hybrid] + [(layer, STATE) for layer in range(len(block_types))]
    return state_model_layouts(
        model=options.model, kind="mamba2", tp_size=options.tp_size, layer_kinds=kinds, states=states,
        attention=attention, block_size=options.block_size, kernel_block_size=options.kernel_block_size,
        checkpoint_alignment=options.checkpoint_alignment)


def _attention_kinds(config: dict, model_type: str) -> list[str | None]:
    layers = _int(config, "num_hidden_layers")
    if config.get("layer_types"):
        kinds = _layer_kinds(config["layer_types"], "layer_types",
                             {"full_attention", "sliding_attention", "chunked_attention", "attention"})
        if len(kinds) != layers:
            raise LayoutError(f"config.json layer_types has {len(kinds)} entries for {layers} layers")
        return kinds
    window = config.get("sliding_window")
    if model_type == "gemma2" and window:  # even layers slide, odd layers attend fully
        return [SLIDING if layer % 2 == 0 else ATTENTION for layer in range(layers)]
    if model_type in ("gemma3", "gemma3_text") and window:
        pattern = _int(config, "sliding_window_pattern")
        return [ATTENTION if (layer + 1) % pattern == 0 else SLIDING for layer in range(layers)]
    if window and config.get("use_sliding_window", True) and model_type not in ("qwen2", "qwen3"):
        return [SLIDING] * layers
    return [ATTENTION] * layers


def _attention_only(config: dict, options: _Options, model_type: str) -> list[Layout]:
    """Every layer attention (full or sliding): one segment per layer, one page per block."""
    if options.block_size is None:
        raise LayoutError("an attention-only model's value size depends on vLLM's --block-size "
                          "(default 16 on CUDA, 128 on CPU): pass --block-size")
    return _layouts(config, options, ATTENTION, None, _attention_kinds(config, model_type))


ATTENTION_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "mistral", "mixtral",
                         "gemma", "gemma2", "gemma3", "gemma3_text", "phi3", "granite", "olmo2")

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
    "lfm2_moe": _lfm2,
    "nemotron_h": _nemotron_h,
    "falcon_h1": _falcon_h1,
    "granitemoehybrid": _granite_mamba2,
    "bamba": _granite_mamba2,
    "jamba": _jamba,
    "zamba2": _zamba2,
    "olmo_hybrid": _olmo_hybrid,
    "deepseek_v2": _mla,
    "deepseek_v3": _mla,
    "kimi_k2": _mla,
}
# Multimodal wrappers (LFM2-VL, MiniCPM-V 4.6/4.7, Nemotron VL and Omni, Qwen3.5, Kimi-K2.5) are laid
# out by their text config's model_type (model_type_of).

# Architectures whose configs carry no model_type of their own the audit could key on.
_ARCHITECTURE_BUILDERS: dict[str, Callable[[dict, _Options], list[Layout]]] = {
    "BailingMoeV2_5ForCausalLM": _bailing_linear,
}
SUPPORTED_MODEL_TYPES = (tuple(_BUILDERS) + ATTENTION_MODEL_TYPES
                         + tuple(f"<architecture {name}>" for name in _ARCHITECTURE_BUILDERS)
                         + ("<any attention-only config>",))


def _architectures(config: dict) -> list[str]:
    names = config.get("architectures")
    return [str(name) for name in names] if isinstance(names, list) else []


def _builder(config: dict, model_type: str | None) -> Callable[[dict, _Options], list[Layout]] | None:
    """The layout builder of a config: its (text) model type's, else its architecture's."""
    if model_type in _BUILDERS:
        return _BUILDERS[model_type]
    return next((_ARCHITECTURE_BUILDERS[name] for name in _architectures(config) if name in _ARCHITECTURE_BUILDERS),
                None)

# Fields that say a config has recurrent state or a cache the generic attention layout does not
# describe (MLA latents): such a config of an unknown model type is refused, never guessed.
_NOT_PLAIN_ATTENTION = ("mamba", "ssm", "conv_l_cache", "linear_", "state_size", "kv_lora_rank",
                        "layers_block_type", "hybrid_override_pattern")


def _plain_attention_config(config: dict) -> bool:
    if any(marker in name.lower() for name in config for marker in _NOT_PLAIN_ATTENTION):
        return False
    if any(str(kind) not in ("full_attention", "sliding_attention", "attention")
           for kind in config.get("layer_types") or ()):
        return False
    return all(isinstance(config.get(name), int) for name in ("num_hidden_layers", "num_attention_heads")) and (
        isinstance(config.get("head_dim"), int) or isinstance(config.get("hidden_size"), int))


def model_type_of(config: dict) -> tuple[dict, str | None]:
    """The text config (``text_config`` of a multimodal config, or ``llm_config``, the name
    released Nemotron VL checkpoints use; else the config) and its type."""
    text = next((config[name] for name in ("text_config", "llm_config") if isinstance(config.get(name), dict)),
                config)
    return text, text.get("model_type") or config.get("model_type")


def layouts_from_hf_config(config: dict, *, model: str, tp_size: int = 1,
                           state_dtype: str | None = None, ssm_dtype: str | None = None,
                           block_size: int | None = None, conv_layout: str = "SD",
                           kv_cache_dtype: str | None = None,
                           kernel_block_size: int | None = None, platform: str = DEFAULT_PLATFORM,
                           model_dtype: str | None = None, vllm_version: str | None = None) -> list[Layout]:
    """One Layout per KV-cache group, in vLLM's group order (``@group:g`` is list index g).

    ``model``: the model path or name; its basename is what vLLM puts in keys.
    ``state_dtype``: vLLM's ``--mamba-cache-dtype`` (None: the model dtype, vLLM's "auto").
    ``ssm_dtype``: ``--mamba-ssm-cache-dtype`` (None: vLLM's per-model and per-platform rules,
    see ``audit.layouts.dtypes``).
    ``model_dtype``: vLLM's ``--dtype`` (None: "auto", from the config).
    ``block_size``: vLLM's ``--block-size`` (None: the platform's default: 16 on CUDA, 128 on CPU;
    an MLA model's backend's, 16).
    ``kv_cache_dtype``: attention ``--kv-cache-dtype`` (None: the model dtype).
    ``kernel_block_size``: the attention backend's smallest kernel block, the alignment of a
    hybrid model's block (None: the platform's, 16 on CUDA and 32 on CPU; ROCm AITER 64; a
    hybrid with MLA attention aligns to 128 at least).
    ``platform``: one of ``versions.PLATFORMS``: "cpu" (vLLM's CPU build forces float32 ssm states),
    "sm90", "sm100", "sm120" (rules of those GPUs), "cuda" (a CUDA GPU none of their rules applies to).
    ``vllm_version``: the producer's release, "0.32" or "0.33" (None: 0.32; ``audit.layouts.versions``).
    """
    version = vllm_version or DEFAULT_VLLM_VERSION
    text, model_type = model_type_of(config)
    reason = refusal([config.get("model_type"), model_type], _architectures(config), vllm_version)
    if reason is not None:
        raise LayoutError(f"model_type {config.get('model_type') or model_type!r} is not supported: {reason}; "
                          f"describe its values in a layout file instead")
    builder = _builder(config, model_type)
    if builder is None and model_type not in ATTENTION_MODEL_TYPES and not _plain_attention_config(text):
        raise LayoutError(f"model_type {model_type!r} is not supported "
                          f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)}); "
                          f"describe its values in a layout file instead")
    name = model.rstrip("/").split("/")[-1]
    if not name:
        raise LayoutError(f"model name {model!r} has no basename")
    if tp_size < 1:
        raise LayoutError(f"tp_size must be >= 1, got {tp_size}")
    dtypes = resolve_dtypes(model_type=model_type or "", text=text, config=config,
                            model_dtype=model_dtype, conv_dtype=state_dtype, ssm_dtype=ssm_dtype,
                            kv_cache_dtype=kv_cache_dtype, platform=platform)
    refused = version_refusal(version, dtypes.kv, dtypes.model)
    if refused is not None:
        raise LayoutError(refused)
    default_block, default_kernel = PLATFORM_BLOCKS[base_platform(platform)]
    if builder is _mla:
        default_block = MLA_DEFAULT_BLOCK
    options = _Options(
        model=name, tp_size=tp_size, conv_dtype=dtypes.conv, ssm_dtype=dtypes.ssm, kv_dtype=dtypes.kv,
        conv_layout=conv_layout, block_size=default_block if block_size is None else block_size,
        kernel_block_size=default_kernel if kernel_block_size is None else kernel_block_size,
        checkpoint_alignment=prefill_checkpoint_alignment(model_type, text, version, platform))
    if builder is None:
        return _attention_only(text, options, model_type or "")
    return builder(text, options)


def _positive(*numbers) -> bool:
    return all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in numbers)


def attention_kv_shape(config: dict) -> tuple[int, int, int] | None:
    """(layers, KV heads, head dim) of a config whose every layer keeps plain K and V, for
    producers other than vLLM that size their KV from it (LMCache, SGLang); None for hybrids
    (recurrent state), MLA (a latent, not K and V), and configs missing the fields."""
    text, model_type = model_type_of(config)
    if model_type in _BUILDERS or (model_type not in ATTENTION_MODEL_TYPES and not _plain_attention_config(text)):
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
        head_dim = _head_dim(text)
    except (KeyError, LayoutError):
        return None
    return (heads, head_dim) if _positive(heads, head_dim) else None


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
    if model_type not in _BUILDERS:
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
