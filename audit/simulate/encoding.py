"""Per-layer float32 states -> the bytes of one Store value, in the layout's order and dtypes.

The layout decides everything: which segment holds which layer, where each named state region
sits and in which dtype. Nothing here knows an offset.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from audit.errors import AuditError
from audit.layouts import Layout

from .recurrence import LayerStates


def bfloat16_bits(values: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns, rounded to nearest even as torch does; NaN stays NaN."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
    nan = np.isnan(values)
    if nan.any():  # rounding could carry a NaN's payload into the exponent (Inf): keep it quiet NaN
        rounded[nan] = ((bits[nan] >> 16) | np.uint32(0x0040)).astype(np.uint16)
    return rounded


def encode(values: np.ndarray, dtype: str) -> np.ndarray:
    """The little-endian bytes of ``values`` stored as ``dtype`` (a layout dtype name)."""
    if dtype == "bfloat16":
        data = bfloat16_bits(values)
    elif dtype == "float16":
        data = values.astype("<f2")
    elif dtype == "float32":
        data = values.astype("<f4")
    else:
        raise AuditError(f"the simulator cannot write {dtype} states")
    return np.ascontiguousarray(data).reshape(-1).view(np.uint8)


def state_dtypes(layout: Layout) -> dict[str, str]:
    """Region name -> dtype of the state regions (the same in every segment of a pure model)."""
    return {region.name: region.dtype for region in layout.segments[0].regions if region.kind == "state"}


def encode_value(layout: Layout, layers: Sequence[LayerStates]) -> np.ndarray:
    """The value vLLM would publish: per segment, each state region filled from the layer's state
    of the same name; padding stays zero, as in a ``torch.zeros`` cache."""
    value = np.zeros(layout.size, np.uint8)
    for segment, region in layout.regions():
        if region.kind != "state":
            continue
        state = layers[segment.layer][region.name]
        if state.shape != region.shape:
            raise AuditError(f"{segment.name}.{region.name}: simulated state has shape {state.shape}, "
                             f"the layout says {region.shape}")
        value[region.offset:region.offset + region.length] = encode(state, region.dtype)
    return value


def random_states(layout: Layout, rng: np.random.Generator, scale: float = 0.5) -> list[LayerStates]:
    """Non-zero states of the layout's shapes, one entry per layer (garbage in a block)."""
    layers: dict[int, LayerStates] = {}
    for segment, region in layout.regions():
        if region.kind == "state":
            values = rng.standard_normal(region.shape, dtype=np.float32) * np.float32(scale)
            layers.setdefault(segment.layer, {})[region.name] = values
    return [layers[layer] for layer in sorted(layers)]
