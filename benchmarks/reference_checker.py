"""The region checker as it was before the benchmark-driven optimisation (audit/checks/host.py at
commit cf1bf69): every region checked on its own, the whole digest streamed from them. That path
survives unchanged as `audit.checks.host.check_value_by_region`, with the same helpers
(`check_region`, `is_zero`, `count_nonfinite`); the benchmark times it beside the current checker
("before" and "after" in one run) and checks both give identical results on the same bytes."""

from __future__ import annotations

import numpy as np
import xxhash

from audit.checks.host import ValueCheck, check_value_by_region
from audit.checks.zero import is_zero


class ReferenceChecker:
    name = "reference"

    def check_values(self, buffer: np.ndarray, items) -> list[ValueCheck]:
        return [self.check_value(buffer[offset: offset + length], layout) for offset, length, layout in items]

    def check_value(self, data: np.ndarray, layout=None) -> ValueCheck:
        if layout is None:
            digest = xxhash.xxh3_64_intdigest(data)
            return ValueCheck(xxh3=digest, zero=is_zero(data, digest))
        return check_value_by_region(data, layout)
