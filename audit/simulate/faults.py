"""Damage and edge cases applied to good states, so an auditor's every rule has a labelled case.

Faults (must be flagged): a NaN in one ssm element, zeroed layers (some, never all), a value cut
short. Tricky good states (must NOT be flagged): legitimate values a careless check mistakes for
damage. Each function returns new states and a one-line ``detail`` for the label.
"""

from __future__ import annotations

import numpy as np

from audit.errors import AuditError

from .recurrence import LayerStates

TRUNCATED_BYTES = 4096  # cut from the end of a truncated value
MAX_ZEROED_LAYERS = 3
TRICKY_VARIANTS = ("zero_row", "many_zeros", "tiny_values")

# Tiny but normal magnitudes per dtype: float32 ~1e-30; bf16/fp16 their smallest normals.
_TINY = {"float32": 1e-30, "bfloat16": 2.0 ** -126, "float16": 2.0 ** -14}


def _copy(layers: list[LayerStates]) -> list[LayerStates]:
    return [{name: state.copy() for name, state in states.items()} for states in layers]


def with_nan(layers: list[LayerStates], rng: np.random.Generator) -> tuple[list[LayerStates], str]:
    """One ssm element of one layer becomes NaN (e.g. an overflowing kernel)."""
    out = _copy(layers)
    layer = int(rng.integers(len(out)))
    flat = out[layer]["ssm"].reshape(-1)
    element = int(rng.integers(flat.size))
    flat[element] = np.nan
    return out, f"NaN at layers.{layer} ssm element {element}"


def with_zeroed_layers(layers: list[LayerStates], rng: np.random.Generator) -> tuple[list[LayerStates], str]:
    """Every state of one to three layers, never all of them, is zero (a partial write)."""
    if len(layers) < 2:
        raise AuditError("zero_layers needs a model with at least 2 layers")
    count = int(rng.integers(1, min(MAX_ZEROED_LAYERS, len(layers) - 1) + 1))
    chosen = sorted(int(layer) for layer in rng.choice(len(layers), size=count, replace=False))
    out = _copy(layers)
    for layer in chosen:
        for state in out[layer].values():
            state[...] = 0
    return out, "zeroed layers " + ",".join(map(str, chosen))


def truncated(value: np.ndarray) -> np.ndarray:
    """The value without its last ``TRUNCATED_BYTES`` (a short write)."""
    if value.size <= TRUNCATED_BYTES:
        raise AuditError(f"values of {value.size} bytes are too small to truncate by {TRUNCATED_BYTES}")
    return value[:-TRUNCATED_BYTES]


def tricky(layers: list[LayerStates], variant: str, dtypes: dict[str, str],
           rng: np.random.Generator) -> tuple[list[LayerStates], str]:
    """A good state that looks suspicious: ``zero_row`` (one all-zero ssm row per layer),
    ``many_zeros`` (every other ssm element exactly 0), ``tiny_values`` (every state element
    non-zero but tiny: ~1e-30 in float32, the smallest normals in bf16/fp16)."""
    out = _copy(layers)
    if variant == "zero_row":
        for states in out:
            rows = states["ssm"].reshape(-1, states["ssm"].shape[-1])
            rows[int(rng.integers(len(rows)))] = 0
        return out, "one all-zero ssm row per layer"
    if variant == "many_zeros":
        for states in out:
            states["ssm"].reshape(-1)[::2] = 0
        return out, "half of every ssm element exactly zero"
    if variant == "tiny_values":
        for states in out:
            for name, state in states.items():
                signs = np.where(rng.random(state.shape) < 0.5, -1, 1)
                state[...] = signs * _TINY[dtypes[name]] * (1 + rng.random(state.shape))
        return out, "every state element tiny: " + ", ".join(
            f"{name} {dtype} ~{_TINY[dtype]:.1e}" for name, dtype in dtypes.items())
    raise AuditError(f"unknown tricky variant {variant!r} (known: {', '.join(TRICKY_VARIANTS)})")
