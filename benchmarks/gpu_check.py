"""Bit-identity and throughput of the Triton region kernel on a CUDA GPU.

Run from the repository root on a GPU machine:  python -m benchmarks.gpu_check [--gib 4]

1. Verifies check_regions against the host reference (xxhash, numpy, count_nonfinite) over --gib
   GiB of random, all-zero, bfloat16 (with NaN/Inf) and float8 data, in regions of mixed lengths.
2. Prints one table of GB/s (bytes of regions checked per second): the kernel alone, check_regions
   end to end (host bookkeeping and result copy included), a device-to-device copy counting bytes
   read, and torch.count_nonzero. Copy and count_nonzero bound what a one-read checker can reach.
3. Scans an embedded cluster into GPU memory (CUDA buffers, Triton checker) and into host memory
   (numpy), and checks the two give identical records (needs the CUDA build of Mooncake).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

CHUNK_BYTES = 1 << 30
# Region lengths mixing the kernel path (long, 8-aligned) with the host path (short or unaligned);
# 1,400,832 is one mamba-130m bf16 key, 8,650,752 the value size of the vLLM #53084 report.
VERIFY_LENGTHS = [1_400_832, 8_650_752, 65_536, 1_032, 248, 241, 4_100, 100]
BENCH_LENGTHS = [65_536, 1_400_832, 8_650_752]
BENCH_DTYPES = ["raw", "bfloat16", "float8_e4m3fn"]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=4.0, help="GiB of data to verify (default 4)")
    parser.add_argument("--bench-gib", type=float, default=1.0, help="buffer size for throughput (default 1)")
    parser.add_argument("--repeats", type=int, default=10, help="timed repeats per measurement")
    return parser.parse_args()


def fill(kind: str, nbytes: int, generator):
    """A uint8 CUDA buffer of ``kind`` content (every page written, so reads are real)."""
    import torch

    if kind == "zero":
        return torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
    if kind == "bfloat16":
        values = torch.randn(nbytes // 2, dtype=torch.bfloat16, device="cuda", generator=generator)
        specials = torch.randint(0, values.numel(), (values.numel() // 100_000 + 3,), device="cuda",
                                 generator=generator)
        values[specials[0::3]] = float("nan")
        values[specials[1::3]] = float("inf")
        values[specials[2::3]] = float("-inf")
        return values.view(torch.uint8)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda", generator=generator)


def layout_regions(nbytes: int, lengths: list[int]) -> tuple[list[int], list[int]]:
    """Consecutive regions cycling through ``lengths``, each 8-aligned, until the buffer is full."""
    offsets, sizes, cursor, i = [], [], 0, 0
    while cursor + lengths[i % len(lengths)] <= nbytes:
        offsets.append(cursor)
        sizes.append(lengths[i % len(lengths)])
        cursor = (cursor + sizes[-1] + 7) // 8 * 8
        i += 1
    return offsets, sizes


def reference(data, dtype: str):
    """The host answer, computed independently of the package's own host fallback."""
    import xxhash

    from audit.checks.floats import count_nonfinite
    from audit.checks.types import RegionCheck

    return RegionCheck(xxhash.xxh3_64_intdigest(data), not data.any(), *count_nonfinite(data, dtype))


def verify(gib: float) -> int:
    """Compares every region with the host reference; returns the number of regions checked."""
    import torch

    from audit.checks.kernels import check_regions

    generator = torch.Generator(device="cuda").manual_seed(0)
    kinds = [("random", "raw"), ("zero", "bfloat16"), ("bfloat16", "bfloat16"), ("random", "float8_e4m3fn"),
             ("random", "float16")]
    checked, done_bytes, round_ = 0, 0, 0
    while done_bytes < gib * 2**30:
        kind, dtype = kinds[round_ % len(kinds)]
        buf = fill(kind, CHUNK_BYTES, generator)
        rotated = VERIFY_LENGTHS[round_ % 3:] + VERIFY_LENGTHS[:round_ % 3]  # vary where each length lands
        offsets, lengths = layout_regions(CHUNK_BYTES, rotated)
        found = check_regions(buf, offsets, lengths, [dtype] * len(offsets))
        host = buf.cpu().numpy()
        for offset, length, got in zip(offsets, lengths, found):
            want = reference(host[offset:offset + length], dtype)
            if got != want:
                raise SystemExit(f"MISMATCH {kind}/{dtype} region [{offset}, +{length}): {got} != {want}")
        checked += len(offsets)
        done_bytes += CHUNK_BYTES
        round_ += 1
        print(f"verified {kind:8s} as {dtype:13s}: {len(offsets):6d} regions, {CHUNK_BYTES / 2**30:.0f} GiB",
              flush=True)
    return checked


def time_cuda(fn, repeats: int) -> float:
    """Median seconds of ``fn`` on the current stream, after one warm-up call."""
    import torch

    fn()
    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / 1e3)
    return sorted(times)[len(times) // 2]


def time_wall(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()  # check_regions returns host results, so it has synchronised
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def bench(gib: float, repeats: int) -> list[tuple[str, str, int, float]]:
    import torch

    from audit.checks.kernels import check_regions
    from audit.checks.kernels.launcher import launch_region_kernel

    nbytes = int(gib * 2**30)
    generator = torch.Generator(device="cuda").manual_seed(1)
    src = fill("bfloat16", nbytes, generator)
    dst = torch.empty_like(src)
    rows = [
        ("copy (bytes read)", "-", 1, nbytes / time_cuda(lambda: dst.copy_(src), repeats)),
        ("torch.count_nonzero", "-", 1, nbytes / time_cuda(lambda: torch.count_nonzero(src), repeats)),
    ]
    for length in BENCH_LENGTHS:
        offsets, lengths = layout_regions(nbytes, [length])
        spans = torch.tensor([offsets, lengths], dtype=torch.int64, device="cuda")
        out = torch.empty((len(offsets), 4), dtype=torch.int64, device="cuda")
        checked = sum(lengths)
        for dtype in BENCH_DTYPES:
            kernel = time_cuda(lambda: launch_region_kernel(src, spans[0], spans[1], dtype, out), repeats)
            rows.append((f"kernel, {dtype}", f"{length:,}", len(offsets), checked / kernel))
        dtypes = ["bfloat16"] * len(offsets)
        end_to_end = time_wall(lambda: check_regions(src, offsets, lengths, dtypes), repeats)
        rows.append(("check_regions, bfloat16", f"{length:,}", len(offsets), checked / end_to_end))
    return rows


def scan_into_gpu(keys: int = 192) -> str:
    """A whole scan from an embedded cluster into GPU memory (CUDA buffers, Triton checker), compared
    with the same scan on the CPU path: the two reports must agree key for key. Building the workload
    runs the real recurrence per token, so it uses 16-token blocks: 192 keys cost 3,072 tokens (about
    25 s on one core), where 128-token blocks cost 8x that."""
    from importlib import metadata

    try:
        metadata.distribution("mooncake-transfer-engine")
    except metadata.PackageNotFoundError:
        return "scan into GPU memory: skipped (needs the CUDA build, mooncake-transfer-engine)"
    from audit.cluster import LocalCluster
    from audit.connection import Settings
    from audit.run.device import Placement
    from audit.run.orchestrator import ScanOptions, run_scan
    from audit.judge.plan import CheckPlan
    from audit.report.json_report import JsonSink
    from audit.simulate import MAMBA_130M, SimulationOptions, simulate

    with LocalCluster(holders=1, segment_mb=2048) as cluster, tempfile.TemporaryDirectory() as work:
        settings = Settings(master=cluster.master_address, metadata=cluster.metadata_url, admin=cluster.admin_url,
                            local_hostname="127.0.0.1")
        result = simulate(settings, model_config=MAMBA_130M, model="mamba-130m-hf", out_dir=work,
                          options=SimulationOptions(requests=4, tokens=keys // 4 * 16, block_size=16, tp_size=1))
        reports = {}
        for name, placement in (("cpu", Placement("cpu", "numpy")), ("cuda", Placement("cuda", "triton"))):
            plan = CheckPlan(layouts=[result.layout], keep_regions=True)
            reports[name] = run_scan(settings, ScanOptions(plan=plan, placement=placement),
                                     JsonSink(Path(work) / f"{name}.json", include_all=True))
    same = [r.to_json() for r in reports["cpu"].records] == [r.to_json() for r in reports["cuda"].records]
    rate = reports["cuda"].summary["bytes_per_s"] or 0
    return (f"scan into GPU memory: {reports['cuda'].summary['keys_scanned']} keys at {rate / 1e9:.2f} GB/s "
            f"(cpu path {(reports['cpu'].summary['bytes_per_s'] or 0) / 1e9:.2f} GB/s); "
            f"records identical to the CPU path: {same}")


def main() -> int:
    args = parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("gpu_check: TRITON_INTERPRET=1 is set; unset it to measure the compiled kernel", file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: needs a CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    print(f"device: {torch.cuda.get_device_name()}")
    regions = verify(args.gib)
    print(f"bit-identical to xxhash/numpy: {regions} regions over {args.gib:g} GiB")
    rows = bench(args.bench_gib, args.repeats)
    copy_rate = rows[0][3]
    print(f"\n{'operation':26s} {'region bytes':>13s} {'regions':>8s} {'GB/s':>9s} {'% of copy':>10s}")
    for name, length, count, rate in rows:
        print(f"{name:26s} {length:>13s} {count:8d} {rate / 1e9:9.1f} {100 * rate / copy_rate:9.0f}%")
    print(scan_into_gpu())
    return 0


if __name__ == "__main__":
    sys.exit(main())
