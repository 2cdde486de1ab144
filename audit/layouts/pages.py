"""The regions of one page (one layer's block) at a given offset in the value."""

from __future__ import annotations

from dataclasses import dataclass

from .model import DTYPE_SIZES, LayoutError, Region
from .states import StateTensor, page_bytes


@dataclass(frozen=True, slots=True)
class AttentionShape:
    """One attention layer's KV cache on one TP rank (vLLM ``FullAttentionSpec``, or
    ``MLAAttentionSpec``: one latent vector a token, ``vectors=1``)."""

    num_kv_heads: int  # per rank: max(1, total_kv_heads // tp_size), as vLLM's get_num_kv_heads
    head_dim: int
    dtype: str
    vectors: int = 2  # K and V; an MLA latent is one vector (kv_lora_rank + qk_rope_head_dim)

    @property
    def bytes_per_token(self) -> int:
        """K and V (or the latent) of one token: vLLM's page size at block_size=1."""
        return self.vectors * self.num_kv_heads * self.head_dim * DTYPE_SIZES[self.dtype]

    @property
    def latent(self) -> bool:
        """An MLA cache (vLLM's ``use_mla``)."""
        return self.vectors == 1


def _raw(name: str, offset: int, length: int) -> Region:
    return Region(name, "padding", offset, length, "raw", (length,))


def state_regions(states: tuple[StateTensor, ...], offset: int, page_length: int) -> tuple[Region, ...]:
    """``[conv | ssm | padding]``: states back to back, then zeros up to the (padded) page."""
    regions = []
    position = offset
    for state in states:
        regions.append(Region(state.name, "state", position, state.nbytes, state.dtype, state.shape))
        position += state.nbytes
    padding = page_length - page_bytes(states)
    if padding < 0:
        raise LayoutError(f"page of {page_length} bytes is smaller than its states "
                          f"({page_bytes(states)} bytes)")
    if padding:
        regions.append(_raw("padding", position, padding))
    return tuple(regions)


def attention_regions(attention: AttentionShape, offset: int, block_size: int) -> tuple[Region, ...]:
    """One ``kv`` region per page: vLLM 0.32.0 lays an attention page out as
    ``(heads, tokens, k|v)`` (``[L, B, H, N, C]`` with ``C = (head_size + head_size_v) * dtype``,
    ``vllm/v1/kv_cache_interface.py``), other backends as ``(tokens, heads, k|v)``, older
    releases as ``[k | v]`` halves or kernel-block repeats of them. Every order holds the same
    bytes in the same page, so the layer's K and V are checked together, one region per layer.
    An MLA page is ``(1, tokens, kv_lora_rank + qk_rope_head_dim)``: one latent a token.
    """
    shape = (attention.num_kv_heads, block_size, attention.vectors * attention.head_dim)
    length = block_size * attention.bytes_per_token
    return (Region("kv", "kv", offset, length, attention.dtype, shape),)


def unused_regions(offset: int, page_length: int) -> tuple[Region, ...]:
    """A slot no layer of this group owns: vLLM still reads it into the key, and it holds
    whatever the block's last owner (another group's layer) left there. Never a finding."""
    return (_raw("unused", offset, page_length),)
