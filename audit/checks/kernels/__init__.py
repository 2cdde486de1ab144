"""GPU (Triton) checks of fetched values: XXH3-64, all-zero flag and NaN/Inf counts in one read.

Importing this package compiles nothing, but decorates Triton kernels: set TRITON_INTERPRET=1
before importing it to run them on CPU tensors.
"""

from audit.checks.kernels.launcher import check_region_readings, check_regions, region_flags_across

__all__ = ["check_region_readings", "check_regions", "region_flags_across"]
