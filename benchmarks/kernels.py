"""Section 4: the CPU region check alone, on a filled host buffer (no store involved).

The buffer holds consecutive values of one layout (mamba-130m TP 1 and TP 2, and a 4 KiB
one-layer layout): bf16 state-like bytes, one value in 50 all zero, and in every 997 values one
with a layer zeroed and three with a NaN, an Inf, a -Inf planted. Measured side by side, alternating:
- raw `xxhash.xxh3_64_intdigest` over all those bytes in one call (the bar: 0.7 x this);
- `xxh3_64_intdigest` per value (what any per-key digest costs);
- `HostChecker.check_values(buffer, items)` over all values, as the scan calls it per batch:
  per value the whole digest, per-region digests, zero flags, NaN/Inf counts;
- the same with the checker as it was before this benchmark's optimisation (before/after in one
  run); both must give identical results on every value, checked before timing.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import xxhash

from audit.checks.host import HostChecker
from audit.layouts import Layout, layouts_from_hf_config
from benchmarks.common import (MAMBA_130M, MAMBA_130M_NAME, TINY_4K, TINY_4K_NAME, ZERO_EVERY, BenchmarkError, Row,
                               stamp, state_like, timed)
from benchmarks.reference_checker import ReferenceChecker

NAN_BF16, INF_BF16, NEG_INF_BF16 = 0x7FC0, 0x7F80, 0xFF80


def kernel_layouts() -> list[tuple[str, Layout]]:
    return [
        ("mamba-130m TP1", layouts_from_hf_config(MAMBA_130M, model=MAMBA_130M_NAME, tp_size=1)[0]),
        ("mamba-130m TP2", layouts_from_hf_config(MAMBA_130M, model=MAMBA_130M_NAME, tp_size=2)[0]),
        ("4 KiB layout", layouts_from_hf_config(TINY_4K, model=TINY_4K_NAME)[0]),
    ]


def fill(buffer: np.ndarray, layout: Layout, seed: int = 0) -> int:
    """Consecutive values of `layout` in `buffer` (every page written); returns how many."""
    size = layout.size
    count = buffer.nbytes // size
    rng = np.random.default_rng(seed)
    pool = [state_like(rng, size) for _ in range(min(16, count))]
    regions = list(layout.regions())
    for index in range(count):
        value = buffer[index * size:(index + 1) * size]
        value[:] = pool[index % len(pool)]
        if index % ZERO_EVERY == ZERO_EVERY - 1:
            value[:] = 0
            continue
        stamp(value, index)
        special = index % 997
        if special in (13, 14, 15):  # plant a NaN, an Inf, a -Inf in one region
            _, region = regions[(index * 7) % len(regions)]
            word = (NAN_BF16, INF_BF16, NEG_INF_BF16)[special - 13]
            at = region.offset + (region.length // 2) // 2 * 2
            value[at:at + 2] = np.array([word], np.uint16).view(np.uint8)
        elif special == 40:  # one layer's state all zero
            segment = layout.segments[len(layout.segments) // 2]
            value[segment.offset:segment.offset + segment.length] = 0
    buffer[count * size:] = 0
    return count


def run_kernels(mib: int, runs: int, log: Callable[[str], None]) -> list[Row]:
    buffer = np.empty(mib << 20, np.uint8)
    current, reference = HostChecker(), ReferenceChecker()
    rows: list[Row] = []
    for label, layout in kernel_layouts():
        size = layout.size
        count = fill(buffer, layout)
        used = buffer[:count * size]
        values = [used[index * size:(index + 1) * size] for index in range(count)]
        mismatched = sum(1 for mine, theirs in zip(current.check_values(used, [(i * size, size, layout) for i in range(count)]),
                                                   (reference.check_value(value, layout) for value in values))
                         if mine != theirs)
        if mismatched:
            raise BenchmarkError(f"{label}: the current checker differs from the reference on {mismatched} values")

        def raw():
            xxhash.xxh3_64_intdigest(used)

        def per_value():
            digest = xxhash.xxh3_64_intdigest
            for value in values:
                digest(value)

        items = [(index * size, size, layout) for index in range(count)]

        def check(checker):
            return lambda: checker.check_values(used, items)

        methods = [
            ("xxh3_64, one call over all bytes", raw),
            ("xxh3_64 per value", per_value),
            ("HostChecker.check_values (the scan's call)", check(current)),
            ("before: same call, checker as of cf1bf69", check(reference)),
        ]
        section = f"check {label} ({size:,} B, {sum(1 for _ in layout.regions())} regions)"
        batch = [Row(section, name, count, count * size) for name, _ in methods]
        for turn in range(runs):
            for offset in range(len(methods)):
                which = (turn + offset) % len(methods)
                seconds, _ = timed(methods[which][1])
                batch[which].seconds.append(seconds)
        log(f"  {label}: " + ", ".join(f"{row.name.split(',')[0]} {row.gbps(row.best):.1f} GB/s" for row in batch))
        rows += batch
    return rows
