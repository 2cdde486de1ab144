"""How vLLM turns a model's layers into KV-cache groups and registered segments.

Read from vLLM (see docs/layouts.md for the reasoning):

- ``vllm/v1/core/kv_cache_utils.py`` ``_get_kv_cache_groups_uniform_page_size``: layers are
  bucketed by spec in order of first appearance; ``group_size`` is the smallest bucket (or the
  largest, when largest < 1.5 x smallest); a bucket of n layers becomes ``ceil(n/group_size)``
  groups, group i taking ``layers[i::num_groups]``.
- ``get_kv_cache_config_from_groups``: ``group_size`` tensors, tensor i shared by the i-th
  layer of every group. The connector registers each tensor once (deduplicated by storage), so
  segment i is that shared tensor and every group's value spans all of them.
- ``vllm/platforms/interface.py`` (hybrid block-size alignment, mamba_cache_mode none/align):
  ``block_size = align * ceil(mamba_page / (align * attention_bytes_per_token))`` with
  ``align = max(16, configured block_size)``, and the mamba page is padded to
  ``block_size * attention_bytes_per_token``.
"""

from __future__ import annotations

from collections.abc import Sequence

from .model import LayoutError, Layout, Segment, layer_segment_name
from .pages import AttentionShape, attention_regions, state_regions, unused_regions
from .states import StateTensor, page_bytes

DEFAULT_BLOCK_SIZE = 16  # vLLM's CUDA default for --block-size
KERNEL_BLOCK_ALIGNMENT = 16  # smallest kernel block of FlashAttention / FlashInfer on CUDA

ATTENTION = "attention"
STATE = "state"


def cdiv(numerator: int, denominator: int) -> int:
    return -(-numerator // denominator)


def hybrid_block_size(state_page_bytes: int, attention_bytes_per_token: int,
                      block_size: int | None) -> int:
    """Tokens per block after vLLM raises the attention block to fit one mamba page.

    ``block_size`` is vLLM's ``--block-size`` (None: its default, 16) or the value vLLM logged
    ("Setting attention block size to N tokens"); both give the same answer.
    """
    configured = DEFAULT_BLOCK_SIZE if block_size is None else block_size
    if configured < 1:
        raise LayoutError(f"block size must be positive, got {configured}")
    align = max(KERNEL_BLOCK_ALIGNMENT, configured)
    needed = align * cdiv(state_page_bytes, align * attention_bytes_per_token)
    return max(configured, needed)


def kv_cache_groups(layer_kinds: Sequence[str | None]) -> list[tuple[str, list[int]]]:
    """(kind, layer indices) per KV-cache group, in vLLM's group order.

    ``layer_kinds[i]`` is ``"attention"``, ``"state"`` or None (a layer with no cache).
    """
    buckets: dict[str, list[int]] = {}
    for layer, kind in enumerate(layer_kinds):
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


def state_model_layouts(*, model: str, kind: str, tp_size: int,
                        layer_kinds: Sequence[str | None], states: tuple[StateTensor, ...],
                        attention: AttentionShape | None, block_size: int | None,
                        kernel_block_size: int | None) -> list[Layout]:
    """One Layout per KV-cache group of a model with recurrent state (pure or hybrid)."""
    groups = kv_cache_groups(layer_kinds)
    has_attention = any(group_kind == ATTENTION for group_kind, _ in groups)
    if not any(group_kind == STATE for group_kind, _ in groups):
        raise LayoutError("model has no recurrent-state layer; its values hold attention KV only")
    if has_attention:
        assert attention is not None, "hybrid model needs its attention shape"
        tokens = hybrid_block_size(page_bytes(states), attention.bytes_per_token, block_size)
        page = tokens * attention.bytes_per_token
        kernel = tokens if kernel_block_size is None else kernel_block_size
    else:
        tokens = kernel = 0  # no attention pages; a pure-state page is never padded
        page = page_bytes(states)
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
            if group_kind == ATTENTION:
                regions = attention_regions(attention, offset, tokens, kernel)
            else:
                regions = state_regions(states, offset, page)
            segments.append(Segment(index, layer_segment_name(layers[index]), layers[index], offset,
                                    page, regions))
        layouts.append(Layout(model, group, ATTENTION if group_kind == ATTENTION else kind,
                              tp_size, tuple(segments)))
    return layouts
