"""Result types shared by the CPU and GPU checkers, so callers compare them without caring which ran."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RegionCheck:
    """What one pass over a region's bytes tells the auditor."""

    xxh3: int  # XXH3-64 (seed 0) of the region's bytes, as unsigned int
    zero: bool  # every byte is zero
    nan: int  # NaN elements (0 for non-float dtypes)
    inf: int  # Inf elements
