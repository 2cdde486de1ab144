"""The regions of one page (one layer's block) at a given offset in the value."""

from __future__ import annotations

from dataclasses import dataclass

from .model import DTYPE_SIZES, LayoutError, Region
from .states import StateTensor, page_bytes


@dataclass(frozen=True, slots=True)
class AttentionShape:
    """One attention layer's KV cache on one TP rank (vLLM ``FullAttentionSpec``)."""

    num_kv_heads: int  # per rank: max(1, total_kv_heads // tp_size), as vLLM's get_num_kv_heads
    head_dim: int
    dtype: str

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token: vLLM's page size at block_size=1."""
        return 2 * self.num_kv_heads * self.head_dim * DTYPE_SIZES[self.dtype]


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


def attention_regions(attention: AttentionShape, offset: int, block_size: int,
                      kernel_block_size: int) -> tuple[Region, ...]:
    """K then V per kernel block: vLLM views a hybrid model's attention cache as
    ``(num_kernel_blocks, 2, kernel_block, heads, head_dim)``, so a page of ``block_size`` tokens
    is ``block_size / kernel_block_size`` repeats of ``[k | v]`` (one repeat when they are equal).
    Shapes assume the NHD order (tokens, heads, head_dim); HND backends hold the same bytes.
    """
    if block_size % kernel_block_size:
        raise LayoutError(f"attention kernel block size {kernel_block_size} does not divide "
                          f"block size {block_size}")
    shape = (kernel_block_size, attention.num_kv_heads, attention.head_dim)
    half = kernel_block_size * attention.bytes_per_token // 2
    regions = []
    position = offset
    for _ in range(block_size // kernel_block_size):
        for name in ("k", "v"):
            regions.append(Region(name, "kv", position, half, attention.dtype, shape))
            position += half
    return tuple(regions)


def unused_regions(offset: int, page_length: int) -> tuple[Region, ...]:
    """A slot no layer of this group owns: vLLM still reads it into the key, and it holds
    whatever the block's last owner (another group's layer) left there. Never a finding."""
    return (_raw("unused", offset, page_length),)
