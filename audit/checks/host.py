"""The reference checker: numpy + xxhash over host memory.

With a layout, every region of the value is checked (digest, zero flag, NaN/Inf for float
dtypes) while its bytes are hot in cache, and the whole-value digest is streamed from the same
regions, so the value is read from memory once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import xxhash

from audit.checks.floats import count_nonfinite
from audit.checks.types import RegionCheck
from audit.checks.zero import is_zero, zero_digest


@dataclass(frozen=True, slots=True)
class ValueCheck:
    xxh3: int
    zero: bool
    regions: tuple[RegionCheck, ...] | None = None  # in layout order, when a layout applied


def check_region(data: np.ndarray, dtype: str) -> RegionCheck:
    digest = xxhash.xxh3_64_intdigest(data)
    zero = is_zero(data, digest)
    nan, inf = (0, 0) if zero else count_nonfinite(data, dtype)
    return RegionCheck(xxh3=digest, zero=zero, nan=nan, inf=inf)


class HostChecker:
    name = "numpy"

    def check_values(self, buffer: np.ndarray, items) -> list[ValueCheck]:
        """`items`: (offset, length, layout or None) per value in `buffer`."""
        return [self.check_value(buffer[offset: offset + length], layout) for offset, length, layout in items]

    def check_value(self, data: np.ndarray, layout=None) -> ValueCheck:
        """`layout`: a `audit.layouts.Layout` whose size equals the value's, or None (opaque)."""
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
