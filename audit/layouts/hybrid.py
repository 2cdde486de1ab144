"""How vLLM turns a model's layers into KV-cache groups and registered segments.

Read from vLLM (see docs/layouts.md for the reasoning):

- ``vllm/v1/core/kv_cache_utils.py`` ``_get_kv_cache_groups_uniform_page_size``: layers are
  bucketed by spec in order of first appearance; ``group_size`` is the smallest bucket (or the
  largest, when largest < 1.5 x smallest); a bucket of n layers becomes ``ceil(n/group_size)``
  groups, group i taking ``layers[i::num_groups]``.
- ``get_kv_cache_config_from_groups``: ``group_size`` tensors, tensor i shared by the i-th
  layer of every group. The connector registers each tensor once (deduplicated by storage), so
  segment i is that shared tensor and every group's value spans all of them.
- ``vllm/platforms/interface.py`` ``_align_hybrid_block_size`` (mamba_cache_mode none/align):
  ``block_size = align * ceil(mamba_page / (align * attention_bytes_per_token))`` with
  ``align = max(kernel_block, configured block_size)`` (kernel_block: the attention backend's
  smallest kernel block: 16 for FlashAttention/FlashInfer on CUDA, 32 for CPU_ATTN, 64 for ROCm
  AITER; MLA attention raises the alignment to 128), rounded up to a multiple of the kernel
  block, and the mamba page is padded to ``block_size * attention_bytes_per_token``. From vLLM
  0.33 ``align`` is also a multiple of the Mamba layers' prefill checkpoint alignment
  (``audit.layouts.versions``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache

from .model import LayoutError, Layout, Segment, layer_segment_name
from .pages import AttentionShape, attention_regions, state_regions, unused_regions
from .states import StateTensor, page_bytes

DEFAULT_BLOCK_SIZE = 16  # vLLM's CUDA default for --block-size
DEFAULT_KERNEL_BLOCK_SIZE = 16  # smallest kernel block of FlashAttention / FlashInfer on CUDA
# per base platform (``versions.base_platform``): (default --block-size, smallest attention kernel block)
PLATFORM_BLOCKS = {"cuda": (16, 16), "cpu": (128, 32)}
MLA_HYBRID_ALIGNMENT = 128  # a hybrid with MLA attention: its block is a multiple of 128

ATTENTION = "attention"
SLIDING = "sliding_attention"  # a spec of its own: its own KV-cache groups
STATE = "state"


def cdiv(numerator: int, denominator: int) -> int:
    return -(-numerator // denominator)


def hybrid_block_size(state_page_bytes: int, attention_bytes_per_token: int,
                      block_size: int | None, kernel_block_size: int | None = None,
                      latent: bool = False, checkpoint_alignment: int = 1) -> int:
    """Tokens per block after vLLM raises the attention block to fit one mamba page.

    ``block_size`` is vLLM's ``--block-size`` (None: its CUDA default, 16) or the value vLLM
    logged ("Setting attention block size to N tokens"); both give the same answer.
    ``kernel_block_size``: the attention backend's smallest kernel block (None: 16).
    ``latent``: the attention is MLA, whose decode kernels want the block a multiple of 128.
    ``checkpoint_alignment``: the Mamba layers' prefill checkpoint alignment (vLLM 0.33; 1: none).
    """
    configured = DEFAULT_BLOCK_SIZE if block_size is None else block_size
    kernel = DEFAULT_KERNEL_BLOCK_SIZE if kernel_block_size is None else kernel_block_size
    if configured < 1 or kernel < 1:
        raise LayoutError(f"block sizes must be positive, got {configured} and kernel {kernel}")
    align = math.lcm(max(kernel, configured, MLA_HYBRID_ALIGNMENT if latent else 0), checkpoint_alignment)
    needed = align * cdiv(state_page_bytes, align * attention_bytes_per_token)
    needed = kernel * cdiv(needed, kernel)
    return max(configured, needed)


def kv_cache_groups(layer_kinds: Sequence) -> list[tuple[str, list[int]]]:
    """(kind, layer indices) per KV-cache group, in vLLM's group order.

    ``layer_kinds[i]`` is ``"attention"``, ``"state"`` (or another attention kind such as
    ``"sliding_attention"``, a spec of its own) or None (a layer with no cache); or a
    ``(layer, kind)`` pair, for models where one layer holds two caches (Falcon-H1: attention
    and Mamba2 side by side), listed in vLLM's module-construction order.
    """
    buckets: dict[str, list[int]] = {}
    for position, entry in enumerate(layer_kinds):
        layer, kind = entry if isinstance(entry, tuple) else (position, entry)
        if kind is not None:
            buckets.setdefault(kind, []).append(layer)
    if not buckets:
        raise LayoutError("model has no layer with a KV cache or recurrent state")
    sizes = [len(layers) for layers in buckets.values()]
    group_size = max(sizes) if max(sizes) < min(sizes) * 1.5 else min(sizes)
    groups = []
    for kind, layers in buckets.items():
        num_groups = cdiv(len(layers), group_size)
        groups.extend((kind, layers[i::num_groups]) for i in range(num_groups))
    return groups


def _is_attention(kind: str) -> bool:
    return kind != STATE


def state_model_layouts(*, model: str, kind: str, tp_size: int,
                        layer_kinds: Sequence, states: tuple[StateTensor, ...] | None,
                        attention: AttentionShape | None, block_size: int | None,
                        kernel_block_size: int | None, checkpoint_alignment: int = 1) -> list[Layout]:
    """One Layout per KV-cache group: pure state, hybrid, or attention only (``states`` None).

    Attention only: ``block_size`` is the producer's ``--block-size`` (required: on CUDA vLLM
    defaults to 16, on CPU to 128). Hybrid: ``block_size`` is raised to fit a mamba page, with
    ``kernel_block_size`` the backend's alignment and ``checkpoint_alignment`` the Mamba layers'.
    """
    groups = kv_cache_groups(layer_kinds)
    has_attention = any(_is_attention(group_kind) for group_kind, _ in groups)
    has_state = any(group_kind == STATE for group_kind, _ in groups)
    if has_state and states is None:
        raise LayoutError("model has recurrent-state layers but no state shapes")
    if has_attention:
        assert attention is not None, "a model with attention layers needs its attention shape"
        if has_state:
            tokens = hybrid_block_size(page_bytes(states), attention.bytes_per_token, block_size,
                                       kernel_block_size, attention.latent, checkpoint_alignment)
        else:
            tokens = DEFAULT_BLOCK_SIZE if block_size is None else block_size
        page = tokens * attention.bytes_per_token
    else:
        tokens = 0  # no attention pages; a pure-state page is never padded
        page = page_bytes(states)
    return list(_paged_layouts(model, kind, tp_size, tuple((group_kind, tuple(layers)) for group_kind, layers in groups),
                               None if states is None else tuple(states), attention, tokens, page))


@lru_cache(maxsize=1024)
def _paged_layouts(model: str, kind: str, tp_size: int, groups: tuple, states: tuple[StateTensor, ...] | None,
                   attention: AttentionShape | None, tokens: int, page: int) -> tuple[Layout, ...]:
    """The groups' layouts once their pages are sized: the candidates of a fit (`audit.layouts.infer`)
    that differ only in block settings vLLM raises to the same block are laid out once (layouts
    are frozen: one object serves them all)."""
    num_segments = max(len(layers) for _, layers in groups)
    layouts = []
    for group, (group_kind, layers) in enumerate(groups):
        segments = []
        for index in range(num_segments):
            offset = index * page
            if index >= len(layers):
                segments.append(Segment(index, f"unused.{index}", -1, offset, page,
                                        unused_regions(offset, page)))
                continue
            if _is_attention(group_kind):
                regions = attention_regions(attention, offset, tokens)
            else:
                regions = state_regions(states, offset, page)
            segments.append(Segment(index, layer_segment_name(layers[index]), layers[index], offset,
                                    page, regions))
        layouts.append(Layout(model, group, ATTENTION if _is_attention(group_kind) else kind,
                              tp_size, tuple(segments)))
    return tuple(layouts)
