"""The GPU checker: every region of a whole batch in one Triton launch per float dtype.

Results are bit-identical to `HostChecker` (same XXH3-64, zero flags and NaN/Inf counts), so a
report does not depend on which checker wrote it. A value whose reading is undecided goes to the
kernel once for all its readings: each distinct byte range once, counted for every dtype the
readings give it, in the launch of the ranges counted as those same dtypes. On a host without a
GPU the kernel runs under the Triton interpreter: correct, and about a megabyte per second, for
verification only.
"""

from __future__ import annotations

import os
import sys

import numpy as np

from audit.checks.host import ValueCheck
from audit.checks.types import ByIdentity
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

        from audit.checks.kernels import check_region_readings, check_regions

        self._torch = torch
        self._check_regions = check_regions
        self._check_region_readings = check_region_readings
        self._joint = ByIdentity(_Joint).get

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

    def check_readings(self, buffer, items) -> list[tuple[ValueCheck, ...]]:
        """`items`: (offset, length, readings) per value, `readings` a tuple of layouts of that
        length, or () for opaque bytes; one check per reading (the opaque one alone for ()),
        equal to `check_values` under each reading in turn."""
        offsets, lengths, dtypes, joints = [], [], [], []
        for offset, length, layouts in items:
            offsets.append(offset), lengths.append(length), dtypes.append(("raw",))
            joint = self._joint(layouts) if layouts else None
            joints.append(joint)
            for start, span_length, span_dtypes in joint.spans if joint is not None else ():
                offsets.append(offset + start), lengths.append(span_length), dtypes.append(span_dtypes)
        results = iter(self._check_region_readings(self._tensor(buffer), offsets, lengths, dtypes))
        checks = []
        for (_, length, _), joint in zip(items, joints):
            (whole,) = next(results)
            zero = whole.zero and whole.xxh3 == zero_digest(length)
            if joint is None:
                checks.append((ValueCheck(xxh3=whole.xxh3, zero=zero),))
                continue
            spans = [next(results) for _ in joint.spans]
            checks.append(tuple(ValueCheck(xxh3=whole.xxh3, zero=zero,
                                           regions=tuple(spans[span][at] for span, at in picks))
                                for picks in joint.picks))
        return checks


class _Joint:
    """Several layouts of one value's bytes as the distinct byte ranges they cut it into, each
    with every dtype some reading gives it: what one kernel pass answers for all of them."""

    __slots__ = ("spans", "picks")

    def __init__(self, readings: tuple):
        dtypes_of: dict[tuple[int, int], list[str]] = {}
        for layout in readings:
            for _, region in layout.regions():
                listed = dtypes_of.setdefault((region.offset, region.length), [])
                if region.dtype not in listed:
                    listed.append(region.dtype)
        self.spans = [(offset, length, tuple(dtypes)) for (offset, length), dtypes in dtypes_of.items()]
        index = {(offset, length): number for number, (offset, length, _) in enumerate(self.spans)}
        # per reading, per region: (its span, the position of its dtype among the span's)
        self.picks = [[(index[region.offset, region.length],
                        dtypes_of[region.offset, region.length].index(region.dtype)) for _, region in layout.regions()]
                      for layout in readings]
