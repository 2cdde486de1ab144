"""What every family module is handed and gives back.

A family turns a (text) config into its layer kinds and its state tensors; `build_layouts`
lays them out the way vLLM groups and pages them (`audit.layouts.hybrid`). `Options` are the
settings of one candidate, already resolved (dtypes, default blocks) by `audit.layouts.candidates`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..hf_config import first_int, head_dim
from ..hybrid import STATE, state_model_layouts
from ..model import Layout
from ..pages import AttentionShape


@dataclass(frozen=True, slots=True)
class Options:
    """One candidate's settings, as a family builds with them."""

    model: str
    model_type: str
    tp_size: int
    conv_dtype: str
    ssm_dtype: str
    kv_dtype: str
    conv_layout: str
    block_size: int
    kernel_block_size: int
    checkpoint_alignment: int = 1  # the Mamba layers' prefill checkpoint alignment (vLLM 0.33)


@dataclass(frozen=True, slots=True)
class Family:
    """One way vLLM builds a model's caches: ``build(text_config, options)`` gives one Layout per
    KV-cache group; ``default_block``: its attention backend's block where --block-size is not
    given (None: the platform's)."""

    name: str
    build: Callable[[dict, Options], list[Layout]]
    default_block: int | None = None
    # ``token_images(text_config, checkpoint, model, tp_size, tp_rank)``: layer 0's state rows of
    # every token (`audit.layouts.images`), or None: this family's keys are not bound to tokens
    token_images: Callable | None = None
    # where it has no `token_images` because its layer 0 holds no row a token: what it holds instead
    no_token_rows: str = ""


def attention_shape(config: dict, options: Options) -> AttentionShape:
    """vLLM's ``get_num_kv_heads`` (max(1, total // tp); a config without
    ``num_key_value_heads`` is MHA) and ``get_head_size``."""
    total = first_int(config, "num_key_value_heads", "num_attention_heads")
    heads = max(1, total // options.tp_size)
    return AttentionShape(heads, head_dim(config), options.kv_dtype)


def build_layouts(config: dict, options: Options, kind: str, states, layer_kinds,
                  attention: AttentionShape | None = None) -> list[Layout]:
    """The layouts of a model with these layer kinds and states (``attention``: the attention
    layers' shape where it is not the config's plain K/V)."""
    has_attention = any((entry[1] if isinstance(entry, tuple) else entry) not in (STATE, None)
                        for entry in layer_kinds)
    if attention is None and has_attention:
        attention = attention_shape(config, options)
    return state_model_layouts(
        model=options.model, kind=kind, tp_size=options.tp_size, layer_kinds=layer_kinds,
        states=states, attention=attention, block_size=options.block_size,
        kernel_block_size=options.kernel_block_size, checkpoint_alignment=options.checkpoint_alignment)
