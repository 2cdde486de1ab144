"""The GPU checker: every region of a whole batch in one Triton launch per float dtype.

Results are bit-identical to `HostChecker` (same XXH3-64, zero flags and NaN/Inf counts), so a
report does not depend on which checker wrote it. On a host without a GPU the kernel runs under
the Triton interpreter: correct, and about a megabyte per second, for verification only.
"""

from __future__ import annotations

import os
import sys

import numpy as np

from audit.checks.host import ValueCheck
from audit.checks.zero import zero_digest
from audit.errors import AuditError


def _region_count(layout) -> int:
    return sum(len(segment.regions) for segment in layout.segments)


class TritonChecker:
    name = "triton"

    def __init__(self, device: str):
        if device == "cpu":
            if "audit.checks.kernels" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
                raise AuditError("--checker triton on --device cpu needs the Triton interpreter, and this process "
                                 "already compiled its kernels for the GPU")
            os.environ["TRITON_INTERPRET"] = "1"  # read when the kernel module is imported
        import torch

        from audit.checks.kernels import check_regions

        self._torch = torch
        self._check_regions = check_regions

    def _tensor(self, buffer):
        return self._torch.from_numpy(buffer) if isinstance(buffer, np.ndarray) else buffer

    def check_values(self, buffer, items) -> list[ValueCheck]:
        """`items`: (offset, length, layout or None) per value in `buffer` (numpy or torch uint8)."""
        offsets, lengths, dtypes = [], [], []
        for offset, length, layout in items:
            offsets.append(offset), lengths.append(length), dtypes.append("raw")
            if layout is not None:
                for _, region in layout.regions():
                    offsets.append(offset + region.offset), lengths.append(region.length), dtypes.append(region.dtype)
        results = iter(self._check_regions(self._tensor(buffer), offsets, lengths, dtypes))
        checks = []
        for _, length, layout in items:
            whole = next(results)
            regions = None if layout is None else tuple(next(results) for _ in range(_region_count(layout)))
            checks.append(ValueCheck(xxh3=whole.xxh3, zero=whole.zero and whole.xxh3 == zero_digest(length),
                                     regions=regions))
        return checks
