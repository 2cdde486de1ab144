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
from functools import lru_cache

import numpy as np

from audit.checks.floats import FLOAT_DTYPES, decode_floats

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


def region_plausibility(data: np.ndarray, kind: str, dtype: str, histograms: dict | None = None) -> Plausibility:
    """One region's bytes (uint8) read as `dtype`: padding must be zero, numbers sane. A 1- or
    2-byte float dtype is judged from the histogram of the region's bit patterns (`histograms`:
    (width, bytes) -> its histogram, for dtypes of one width to share): the same counts as
    decoding every number, in one pass over the bytes."""
    if kind == "padding":
        nonzero = int(np.count_nonzero(data))
        return Plausibility(nonzero, nonzero)
    if dtype in _PATTERN_WIDTHS:
        width = _PATTERN_WIDTHS[dtype]
        key = (width, data.ctypes.data, data.nbytes)
        histogram = None if histograms is None else histograms.get(key)
        if histogram is None:
            words = data[: data.nbytes - data.nbytes % width].view(_WORDS[width])
            histogram = np.bincount(words, minlength=1 << (8 * width))
            if histograms is not None:
                histograms[key] = histogram
        nonzero, implausible = _pattern_tables(dtype)
        weight = data.nbytes // max(data.nbytes // width, 1)  # bytes per number, a trailing part included
        return Plausibility(int(histogram @ nonzero) * weight, int(histogram @ implausible) * weight)
    values = decode_floats(data, dtype)
    if values is None:  # raw bytes: only the readings' other regions tell them apart
        return Plausibility()
    width = data.nbytes // max(values.size, 1)
    nonzero = values[values != 0]
    implausible = nonzero.size - int(np.count_nonzero(_sane(nonzero)))
    if dtype == "float32":
        implausible = max(implausible, _pairs_beyond_chance(nonzero))
    return Plausibility(nonzero.size * width, implausible * width)


_PATTERN_WIDTHS = {name: bits.itemsize for name, bits in FLOAT_DTYPES.items() if bits.itemsize <= 2}
_WORDS = {1: np.uint8, 2: np.uint16}


@lru_cache(maxsize=None)
def _pattern_tables(dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """Per bit pattern of a 1- or 2-byte float dtype, decoded as `region_plausibility` decodes
    numbers: 1 where it is a non-zero number, and where it is non-zero but implausible."""
    width = _PATTERN_WIDTHS[dtype]
    values = decode_floats(np.arange(1 << (8 * width), dtype=_WORDS[width]).view(np.uint8), dtype)
    nonzero = values != 0
    return nonzero.astype(np.int64), (nonzero & ~_sane(values)).astype(np.int64)


def readings_plausibility(data: np.ndarray, layouts) -> list[Plausibility]:
    """A whole value (uint8, the layouts' size) read each of `layouts`' ways: a region that several
    readings cut and type alike (bfloat16 against float16 readings share their padding, and each
    dtype's regions) is judged once for all of them, and its bit patterns counted once per width."""
    seen: dict[tuple, Plausibility] = {}
    histograms: dict[tuple, np.ndarray] = {}
    totals = []
    for layout in layouts:
        total = Plausibility()
        for _, region in layout.regions():
            key = (region.offset, region.length, region.kind, region.dtype)
            if key not in seen:
                seen[key] = region_plausibility(data[region.offset: region.offset + region.length], region.kind,
                                                region.dtype, histograms)
            total += seen[key]
        totals.append(total)
    return totals
