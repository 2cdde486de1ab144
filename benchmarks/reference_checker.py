"""The region checker as it was before the benchmark-driven optimisation (audit/checks/host.py at
commit cf1bf69), kept verbatim in behaviour: the benchmark times it beside the current one ("before"
and "after" in one run) and checks that both give identical results on the same bytes."""

from __future__ import annotations

import numpy as np
import xxhash

from audit.checks.floats import FLOAT_DTYPES
from audit.checks.host import ValueCheck
from audit.checks.types import RegionCheck

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32}
_ZEROS = bytes(1 << 20)
_zero_digests: dict[int, int] = {}


def zero_digest(length: int) -> int:
    if length not in _zero_digests:
        hasher = xxhash.xxh3_64()
        remaining = length
        while remaining:
            step = min(remaining, len(_ZEROS))
            hasher.update(memoryview(_ZEROS)[:step])
            remaining -= step
        _zero_digests[length] = hasher.intdigest()
    return _zero_digests[length]


def is_zero(data: np.ndarray, digest: int) -> bool:
    if digest != zero_digest(data.nbytes):
        return False
    words = data[: data.nbytes - data.nbytes % 8].view(np.uint64)
    return not words.any() and not data[words.nbytes:].any()


def count_nonfinite(data: np.ndarray, dtype: str) -> tuple[int, int]:
    bits = FLOAT_DTYPES.get(dtype)
    if bits is None:
        return 0, 0
    usable = data.nbytes - data.nbytes % bits.itemsize
    words = data[:usable].view(_UINT[bits.itemsize])
    if not bits.has_inf:
        full = bits.exponent_mask | bits.mantissa_mask
        return int(np.count_nonzero((words & full) == full)), 0
    special = (words & bits.exponent_mask) == bits.exponent_mask
    if not special.any():
        return 0, 0
    mantissa_zero = (words & bits.mantissa_mask) == 0
    inf = int(np.count_nonzero(special & mantissa_zero))
    return int(np.count_nonzero(special)) - inf, inf


def check_region(data: np.ndarray, dtype: str) -> RegionCheck:
    digest = xxhash.xxh3_64_intdigest(data)
    zero = is_zero(data, digest)
    nan, inf = (0, 0) if zero else count_nonfinite(data, dtype)
    return RegionCheck(xxh3=digest, zero=zero, nan=nan, inf=inf)


class ReferenceChecker:
    name = "reference"

    def check_values(self, buffer: np.ndarray, items) -> list[ValueCheck]:
        return [self.check_value(buffer[offset: offset + length], layout) for offset, length, layout in items]

    def check_value(self, data: np.ndarray, layout=None) -> ValueCheck:
        if layout is None:
            digest = xxhash.xxh3_64_intdigest(data)
            return ValueCheck(xxh3=digest, zero=is_zero(data, digest))
        whole = xxhash.xxh3_64()
        regions = []
        for _, region in layout.regions():
            view = data[region.offset: region.offset + region.length]
            whole.update(view)
            regions.append(check_region(view, region.dtype))
        digest = whole.intdigest()
        zero = digest == zero_digest(data.nbytes) and all(r.zero for r in regions)
        return ValueCheck(xxh3=digest, zero=zero, regions=tuple(regions))
