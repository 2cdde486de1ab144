"""The load guard's check: is a value a consumer just loaded fit for its model to read?

A consumer's value lands in its own KV cache, so the guard checks it where it lies, once per key,
between the load and the forward pass that reads it. The questions are the scan's (`checks.host`):
a recurrent state region all zero (vLLM #53084's null block), a value all zero, a NaN or Inf in a
float region. None needs a digest, so none is computed: a region's first bytes settle "not zero"
for every live state, and only a region that starts with zeros is read whole for the zero test.
The NaN/Inf test of a float32 region is one BLAS dot product of the region with itself: finite
exactly when no element is NaN or Inf and the squares do not overflow, so a finite answer clears the
region at memory speed, and only a non-finite one is settled by `floats.Screen` (two max reductions,
exact). Other float dtypes go to the screen directly. On a GPU the same answers come
from the Triton region kernel (`device_region_flags`, then `combine`).

A region is ``(offset, length, dtype, state)`` within its segment: ``dtype`` None where the
consumer does not know it (no NaN/Inf test), ``state`` True for a recurrent-state region (an
all-zero one is refused) and False for KV or padding (zero is refused only when the whole value is).
"""

from __future__ import annotations

import math
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


_ZERO_PROBE = bytes(PROBE_BYTES)


def _zero(data: np.ndarray) -> bool:
    if data[:PROBE_BYTES].tobytes() != _ZERO_PROBE[: min(PROBE_BYTES, data.nbytes)]:
        return False
    whole = data.nbytes - data.nbytes % 8
    return not data[:whole].view(np.uint64).any() and not data[whole:].any()


def _nonfinite(data: np.ndarray, dtype: str) -> bool:
    screen = SCREENS.get(dtype)
    if screen is None:
        return False
    if dtype == "float32":
        words = data[: data.nbytes - data.nbytes % 4].view(np.float32)
        if math.isfinite(np.dot(words, words)):
            return False
    return screen.any(data)


def float_runs(regions: Sequence[LoadedRegion]) -> tuple[tuple[int, int, str], ...]:
    """Adjacent regions of one float dtype merged: one NaN/Inf test covers a page's conv and ssm
    states when they share a dtype (zero is still tested region by region)."""
    runs: list[list] = []
    for offset, length, dtype, _ in sorted(regions):
        if dtype not in SCREENS:
            continue
        if runs and runs[-1][2] == dtype and runs[-1][0] + runs[-1][1] == offset:
            runs[-1][1] += length
        else:
            runs.append([offset, length, dtype])
    return tuple((offset, length, dtype) for offset, length, dtype in runs)


_runs_of: dict[int, tuple[Sequence[LoadedRegion], tuple]] = {}  # id of a region list: (the list, its runs)


def _cached_runs(regions: Sequence[LoadedRegion]) -> tuple:
    entry = _runs_of.get(id(regions))
    if entry is None or entry[0] is not regions:  # held, so an id is never another list's
        if len(_runs_of) > 4096:
            _runs_of.clear()
        entry = _runs_of[id(regions)] = (regions, float_runs(regions))
    return entry[1]


def refusal(segments: Sequence[np.ndarray], regions: Sequence[Sequence[LoadedRegion]] | None) -> str | None:
    """Why the value made of `segments` (uint8 views, one per segment, in key order) must not be
    read, or None when it may be. `regions[j]` describes segment j; None (or an empty entry): the
    segment is one region of unknown dtype, held to be state (the #53084 test without a layout)."""
    all_zero = True
    state_zero = False
    for index, segment in enumerate(segments):
        described = regions[index] if regions is not None and index < len(regions) else None
        if not described:
            if _zero(segment):
                state_zero = True
            else:
                all_zero = False
            continue
        for offset, length, _, state in described:
            data = segment[offset: offset + length]
            if not data.nbytes:
                continue
            if _zero(data):
                state_zero |= state
            else:
                all_zero = False
        for offset, length, dtype in _cached_runs(described):
            if _nonfinite(segment[offset: offset + length], dtype):
                return NONFINITE
    if all_zero:
        return ZERO_VALUE
    return ZERO_STATE if state_zero else None


def device_region_flags(views, slots: Sequence[int], offsets: Sequence[int], lengths: Sequence[int],
                        dtypes: Sequence[str | None]) -> tuple[np.ndarray, np.ndarray]:
    """(all zero, holds NaN/Inf), as bool arrays, of each region ``views[slot][offset:offset+length]``
    of the CUDA uint8 tensors `views` (a KV cache's storages), in one launch per dtype of the Triton
    region kernel for all of them (`checks.kernels.region_flags_across`, bit-identical to the host
    checks)."""
    from audit.checks.kernels import region_flags_across

    return region_flags_across(views, slots, offsets, lengths, [d or "uint8" for d in dtypes])


def combine(zero: np.ndarray, nonfinite: np.ndarray, states: np.ndarray, value_of: np.ndarray,
            values: int) -> list[str | None]:
    """`refusal`'s answer for each of `values` values from its regions' flags (region i of value
    ``value_of[i]``, all zero where ``zero[i]``, holding NaN/Inf where ``nonfinite[i]``, a state
    region where ``states[i]``), counted per value at once."""
    zero, nonfinite, states = (np.asarray(a, dtype=bool) for a in (zero, nonfinite, states))
    value_of = np.asarray(value_of, dtype=np.int64)
    live = np.bincount(value_of, weights=~zero, minlength=values) > 0
    state_zero = np.bincount(value_of, weights=zero & states, minlength=values) > 0
    bad = np.bincount(value_of, weights=~zero & nonfinite, minlength=values) > 0
    return [NONFINITE if bad[v] else ZERO_VALUE if not live[v] else ZERO_STATE if state_zero[v] else None
            for v in range(values)]
