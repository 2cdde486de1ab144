"""Word-replicated masks that let the kernel test every float element packed in a 64-bit word at
once (SWAR), instead of one shift-and-test per element: one fp8 word costs the same as one fp32 word.

For an element whose top bit is clear, ``(x + LOW) & TOP`` sets the element's top bit iff x != 0,
and the addition never carries into the next element. The masked exponent (or mantissa) of a
float never includes the sign bit, so it qualifies.
"""

from __future__ import annotations

import numpy as np

from audit.checks.floats import FLOAT_DTYPES

# The columns of `mask_table`, as the kernel reads them.
MASK_FIELDS = ("SPECIAL_MASK", "MANTISSA_MASK", "LOW_MASK", "TOP_BITS", "ONES", "ELEMENT_BITS")


def _replicate(element_value: int, element_bits: int) -> int:
    return sum(element_value << shift for shift in range(0, 64, element_bits))


def float_word_masks(dtype: str) -> dict[str, int]:
    """The masks for ``dtype``; ELEMENT_BITS 0 means "no NaN/Inf check"."""
    bits = FLOAT_DTYPES.get(dtype)
    if bits is None:
        return dict(ELEMENT_BITS=0, SPECIAL_MASK=0, MANTISSA_MASK=0, LOW_MASK=0, TOP_BITS=0, ONES=0)
    width = bits.itemsize * 8
    if bits.has_inf:  # special = exponent all ones; mantissa 0 -> Inf, else NaN
        special, mantissa = bits.exponent_mask, bits.mantissa_mask
    else:  # e4m3fn: NaN iff exponent and mantissa all ones; no Inf
        special, mantissa = bits.exponent_mask | bits.mantissa_mask, 0
    top = 1 << (width - 1)
    return dict(
        ELEMENT_BITS=width,
        SPECIAL_MASK=_replicate(special, width),
        MANTISSA_MASK=_replicate(mantissa, width),
        LOW_MASK=_replicate(top - 1, width),
        TOP_BITS=_replicate(top, width),
        ONES=_replicate(1, width),
    )


def mask_table(dtypes: tuple[str, ...], rows: int) -> np.ndarray:
    """The kernel's [rows, MASK_FIELDS] int64 masks: one row per dtype in `dtypes` (each a float
    dtype), then rows that count nothing (all masks 0 over 8-bit elements: nothing is special)."""
    table = np.zeros((rows, len(MASK_FIELDS)), np.uint64)
    table[:, MASK_FIELDS.index("ELEMENT_BITS")] = 8
    for row, dtype in enumerate(dtypes):
        masks = float_word_masks(dtype)
        table[row] = [masks[name] for name in MASK_FIELDS]
    return table.view(np.int64)
