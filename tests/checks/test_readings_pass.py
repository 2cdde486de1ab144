"""Several readings of the same bytes checked in one pass (issue #31 item 3): the results equal
checking the value under each reading on its own, on the host and in the Triton kernel (under
TRITON_INTERPRET on CPU), and the shared bytes are hashed and screened once, not once per reading."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import random  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import xxhash  # noqa: E402

from audit.checks import host  # noqa: E402
from audit.checks.floats import Screen  # noqa: E402
from audit.checks.host import HostChecker, check_value_by_region  # noqa: E402
from audit.layouts.model import DTYPE_SIZES, Layout, Region, Segment  # noqa: E402

SAME_WIDTH = {"bfloat16": "float16", "float16": "bfloat16", "float32": "float32", "raw": "raw",
              "float8_e4m3fn": "float8_e5m2", "float8_e5m2": "float8_e4m3fn"}
# bytes that are NaN or Inf in some float dtype and ordinary in another
SPECIAL_WORDS = [0x7C01, 0x7F80, 0xFF80, 0x7FC0, 0x7C00, 0xFC00, 0x7F7F]


def _layout(lengths_dtypes: list[tuple[int, str]], kinds=None) -> Layout:
    regions, offset = [], 0
    for index, (length, dtype) in enumerate(lengths_dtypes):
        kind = kinds[index] if kinds else ("padding" if dtype == "raw" else "state")
        regions.append(Region(f"r{index}", kind, offset, length, dtype, (length // DTYPE_SIZES[dtype],)))
        offset += length
    return Layout("m", 0, "mamba2", 1, (Segment(0, "layers.0", 0, 0, offset, tuple(regions)),))


def _readings(pick: random.Random, size_words: int) -> tuple[Layout, ...]:
    """A layout of ``4 * size_words`` bytes, its twin with every dtype swapped for another of the same
    width (bfloat16 <-> float16: the same boundaries), and one cut at other boundaries."""
    def tiling():
        cuts = sorted(pick.sample(range(1, size_words), pick.randint(1, min(5, size_words - 1))))
        return [4 * (b - a) for a, b in zip([0, *cuts], [*cuts, size_words])]

    first = [(length, pick.choice(["bfloat16", "float16", "float32", "raw", "float8_e4m3fn"])) for length in tiling()]
    twin = [(length, SAME_WIDTH[dtype]) for length, dtype in first]
    other = [(length, pick.choice(["bfloat16", "float32", "float16"])) for length in tiling()]
    return _layout(first), _layout(twin), _layout(other)


def _value(rng: np.random.Generator, pick: random.Random, layout: Layout) -> np.ndarray:
    """Random finite-ish bytes; some regions zeroed, special words planted here and there."""
    data = rng.integers(0, 256, layout.size, dtype=np.uint8)
    data[1::2] &= 0x3F  # most 16-bit words finite in every 16-bit dtype
    for _, region in layout.regions():
        roll = pick.random()
        view = data[region.offset: region.offset + region.length]
        if roll < 0.25:
            view[:] = 0
        elif roll < 0.5:
            at = pick.randrange(region.length // 2) * 2
            view[at: at + 2] = np.array([pick.choice(SPECIAL_WORDS)], np.uint16).view(np.uint8)
    if pick.random() < 0.1:
        data[:] = 0
    return data


def _expected(buffer: np.ndarray, items) -> list[tuple]:
    """Each reading checked on its own: the plain region-by-region path."""
    return [tuple(check_value_by_region(buffer[offset: offset + length], layout) for layout in readings)
            for offset, length, readings in items]


def _batch(seed: int, values: int, size_words: int, shared: bool):
    """A buffer of values, each with its tuple of readings (`shared`: one tuple for all of them,
    as a scan hands a group's values to the checker, so like values run together)."""
    rng, pick = np.random.default_rng(seed), random.Random(seed)
    common = _readings(pick, size_words)
    buffer, items, offset = np.zeros(values * (4 * size_words + 64), np.uint8), [], 0
    for _ in range(values):
        readings = common if shared else _readings(pick, size_words)
        layout = pick.choice(readings)
        buffer[offset: offset + layout.size] = _value(rng, pick, layout)
        items.append((offset, layout.size, readings))
        offset += (layout.size + 63) // 64 * 64
    return buffer, items


@pytest.mark.parametrize("size_words, shared", [(64, True), (64, False), (3000, True), (3000, False)])
def test_one_pass_equals_each_reading_checked_alone(size_words, shared):
    for seed in range(6):
        buffer, items = _batch(seed, 40, size_words, shared)
        items.append((0, 100, ()))  # opaque bytes among them
        found = HostChecker(piece_bytes=2048).check_readings(buffer, items)
        want = _expected(buffer, items[:-1])
        assert found[:-1] == want
        digest = xxhash.xxh3_64_intdigest(buffer[:100])
        assert found[-1] == (host.ValueCheck(xxh3=digest, zero=not buffer[:100].any()),)
        # and check_values, the one-reading path, agrees with the first reading of each
        assert HostChecker().check_values(buffer, [(o, n, r[0]) for o, n, r in items[:-1]]) == [w[0] for w in want]


def _counting(monkeypatch) -> dict:
    """Bytes the host checker hashes and reduces for NaN/Inf screens, by wrapping what it calls."""
    counted = {"hashed": 0, "screened": 0}
    real_maxima = host.element_maxima

    def digest(data):
        counted["hashed"] += memoryview(data).nbytes
        return xxhash.xxh3_64_intdigest(data)

    def maxima(data, itemsize):
        counted["screened"] += data.nbytes
        return real_maxima(data, itemsize)

    real_any = Screen.any

    def screen(self, data):
        counted["screened"] += data.nbytes
        return real_any(self, data)

    monkeypatch.setattr(host, "xxhash", SimpleNamespace(xxh3_64_intdigest=digest, xxh3_64=xxhash.xxh3_64))
    monkeypatch.setattr(host, "element_maxima", maxima)
    monkeypatch.setattr(Screen, "any", screen)
    return counted


def test_readings_of_the_same_boundaries_cost_one_reading(monkeypatch):
    """bfloat16 against float16 (the default ambiguity of a bf16 deployment): the bytes are hashed
    once and screened once; a reading at other boundaries adds only its own ranges."""
    kinds = ["state", "state", "padding"]
    bf16 = _layout([(20_000, "bfloat16"), (60_000, "bfloat16"), (4_000, "raw")], kinds)
    fp16 = _layout([(20_000, "float16"), (60_000, "float16"), (4_000, "raw")], kinds)
    mixed = _layout([(20_000, "bfloat16"), (60_000, "float16"), (4_000, "raw")], kinds)
    value = np.random.default_rng(1).integers(0, 256, bf16.size, dtype=np.uint8)
    value[1::2] &= 0x3F
    want = tuple(check_value_by_region(value, layout) for layout in (bf16, fp16, mixed))
    counted = _counting(monkeypatch)
    alone = HostChecker().check_readings(value, [(0, value.size, (bf16,))])
    cost_alone = dict(counted)
    counted.update(hashed=0, screened=0)
    together = HostChecker().check_readings(value, [(0, value.size, (bf16, fp16, mixed))])
    assert alone == [want[:1]] and together == [want]
    assert counted["hashed"] == cost_alone["hashed"] == 2 * value.size  # whole value, then each region
    # bf16's one run over both regions is the same two reductions as fp16's; mixed cuts it in two,
    # and the cut pieces serve every reading: the float bytes are reduced once
    assert counted["screened"] == 80_000 and cost_alone["screened"] == 80_000
    other = _layout([(40_000, "float32"), (44_000, "raw")], ["kv", "padding"])
    counted.update(hashed=0, screened=0)
    HostChecker().check_readings(value, [(0, value.size, (bf16, other))])
    assert counted["hashed"] == 2 * value.size + 40_000 + 44_000  # only the other cut's own ranges
    assert counted["screened"] == 80_000 + 40_000


triton_checker = pytest.importorskip("audit.checks.triton")


def _triton():
    """The Triton checker where this host runs its kernel (interpreted on host memory, or on a GPU),
    and how a host buffer is placed there."""
    import torch

    if os.environ.get("TRITON_INTERPRET") == "1":
        return triton_checker.TritonChecker("cpu"), lambda buffer: buffer
    if not torch.cuda.is_available():
        pytest.skip("TRITON_INTERPRET is off and there is no GPU")
    return triton_checker.TritonChecker("cuda"), lambda buffer: torch.from_numpy(buffer).cuda()


@pytest.mark.parametrize("shared", [True, False])
def test_the_kernel_checks_every_reading_in_one_pass_bit_for_bit(shared):
    """Small sizes: the interpreter checks about a megabyte a second."""
    checker, placed = _triton()
    for seed in range(3):
        buffer, items = _batch(100 + seed, 6, 700, shared)
        assert checker.check_readings(placed(buffer), items) == HostChecker().check_readings(buffer, items)


def test_the_kernel_hashes_shared_ranges_once_and_counts_both_dtypes_in_one_launch(monkeypatch):
    from audit.checks.kernels import launcher

    checker, placed = _triton()
    kinds = ["state", "state", "padding"]
    bf16 = _layout([(2_048, "bfloat16"), (6_144, "bfloat16"), (1_024, "raw")], kinds)
    fp16 = _layout([(2_048, "float16"), (6_144, "float16"), (1_024, "raw")], kinds)
    value = np.random.default_rng(2).integers(0, 256, bf16.size, dtype=np.uint8)
    value[1::2] &= 0x3F
    value[6:8] = np.array([0x7C01], np.uint16).view(np.uint8)  # NaN as float16 only
    value[4000:4002] = np.array([0x7F80], np.uint16).view(np.uint8)  # Inf as bfloat16, NaN as float16
    launches = []
    real = launcher.launch_region_kernel

    def launch(buf, starts, lengths, dtypes, out):
        launches.append((len(starts), dtypes))
        return real(buf, starts, lengths, dtypes, out)

    monkeypatch.setattr(launcher, "launch_region_kernel", launch)
    (found,) = checker.check_readings(placed(value), [(0, value.size, (bf16, fp16))])
    assert found == (check_value_by_region(value, bf16), check_value_by_region(value, fp16))
    assert [(r.nan, r.inf) for r in found[0].regions] == [(0, 0), (0, 1), (0, 0)]
    assert [(r.nan, r.inf) for r in found[1].regions] == [(1, 0), (1, 0), (0, 0)]
    # the whole value and the padding count nothing; both state ranges, once, for both dtypes
    assert sorted(launches) == [(2, ()), (2, ("bfloat16", "float16"))]


def test_plausibility_from_bit_patterns_equals_decoding_every_number():
    """The sample reads that choose a reading judge 16-bit and 8-bit numbers from a histogram of
    their bit patterns, shared by the dtypes of one width: the counts of decoding each number."""
    from audit.checks.floats import decode_floats
    from audit.checks.plausibility import Plausibility, _sane, readings_plausibility, region_plausibility

    def decoded(data, dtype):
        values = decode_floats(data, dtype)
        nonzero = values[values != 0]
        width = data.nbytes // max(values.size, 1)
        return Plausibility(nonzero.size * width, (nonzero.size - int(np.count_nonzero(_sane(nonzero)))) * width)

    rng = np.random.default_rng(9)
    for length in (0, 1, 3, 64, 4097):
        data = rng.integers(0, 256, length, dtype=np.uint8)
        data[: length // 3] = 0  # zeros and -0 are not examined
        data[1: length // 4: 2] = 0x80
        for dtype in ("bfloat16", "float16", "float8_e4m3fn", "float8_e5m2"):
            assert region_plausibility(data, "state", dtype) == decoded(data, dtype), (length, dtype)
    kinds = ["state", "state", "padding"]
    value = rng.integers(0, 256, 9_000, dtype=np.uint8)
    layouts = [_layout([(2_000, conv), (6_000, ssm), (1_000, "raw")], kinds)
               for conv in ("bfloat16", "float16") for ssm in ("bfloat16", "float16")]
    every_pattern = np.arange(1 << 16, dtype=np.uint16).view(np.uint8)  # subnormals, -0, Inf, NaN, the band's edges
    sparse = np.zeros(9_000, dtype=np.uint8)
    sparse[::37] = rng.integers(0, 256, len(sparse[::37]), dtype=np.uint8)
    for value in (value, every_pattern[:9_000], every_pattern[-9_000:], sparse):
        assert readings_plausibility(value, layouts) == [
            sum((decoded(value[r.offset: r.offset + r.length], r.dtype) if r.kind != "padding" else
                 Plausibility(int(np.count_nonzero(value[r.offset: r.offset + r.length])),
                              int(np.count_nonzero(value[r.offset: r.offset + r.length])))
                 for _, r in layout.regions()), Plausibility()) for layout in layouts]
