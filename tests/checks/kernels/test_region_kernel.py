"""The Triton region kernel against the host reference (xxhash, numpy, ``count_nonfinite``).

Runs the kernel under TRITON_INTERPRET on CPU tensors when no GPU is in use; sizes are kept small
because the interpreter checks about 1 MB/s.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import subprocess  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import xxhash  # noqa: E402

from audit.checks.floats import FLOAT_DTYPES, count_nonfinite  # noqa: E402
from audit.checks.types import RegionCheck  # noqa: E402
from audit.checks.kernels import check_regions, launcher  # noqa: E402

INTERPRETED = os.environ["TRITON_INTERPRET"] == "1"
DEVICE = "cpu" if INTERPRETED else "cuda"
if not INTERPRETED and not torch.cuda.is_available():
    pytest.skip("TRITON_INTERPRET is off and there is no GPU", allow_module_level=True)

LENGTHS_AROUND_EDGES = [
    0, 1, 8, 17, 128, 129,  # XXH3's short and medium algorithms: host
    239, 240, 241, 244,  # 241 and 244 are long but unaligned: host
    248, 256, 1016, 1024, 1032, 1088, 2048, 2056, 8192, 9216,  # kernel
    65528, 65536, 65544,
]
ALL_DTYPES = sorted(launcher.DTYPES)


def reference(data: np.ndarray, dtype: str) -> RegionCheck:
    nan, inf = count_nonfinite(data, dtype)
    return RegionCheck(xxhash.xxh3_64_intdigest(data), not data.any(), nan, inf)


def packed(regions: list[np.ndarray], gap: int = 8) -> tuple[np.ndarray, list[int], list[int]]:
    """All regions in one buffer, each starting 8-aligned after ``gap`` bytes of junk."""
    offsets, cursor = [], 0
    for region in regions:
        cursor = (cursor + gap + 7) // 8 * 8
        offsets.append(cursor)
        cursor += len(region)
    buf = np.random.default_rng(99).integers(1, 256, cursor, dtype=np.uint8)
    for offset, region in zip(offsets, regions):
        buf[offset:offset + len(region)] = region
    return buf, offsets, [len(r) for r in regions]


def run(buf: np.ndarray, offsets, lengths, dtypes) -> list[RegionCheck]:
    return check_regions(torch.from_numpy(buf).to(DEVICE), offsets, lengths, dtypes)


def assert_matches_reference(buf, offsets, lengths, dtypes):
    found = run(buf, offsets, lengths, dtypes)
    expected = [reference(buf[o:o + n], d) for o, n, d in zip(offsets, lengths, dtypes)]
    for offset, length, dtype, got, want in zip(offsets, lengths, dtypes, found, expected):
        assert got == want, f"region [{offset}, +{length}) as {dtype}"


@pytest.mark.parametrize("content", ["random", "zeros", "ones"])
def test_every_length_class_matches_xxhash_in_one_call(content):
    rng = np.random.default_rng(len(content))
    make = {
        "random": lambda n: rng.integers(0, 256, n, dtype=np.uint8),
        "zeros": lambda n: np.zeros(n, np.uint8),
        "ones": lambda n: np.full(n, 0xFF, np.uint8),
    }[content]
    buf, offsets, lengths = packed([make(n) for n in LENGTHS_AROUND_EDGES])
    assert_matches_reference(buf, offsets, lengths, ["raw"] * len(lengths))


@pytest.mark.parametrize("length", [248, 1024, 1032, 2048, 4104])
def test_one_set_byte_anywhere_in_the_final_stripe_is_seen(length):
    """The final stripe overlaps the last block; the top byte of a word also tests unsigned max."""
    regions = []
    for position in sorted({length - 1, length - 8, length - 57, length - 64}):
        region = np.zeros(length, np.uint8)
        region[position] = 0x80
        regions.append(region)
    buf, offsets, lengths = packed(regions)
    found = run(buf, offsets, lengths, ["raw"] * len(lengths))
    assert not any(check.zero for check in found)
    assert_matches_reference(buf, offsets, lengths, ["raw"] * len(lengths))


def test_zero_region_hash_is_the_fixed_zero_digest():
    found = run(np.zeros(3 * 4096, np.uint8), [0, 4096, 8192], [4096, 4096, 4096], ["bfloat16"] * 3)
    digest = xxhash.xxh3_64_intdigest(bytes(4096))
    assert found == [RegionCheck(digest, True, 0, 0)] * 3


def test_kernel_path_runs_for_long_aligned_regions(monkeypatch):
    """Guards the tests above: long aligned regions must not silently fall back to the host."""
    def no_host(*_):
        raise AssertionError("host fallback used")

    monkeypatch.setattr(launcher, "_check_on_host", no_host)
    buf, offsets, lengths = packed([np.arange(n, dtype=np.uint8) for n in (248, 1024, 3000 // 8 * 8)])
    assert_matches_reference(buf, offsets, lengths, ["raw", "float16", "float8_e4m3fn"])


def test_mixed_dtypes_offsets_and_paths_keep_input_order():
    rng = np.random.default_rng(5)
    lengths = [1032, 100, 4096, 300, 2052, 65536, 16]
    dtypes = ["float32", "bfloat16", "raw", "float8_e5m2", "float16", "int64", "float8_e4m3fn"]
    regions = [rng.integers(0, 256, n, dtype=np.uint8) for n in lengths]
    buf, offsets, _ = packed(regions, gap=13)
    # Reverse and repeat a region, so results cannot come back in buffer or group order.
    offsets, lengths, dtypes = offsets[::-1] + offsets[:1], lengths[::-1] + lengths[:1], dtypes[::-1] + ["raw"]
    assert_matches_reference(buf, offsets, lengths, dtypes)


def test_regions_of_several_tensors_are_flagged_in_one_launch_per_dtype(monkeypatch):
    """`region_flags_across`: regions of several tensors (a KV cache's storage a layer), in input
    order, each flagged (all zero; NaN or Inf) as the reference checks its own bytes, the kernel's
    in one launch per dtype for all the tensors (addressed from the lowest one's start), the host's
    from their own tensor; a region past its own tensor's end is refused even where another
    tensor's bytes follow."""
    from audit.checks.kernels import region_flags_across

    rng = np.random.default_rng(8)
    host = [rng.integers(0, 256, n, dtype=np.uint8) for n in (4096, 8192, 2048)]
    host[1][1024:3072] = 0
    host[2][:1024] = np.ones(256, np.float32).view(np.uint8)
    host[2][8:12] = np.array([np.nan], np.float32).view(np.uint8)
    host[0][1024:2048] = np.ones(512, np.float16).view(np.uint8)
    views = [torch.from_numpy(data).to(DEVICE) for data in host]
    regions = [(1, 0, 1024, "float32"), (0, 8, 2048, "raw"), (2, 0, 1024, "float32"), (1, 1024, 2048, "float32"),
               (0, 3, 241, "bfloat16"), (0, 1024, 1024, "float16"), (1, 4096, 4096, "raw"), (0, 0, 100, "raw"),
               (2, 1024, 1024, "float8_e4m3fn")]
    launches = []
    real = launcher.launch_region_kernel
    monkeypatch.setattr(launcher, "launch_region_kernel", lambda *args: (launches.append(args[3]), real(*args))[1])
    zero, nonfinite = region_flags_across(views, *map(list, zip(*regions)))
    expected = [reference(host[slot][offset:offset + length], dtype) for slot, offset, length, dtype in regions]
    assert zero.tolist() == [check.zero for check in expected]
    assert nonfinite.tolist() == [bool(check.nan or check.inf) for check in expected]
    assert zero[3] and nonfinite[2] and not nonfinite[5]  # (so the comparison can fail both ways)
    assert sorted(launches) == [(), ("float16",), ("float32",), ("float8_e4m3fn",)]  # each dtype's regions at once
    with pytest.raises(ValueError, match="outside"):
        region_flags_across(views, [0], [4000], [1024], ["raw"])
    assert [a.tolist() for a in region_flags_across([], [], [], [], [])] == [[], []]


def test_unaligned_buffer_base_and_offsets():
    """Kernel regions need an 8-aligned address; the buffer's own start need not be aligned."""
    storage = torch.from_numpy(np.random.default_rng(3).integers(0, 256, 8192, dtype=np.uint8)).to(DEVICE)
    buf = storage[3:]  # base address 3 mod 8
    offsets, lengths = [5, 13, 0, 4], [2048, 1024, 1024, 1024]  # aligned, aligned, unaligned, unaligned
    found = check_regions(buf, offsets, lengths, ["raw"] * 4)
    host = buf.cpu().numpy()
    assert found == [reference(host[o:o + n], "raw") for o, n in zip(offsets, lengths)]


def test_random_lengths_dtypes_and_sparse_contents():
    rng = np.random.default_rng(2024)
    lengths = rng.integers(241, 20_000, 40) // 8 * 8
    regions = []
    for n in lengths:
        region = np.zeros(n, np.uint8)
        nonzero = rng.integers(0, n, rng.integers(0, 6))  # mostly-zero values, like a null block
        region[nonzero] = rng.integers(1, 256, len(nonzero))
        regions.append(region)
    buf, offsets, lengths = packed(regions)
    assert_matches_reference(buf, offsets, lengths, list(rng.choice(ALL_DTYPES, len(lengths))))


def special_bytes(rng: np.random.Generator, length: int) -> np.ndarray:
    """Random bytes salted with the bytes that make exponents all ones in some float dtype."""
    data = rng.integers(0, 256, length, dtype=np.uint8)
    salt = rng.integers(0, length, length // 4)
    data[salt] = rng.choice(np.array([0x7F, 0xFF, 0x80, 0x7C, 0xFC, 0x7E, 0x7B, 0x78, 0x00], np.uint8),
                            len(salt))
    return data


def test_nan_inf_counts_match_the_host_for_every_dtype_on_the_same_bytes():
    """The same bytes read as each dtype: a pattern special in one is ordinary in another."""
    rng = np.random.default_rng(11)
    regions = [special_bytes(rng, n) for n in (1024, 2056, 5000 // 8 * 8)]
    buf, offsets, lengths = packed(regions)
    n = len(regions)
    assert_matches_reference(buf, offsets * len(ALL_DTYPES), lengths * len(ALL_DTYPES),
                             [dtype for dtype in ALL_DTYPES for _ in range(n)])


@pytest.mark.parametrize("dtype", sorted(FLOAT_DTYPES))
def test_torch_nan_and_inf_values_are_counted(dtype):
    torch_dtype = getattr(torch, dtype)
    values = torch.linspace(-2, 2, 1024 // torch_dtype.itemsize).to(torch_dtype)
    values[3] = float("nan")
    values[-1] = float("nan")  # in the final stripe
    values[100] = float("inf")
    values[200] = float("-inf")
    data = values.cpu().view(torch.uint8).numpy()
    [found] = run(data.copy(), [0], [len(data)], [dtype])
    # What the bytes hold, decoded by torch: e4m3fn has no inf, and torch versions differ in what they
    # store for one (2.13 on CPU saturates to +-448, 2.11 on CUDA stores NaN).
    stored = values.cpu().float()
    assert (found.nan, found.inf) == (int(stored.isnan().sum()), int(stored.isinf().sum()))
    assert found.nan >= 2 and found.inf == (2 if FLOAT_DTYPES[dtype].has_inf else 0)
    assert found == reference(data, dtype)


def test_patterns_special_in_one_dtype_only():
    # Bytes 00 00 80 7F: float32 +Inf; bfloat16 0 and +Inf; float16 0 and NaN; e5m2 one NaN;
    # e4m3fn one NaN (0x7F), while 0x80 is -0 everywhere.
    data = np.tile(np.array([0x00, 0x00, 0x80, 0x7F], np.uint8), 256)
    found = dict(zip(sorted(FLOAT_DTYPES), run(data, [0] * 5, [1024] * 5, sorted(FLOAT_DTYPES))))
    assert (found["float32"].nan, found["float32"].inf) == (0, 256)
    assert (found["bfloat16"].nan, found["bfloat16"].inf) == (0, 256)
    assert (found["float16"].nan, found["float16"].inf) == (256, 0)
    assert (found["float8_e5m2"].nan, found["float8_e5m2"].inf) == (256, 0)
    assert (found["float8_e4m3fn"].nan, found["float8_e4m3fn"].inf) == (256, 0)


def test_trailing_partial_element_is_ignored_for_floats():
    data = np.zeros(1030, np.uint8)
    data[1024:1030] = 0xFF  # six bytes: one and a half float32 elements of all ones
    [found] = run(data, [0], [1030], ["float32"])
    assert found == reference(data, "float32") and (found.nan, found.inf) == (1, 0)


def test_empty_batch_and_bad_input():
    buf = torch.zeros(4096, dtype=torch.uint8, device=DEVICE)
    assert check_regions(buf, [], [], []) == []
    with pytest.raises(ValueError, match="outside"):
        check_regions(buf, [4000], [200], ["raw"])
    with pytest.raises(ValueError, match="unknown dtype"):
        check_regions(buf, [0], [1024], ["float64"])
    with pytest.raises(ValueError, match="uint8"):
        check_regions(buf.view(torch.int32), [0], [1024], ["raw"])
    with pytest.raises(ValueError, match="same length"):
        check_regions(buf, [0, 8], [1024], ["raw"])


COMPILE_FOR_SM90 = textwrap.dedent("""
    import triton
    from triton.backends.compiler import GPUTarget
    from audit.checks.kernels.launcher import BLOCKS_PER_STEP
    from audit.checks.kernels.region_kernel import region_check_kernel

    signature = {"buf_ptr": "*u8", "offsets_ptr": "*i64", "lengths_ptr": "*i64", "secret_ptr": "*i64",
                 "masks_ptr": "*i64", "out_ptr": "*i64", "out_stride": "i64"}
    for name, readings, count in (("raw", 1, False), ("one-dtype", 1, True), ("two-dtypes", 2, True),
                                  ("four-dtypes", 4, True)):
        constexprs = dict(BLOCKS_PER_STEP=BLOCKS_PER_STEP, READINGS=readings, COUNT=count)
        source = triton.compiler.ASTSource(
            fn=region_check_kernel, signature={**signature, **dict.fromkeys(constexprs, "constexpr")},
            constexprs=constexprs)
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32))
        print(name, ".target sm_90" in compiled.asm["ptx"], "mul.hi.u64" in compiled.asm["ptx"],
              len(compiled.asm["cubin"]) > 0)
""")
KERNEL_VARIANTS = ("raw", "one-dtype", "two-dtypes", "four-dtypes")


def test_kernel_compiles_for_sm90_without_a_gpu():
    """Lowering errors (which the interpreter never hits) show up on CPU-only CI."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", COMPILE_FOR_SM90], env=env, capture_output=True, text=True,
                          timeout=300, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == [word for variant in KERNEL_VARIANTS for word in (variant, "True", "True", "True")]
