"""A clean value's regions, kept as digests: the same RegionChecks, made on access."""

from __future__ import annotations

import pickle

import numpy as np

from audit.checks.host import HostChecker, check_value_by_region
from audit.checks.types import CleanRegions, RegionCheck
from audit.judge.key import _flagged
from audit.layouts.model import Layout, Region, Segment


def _layout(regions: int, length: int) -> Layout:
    parts = tuple(Region(f"r{i}", "state", i * length, length, "bfloat16", (length // 2,)) for i in range(regions))
    return Layout(model="m", group=0, kind="mamba1", tp_size=1,
                  segments=(Segment(0, "layer0", 0, 0, regions * length, parts),))


def test_clean_regions_equal_the_tuple_of_their_checks():
    regions = CleanRegions((5, 7, 9))
    checks = tuple(RegionCheck(digest, False, 0, 0) for digest in (5, 7, 9))
    assert regions == checks and checks == regions and list(checks) == regions
    assert tuple(regions) == checks and regions[1] == checks[1] and regions[1:] == checks[1:]
    assert len(regions) == 3 and hash(regions) == hash(checks)
    assert regions != checks[:2] and regions != (RegionCheck(5, True, 0, 0), *checks[1:])
    assert pickle.loads(pickle.dumps(regions)) == regions


def test_a_clean_value_keeps_digests_and_a_flagged_one_its_checks():
    """Values of a mamba-like layout (bfloat16 regions): a clean one's regions are CleanRegions,
    judged unflagged without a look at each; one with a zero region or a NaN keeps its RegionChecks.
    Every result equals the region-by-region reference."""
    layout = _layout(8, 1024)
    rng = np.random.default_rng(3)
    clean = (rng.integers(0, 1 << 14, layout.size // 2, dtype=np.uint16)).view(np.uint8).copy()
    zero_region, nan_region = clean.copy(), clean.copy()
    zero_region[2048:3072] = 0
    nan_region.view(np.uint16)[700] = 0x7FC0
    buffer = np.concatenate([clean, zero_region, nan_region])
    items = [(i * layout.size, layout.size, layout) for i in range(3)]
    for checks in (HostChecker().check_values(buffer, items),
                   [HostChecker().check_value(buffer[o: o + n], layout) for o, n, _ in items]):
        assert [check == check_value_by_region(buffer[o: o + n], layout) for check, (o, n, _) in zip(checks, items)] \
            == [True, True, True]
        assert [type(check.regions) is CleanRegions for check in checks] == [True, False, False]
        assert [_flagged(check) for check in checks] == [False, True, True]
