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


_BANDED = ("bfloat16", "float16")  # dtypes whose plausible numbers are one band of magnitudes


@lru_cache(maxsize=None)
def _sane_band(dtype: str) -> tuple[int, int] | None:
    """(lo, hi) where `region_plausibility`'s tables of a 2-byte dtype say exactly: a pattern is a
    non-zero number when its magnitude bits (sign dropped) are not 0, and an implausible one when
    they lie outside lo..hi (float magnitudes order like their bit patterns); None where the
    tables are not of that form (then the histogram decides, as `region_plausibility` does)."""
    nonzero, implausible = _pattern_tables(dtype)
    patterns = np.arange(1 << 16, dtype=np.uint32)
    magnitude = patterns & 0x7FFF
    sane = np.flatnonzero((nonzero != 0) & (implausible == 0) & (patterns <= 0x7FFF))
    if not sane.size:
        return None
    lo, hi = int(sane[0]), int(sane[-1])
    outside = (magnitude != 0) & ((magnitude < lo) | (magnitude > hi))
    if not (np.array_equal(nonzero, (magnitude != 0).astype(nonzero.dtype))
            and np.array_equal(implausible, outside.astype(implausible.dtype))):
        return None
    return lo, hi


class _Region:
    """One region's 16-bit words, their magnitude bits and how many are non-zero, computed once for
    every 2-byte dtype a reading reads it as."""

    __slots__ = ("size", "delta", "magnitude", "nonzero", "weight")

    def __init__(self, data: np.ndarray):
        words = data[: data.nbytes - data.nbytes % 2].view(np.uint16)
        self.size = words.size
        self.magnitude = np.bitwise_and(words, np.uint16(0x7FFF))
        self.nonzero = int(np.count_nonzero(self.magnitude))
        self.weight = data.nbytes // max(data.nbytes // 2, 1)  # as region_plausibility weighs them
        self.delta = None

    def plausibility(self, lo: int, hi: int) -> Plausibility:
        """Non-zero numbers, and those of magnitude outside lo..hi: one pass (unsigned wrap-around;
        lo 1, float16's, needs none: only magnitudes above hi are out)."""
        if lo == 1:
            outside = int(np.count_nonzero(self.magnitude > np.uint16(hi)))
        else:
            shifted = np.subtract(self.magnitude, np.uint16(lo), out=self.delta, dtype=np.uint16)
            self.delta = shifted
            outside = int(np.count_nonzero(shifted > np.uint16(hi - lo))) - (self.size - self.nonzero)
        return Plausibility(self.nonzero * self.weight, outside * self.weight)


def readings_plausibility(data: np.ndarray, layouts) -> list[Plausibility]:
    """A whole value (uint8, the layouts' size) read each of `layouts`' ways, with the counts of
    `region_plausibility` region by region: a region that several readings cut and type alike
    (bfloat16 against float16 readings share their padding, and each dtype's regions) is judged once
    for all of them; a bfloat16 or float16 region is counted from its words' magnitudes against the
    dtype's sane band (a few passes over the words, shared by both dtypes), not from a 65,536-bin
    histogram of them (3.5 ms a value: a fifth of a second of choosing readings)."""
    seen: dict[tuple, Plausibility] = {}
    words: dict[tuple, _Region] = {}
    histograms: dict[tuple, np.ndarray] = {}
    totals = []
    for layout in layouts:
        total = Plausibility()
        for _, region in layout.regions():
            key = (region.offset, region.length, region.kind, region.dtype)
            if key not in seen:
                part = data[region.offset: region.offset + region.length]
                band = _sane_band(region.dtype) if region.kind != "padding" and region.dtype in _BANDED else None
                if band is None:
                    seen[key] = region_plausibility(part, region.kind, region.dtype, histograms)
                else:
                    place = (region.offset, region.length)
                    if place not in words:
                        words[place] = _Region(part)
                    seen[key] = words[place].plausibility(*band)
            total += seen[key]
        totals.append(total)
    return totals
