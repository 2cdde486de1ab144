"""Word-replicated masks that let the kernel test every float element packed in a 64-bit word at
once (SWAR), instead of one shift-and-test per element: one fp8 word costs the same as one fp32 word.

For an element whose top bit is clear, ``(x + LOW) & TOP`` sets the element's top bit iff x != 0,
and the addition never carries into the next element. The masked exponent (or mantissa) of a
float never includes the sign bit, so it qualifies.
"""

from __future__ import annotations

from audit.checks.floats import FLOAT_DTYPES


def _replicate(element_value: int, element_bits: int) -> int:
    return sum(element_value << shift for shift in range(0, 64, element_bits))


def float_word_masks(dtype: str) -> dict[str, int]:
    """Kernel constexprs for ``dtype``; ELEMENT_BITS 0 means "no NaN/Inf check"."""
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
