"""NaN / Inf counting by bit pattern, so every float dtype vLLM stores (bf16 and fp8 included,
which numpy cannot represent) is judged the same way by the CPU and GPU checkers."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class FloatBits:
    """Where exponent and mantissa sit in one element of a float dtype."""

    itemsize: int
    exponent_mask: int
    mantissa_mask: int
    has_inf: bool  # float8 e4m3fn has no Inf; its only NaN is S.1111.111


FLOAT_DTYPES: dict[str, FloatBits] = {
    "float32": FloatBits(4, 0x7F800000, 0x007FFFFF, True),
    "float16": FloatBits(2, 0x7C00, 0x03FF, True),
    "bfloat16": FloatBits(2, 0x7F80, 0x007F, True),
    "float8_e5m2": FloatBits(1, 0x7C, 0x03, True),
    "float8_e4m3fn": FloatBits(1, 0x78, 0x07, False),
}

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32}


_INT = {1: np.int8, 2: np.int16, 4: np.int32}


@dataclass(frozen=True)
class Screen:
    """An exact any-NaN/Inf test in two max reductions, no temporaries: an element is NaN or Inf
    exactly when its bits without the sign are >= ``threshold`` (exponent all ones; for e4m3fn,
    exponent and mantissa all ones). The unsigned max catches negative ones (>= sign|threshold),
    the signed max positive ones (>= threshold)."""

    itemsize: int
    unsigned: type
    signed: type
    unsigned_min: int
    signed_min: int

    def fires(self, maxima: tuple[int, int]) -> bool:
        """`any` from the bytes' `element_maxima`."""
        return maxima[0] >= self.unsigned_min or maxima[1] >= self.signed_min

    def any(self, data: np.ndarray) -> bool:
        """Whether the bytes hold a NaN or Inf (trailing bytes that do not fill an element are
        ignored, as `count_nonfinite` ignores them). `fires_any` is this test for several dtypes."""
        if data.nbytes % self.itemsize:
            data = data[: data.nbytes - data.nbytes % self.itemsize]
        words = data.view(self.unsigned)
        if not words.size:
            return False
        return bool(_max(words) >= self.unsigned_min or _max(words.view(self.signed)) >= self.signed_min)


_max = np.maximum.reduce


def fires_any(data: np.ndarray, screens: tuple[Screen, ...]) -> bool:
    """Whether the bytes hold a NaN or Inf under any of `screens`, dtypes of one width: float16 and
    bfloat16 words have the same two maxima and differ only in their thresholds, so the bytes are
    reduced once (and the signed maximum only when no unsigned one fires) for all of them."""
    first = screens[0]
    if data.nbytes % first.itemsize:
        data = data[: data.nbytes - data.nbytes % first.itemsize]
    words = data.view(first.unsigned)
    if not words.size:
        return False
    top = _max(words)
    if any(top >= screen.unsigned_min for screen in screens):
        return True
    top = _max(words.view(first.signed))
    return any(top >= screen.signed_min for screen in screens)


_NO_ELEMENTS = (-1, -(1 << 63))  # no element: nothing fires


def element_maxima(data: np.ndarray, itemsize: int) -> tuple[int, int]:
    """The unsigned and signed maxima of the bytes' ``itemsize``-byte elements (trailing bytes that
    do not fill one ignored): `Screen.fires` of every dtype of that width from one reduction each."""
    if data.nbytes % itemsize:
        data = data[: data.nbytes - data.nbytes % itemsize]
    words = data.view(_UINT[itemsize])
    if not words.size:
        return _NO_ELEMENTS
    return int(_max(words)), int(_max(words.view(_INT[itemsize])))


def _screen(bits: FloatBits) -> Screen:
    threshold = bits.exponent_mask if bits.has_inf else bits.exponent_mask | bits.mantissa_mask
    sign = 1 << (8 * bits.itemsize - 1)
    return Screen(bits.itemsize, _UINT[bits.itemsize], _INT[bits.itemsize], sign | threshold, threshold)


SCREENS: dict[str, Screen] = {name: _screen(bits) for name, bits in FLOAT_DTYPES.items()}


def count_nonfinite(data: np.ndarray, dtype: str) -> tuple[int, int]:
    """(NaN count, Inf count) of the bytes in ``data`` read as ``dtype``; (0, 0) for non-floats.

    Trailing bytes that do not fill a whole element are ignored.
    """
    bits = FLOAT_DTYPES.get(dtype)
    if bits is None:
        return 0, 0
    usable = data.nbytes - data.nbytes % bits.itemsize
    words = data[:usable].view(_UINT[bits.itemsize])
    if not bits.has_inf:  # e4m3fn: NaN is exactly exponent and mantissa all ones
        full = bits.exponent_mask | bits.mantissa_mask
        return int(np.count_nonzero((words & full) == full)), 0
    special = (words & bits.exponent_mask) == bits.exponent_mask
    if not special.any():
        return 0, 0
    mantissa_zero = (words & bits.mantissa_mask) == 0
    inf = int(np.count_nonzero(special & mantissa_zero))
    return int(np.count_nonzero(special)) - inf, inf


def _e4m3fn_table() -> np.ndarray:
    table = np.empty(256, dtype=np.float32)
    for byte in range(256):
        sign = -1.0 if byte & 0x80 else 1.0
        exponent, mantissa = (byte >> 3) & 0xF, byte & 0x7
        if exponent == 0xF and mantissa == 0x7:
            table[byte] = np.nan
        elif exponent == 0:
            table[byte] = sign * mantissa / 8 * 2.0 ** -6
        else:
            table[byte] = sign * (1 + mantissa / 8) * 2.0 ** (exponent - 7)
    return table


_E4M3FN = _e4m3fn_table()


def decode_floats(data: np.ndarray, dtype: str) -> np.ndarray | None:
    """The bytes as float32 values (for statistics in `explain`); None for non-float dtypes."""
    bits = FLOAT_DTYPES.get(dtype)
    if bits is None:
        return None
    usable = data[: data.nbytes - data.nbytes % bits.itemsize]
    if dtype == "float32":
        return usable.view(np.float32)
    if dtype == "float16":
        return usable.view(np.float16).astype(np.float32)
    if dtype == "bfloat16":
        return (usable.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    if dtype == "float8_e5m2":
        return (usable.astype(np.uint16) << 8).view(np.float16).astype(np.float32)
    return _E4M3FN[usable]
