"""How plausible one reading of a value's bytes is, for choosing among readings a size allows.

Float32 bytes read as bfloat16 put each word's low half, mantissa noise, where a number's sign and
exponent should be: NaN/Inf patterns and exponents far outside anything a KV cache or a recurrent
state holds. Float16 read as bfloat16 turns small numbers into 1e-19. A reading that moves a
boundary finds non-zero bytes where its padding should be zero. The right reading decodes to
finite numbers of sane magnitude and zero padding, so the share of non-zero bytes that decode
implausibly tells readings apart.

The converse, 16-bit numbers read two to a float32 word, decodes to sane float32 numbers (the high
half sets the exponent), but then each word's low half is itself a sane 16-bit number, which a
float32's low mantissa bits are only by chance (`PAIR_CHANCE`). Words beyond that chance count as
implausible.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from audit.checks.floats import decode_floats

SANE_MAGNITUDE = (2.0 ** -40, 2.0 ** 40)  # far wider than any activation, KV or state value
# The share of uniformly random 16-bit patterns that are zero or a sane bfloat16 (exponent field
# 87..167 of 0..255): how often a genuine float32's low half looks like a number by chance.
PAIR_CHANCE = 81 / 256


@dataclass(frozen=True, slots=True)
class Plausibility:
    """Bytes of non-zero elements examined, and how many of them decode implausibly."""

    examined: int = 0
    implausible: int = 0

    def __add__(self, other: Plausibility) -> Plausibility:
        return Plausibility(self.examined + other.examined, self.implausible + other.implausible)

    @property
    def score(self) -> float | None:
        """The plausible share of the examined bytes; None when nothing non-zero was examined."""
        return None if not self.examined else 1.0 - self.implausible / self.examined


def _sane(values: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore", over="ignore"):
        magnitude = np.abs(values)
        return (magnitude >= SANE_MAGNITUDE[0]) & (magnitude <= SANE_MAGNITUDE[1])


def _pairs_beyond_chance(words: np.ndarray) -> int:
    """Float32 words whose low half is zero or a sane bfloat16, beyond what chance gives (its
    mean plus four standard deviations: a genuine float32 region scores no excess)."""
    low = (words.view(np.uint32) << 16).view(np.float32)
    pair_like = int(np.count_nonzero((low == 0) | _sane(low)))
    chance = words.size * PAIR_CHANCE + 4 * math.sqrt(words.size * PAIR_CHANCE * (1 - PAIR_CHANCE))
    return max(0, pair_like - int(chance))


def region_plausibility(data: np.ndarray, kind: str, dtype: str) -> Plausibility:
    """One region's bytes (uint8) read as `dtype`: padding must be zero, numbers sane."""
    if kind == "padding":
        nonzero = int(np.count_nonzero(data))
        return Plausibility(nonzero, nonzero)
    values = decode_floats(data, dtype)
    if values is None:  # raw bytes: only the readings' other regions tell them apart
        return Plausibility()
    width = data.nbytes // max(values.size, 1)
    nonzero = values[values != 0]
    implausible = nonzero.size - int(np.count_nonzero(_sane(nonzero)))
    if dtype == "float32":
        implausible = max(implausible, _pairs_beyond_chance(nonzero))
    return Plausibility(nonzero.size * width, implausible * width)


def value_plausibility(data: np.ndarray, layout) -> Plausibility:
    """A whole value (uint8, the layout's size) read the layout's way."""
    total = Plausibility()
    for _, region in layout.regions():
        total += region_plausibility(data[region.offset: region.offset + region.length], region.kind, region.dtype)
    return total
