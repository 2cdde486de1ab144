"""The load guard's check: is a value a consumer just loaded fit for its model to read?

A consumer's value lands in its own KV cache, so the guard checks it where it lies, once per key,
between the load and the forward pass that reads it. The questions are the scan's (`checks.host`):
a recurrent state region all zero (vLLM #53084's null block), a value all zero, a NaN or Inf in a
float region. None needs a digest, so none is computed: a region's first bytes settle "not zero"
for every live state, and only a region that starts with zeros is read whole for the zero test.
The NaN/Inf screen is `floats.Screen` (two max reductions, exact). On a GPU the same answers come
from the Triton region kernel (`device_region_flags`, then `combine`).

A region is ``(offset, length, dtype, state)`` within its segment: ``dtype`` None where the
consumer does not know it (no NaN/Inf test), ``state`` True for a recurrent-state region (an
all-zero one is refused) and False for KV or padding (zero is refused only when the whole value is).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from audit.checks.floats import SCREENS

ZERO_STATE = "ZERO_STATE"    # a recurrent-state region is all zero (vLLM's null block)
ZERO_VALUE = "ZERO_VALUE"    # every byte of the value is zero
NONFINITE = "NONFINITE"      # a float region holds NaN or Inf

PROBE_BYTES = 64  # a live state's first bytes are non-zero: the rest need not be read for "not zero"


class LoadedRegion(NamedTuple):
    offset: int
    length: int
    dtype: str | None
    state: bool


def _zero(data: np.ndarray) -> bool:
    if data[:PROBE_BYTES].any():
        return False
    whole = data.nbytes - data.nbytes % 8
    return not data[:whole].view(np.uint64).any() and not data[whole:].any()


def refusal(segments: Sequence[np.ndarray], regions: Sequence[Sequence[LoadedRegion]] | None) -> str | None:
    """Why the value made of `segments` (uint8 views, one per segment, in key order) must not be
    read, or None when it may be. `regions[j]` describes segment j; None (or an empty entry): the
    segment is one region of unknown dtype, held to be state (the #53084 test without a layout)."""
    all_zero = True
    state_zero = False
    for index, segment in enumerate(segments):
        described = regions[index] if regions is not None and index < len(regions) else None
        for offset, length, dtype, state in described or ((0, segment.nbytes, None, True),):
            data = segment[offset: offset + length]
            if not data.nbytes:
                continue
            zero = _zero(data)
            if zero:
                state_zero |= state
                continue
            all_zero = False
            screen = SCREENS.get(dtype) if dtype else None
            if screen is not None and screen.any(data):
                return NONFINITE
    if all_zero:
        return ZERO_VALUE
    return ZERO_STATE if state_zero else None


def device_region_flags(buffer, offsets: Sequence[int], lengths: Sequence[int],
                        dtypes: Sequence[str | None]) -> list[tuple[bool, bool]]:
    """(all zero, holds NaN/Inf) of each region ``buffer[offset:offset+length]`` of the CUDA uint8
    tensor `buffer`, in one launch per dtype of the Triton region kernel
    (`checks.kernels.check_regions`, bit-identical to the host checks)."""
    from audit.checks.kernels import check_regions

    results = check_regions(buffer, offsets, lengths, [d or "uint8" for d in dtypes])
    return [(result.zero, bool(result.nan or result.inf)) for result in results]


def combine(flags: Sequence[tuple[bool, bool]], states: Sequence[bool], value_of: Sequence[int],
            values: int) -> list[str | None]:
    """`refusal`'s answer for each of `values` values from its regions' flags (region i of value
    ``value_of[i]``, a state region where ``states[i]``)."""
    all_zero = [True] * values
    state_zero = [False] * values
    nonfinite = [False] * values
    for (zero, bad), state, value in zip(flags, states, value_of):
        if zero:
            state_zero[value] |= state
        else:
            all_zero[value] = False
            nonfinite[value] |= bad
    return [NONFINITE if nonfinite[v] else ZERO_VALUE if all_zero[v] else ZERO_STATE if state_zero[v] else None
            for v in range(values)]
