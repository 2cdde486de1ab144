"""Recurrent-state tensors of one layer on one TP rank, as vLLM sizes them.

Mirrors ``MambaStateShapeCalculator`` / ``MambaStateDtypeCalculator`` in vLLM's
``vllm/model_executor/layers/mamba/mamba_utils.py``: a page holds the states in this order
(conv first), each row-major, back to back. Speculative-decoding rows (``num_spec``) are not
modelled: they are 0 unless vLLM runs with a draft model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .model import DTYPE_SIZES, LayoutError

CONV_LAYOUTS = ("SD", "DS")


@dataclass(frozen=True, slots=True)
class StateTensor:
    """One state of one layer in one block: ``conv`` or ``ssm``."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_SIZES[self.dtype]


def page_bytes(states: tuple[StateTensor, ...]) -> int:
    """vLLM's unpadded ``MambaSpec.page_size_bytes``."""
    return sum(state.nbytes for state in states)


def _per_rank(total: int, tp_size: int, what: str) -> int:
    # vLLM's divide() asserts divisibility; say which field broke it.
    if total % tp_size:
        raise LayoutError(f"{what}={total} is not divisible by tp_size={tp_size}")
    return total // tp_size


def _conv(dim: int, state_len: int, dtype: str, conv_layout: str) -> StateTensor:
    # "SD": (state_len, dim), vLLM's default; "DS": (dim, state_len), VLLM_SSM_CONV_STATE_LAYOUT=DS.
    if conv_layout not in CONV_LAYOUTS:
        raise LayoutError(f"conv layout {conv_layout!r} is not one of {CONV_LAYOUTS}")
    shape = (state_len, dim) if conv_layout == "SD" else (dim, state_len)
    return StateTensor("conv", dtype, shape)


def mamba1_states(*, intermediate_size: int, state_size: int, conv_kernel: int, tp_size: int,
                  conv_dtype: str, ssm_dtype: str, conv_layout: str) -> tuple[StateTensor, ...]:
    inner = _per_rank(intermediate_size, tp_size, "intermediate_size")
    return (_conv(inner, conv_kernel - 1, conv_dtype, conv_layout),
            StateTensor("ssm", ssm_dtype, (inner, state_size)))


def extra_groups_for_head_shards(n_groups: int, tp_size: int) -> int:
    """Groups vLLM adds so every head shard carries its group (0 when n_groups % tp == 0)."""
    return 0 if n_groups % tp_size == 0 else tp_size - n_groups


def mamba2_states(*, intermediate_size: int, n_groups: int, num_heads: int, head_dim: int,
                  state_size: int, conv_kernel: int, tp_size: int, conv_dtype: str,
                  ssm_dtype: str, conv_layout: str) -> tuple[StateTensor, ...]:
    groups = n_groups + extra_groups_for_head_shards(n_groups, tp_size)
    conv_dim = _per_rank(intermediate_size + 2 * groups * state_size, tp_size,
                         "intermediate_size + 2*n_groups*state_size")
    heads = _per_rank(num_heads, tp_size, "num_heads")
    return (_conv(conv_dim, conv_kernel - 1, conv_dtype, conv_layout),
            StateTensor("ssm", ssm_dtype, (heads, head_dim, state_size)))


def gdn_states(*, num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int,
               conv_kernel: int, tp_size: int, conv_dtype: str, ssm_dtype: str,
               conv_layout: str) -> tuple[StateTensor, ...]:
    conv_dim = _per_rank(2 * num_k_heads * head_k_dim + num_v_heads * head_v_dim, tp_size,
                         "2*k_heads*k_dim + v_heads*v_dim")
    heads = _per_rank(num_v_heads, tp_size, "linear_num_value_heads")
    return (_conv(conv_dim, conv_kernel - 1, conv_dtype, conv_layout),
            StateTensor("ssm", ssm_dtype, (heads, head_v_dim, head_k_dim)))


def short_conv_states(*, conv_dim: int, conv_kernel: int, tp_size: int, conv_dtype: str,
                      conv_layout: str) -> tuple[StateTensor, ...]:
    dim = _per_rank(conv_dim, tp_size, "conv_dim")
    return (_conv(dim, conv_kernel - 1, conv_dtype, conv_layout),)


def linear_attention_states(*, num_heads: int, head_dim: int, tp_size: int,
                            dtype: str) -> tuple[StateTensor, ...]:
    """A lightning-style linear attention layer (Bailing MoE V2.5): one ``(heads, d, d)`` state,
    in ``--mamba-cache-dtype`` (else the model dtype); no conv state."""
    heads = _per_rank(num_heads, tp_size, "num_attention_heads")
    return (StateTensor("ssm", dtype, (heads, head_dim, head_dim)),)
