"""Where the guards read a value's bytes in host memory: pages sliced from the described caches."""

from __future__ import annotations

import numpy as np
import pytest

from audit.recorder.cachebytes import CacheBytes, host_bytes


def _address(array: np.ndarray, offset: int = 0) -> int:
    return array.ctypes.data + offset


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_a_described_host_cache_is_sliced_and_reads_the_same_bytes(kind):
    rng = np.random.default_rng(0)
    caches = [rng.integers(0, 256, size=(4, 4096), dtype=np.uint8) for _ in range(3)]
    if kind == "torch":
        torch = pytest.importorskip("torch")
        described = {f"model.layers.{i}": torch.from_numpy(cache) for i, cache in enumerate(caches)}
    else:
        described = {f"model.layers.{i}": cache for i, cache in enumerate(caches)}
    memory = CacheBytes(described)
    assert memory.storages == [] and len(memory.host) == 3  # host memory: no device path
    for cache in caches:
        for offset, size in ((0, 4096), (4096 + 100, 1000), (3 * 4096, 4096)):
            view = memory.host_view(_address(cache, offset), size)
            assert view.base is not None and np.shares_memory(view, cache)  # a slice, not a new view
            np.testing.assert_array_equal(view, cache.reshape(-1)[offset:offset + size])
    # what the binder asks: several ranges at once, as `host_bytes` would give them
    ranges = [(_address(caches[1], 8192), 64), (_address(caches[2], 5), 7)]
    for got, (address, size) in zip(memory.on_host(ranges), ranges):
        np.testing.assert_array_equal(got, host_bytes(address, size))


def test_bytes_outside_every_described_cache_are_still_read():
    cache, other = np.arange(4096, dtype=np.uint8), np.full(128, 7, dtype=np.uint8)
    memory = CacheBytes({"model.layers.0": cache})
    np.testing.assert_array_equal(memory.host_view(_address(other), 128), other)  # not a cache's
    tail = memory.host_view(_address(cache, 4000), 96)  # the cache's end
    np.testing.assert_array_equal(tail, cache[4000:])
    np.testing.assert_array_equal(CacheBytes().host_view(_address(cache, 10), 6), cache[10:16])  # none described
    assert CacheBytes({"model.layers.0": cache[::2]}).host == []  # not contiguous: read as before
