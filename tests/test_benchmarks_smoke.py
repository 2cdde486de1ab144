"""`python -m benchmarks.run --tiny`: every section runs on a real embedded cluster and the table
has every row. No timing is asserted (numbers from a shared CI machine mean nothing)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_tiny_benchmark_prints_every_row(tmp_path):
    out = tmp_path / "bench.json"
    markdown = tmp_path / "bench.md"
    done = subprocess.run([sys.executable, "-m", "benchmarks.run", "--tiny", "--json", str(out),
                           "--markdown", str(markdown)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "MC_LOG_LEVEL": "ERROR"})
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = {(row["section"].split(" (")[0], row["name"].split(":")[0].split(",")[0]) for row in result["rows"]}
    for layout in ("mamba-130m TP1", "mamba-130m TP2", "4 KiB layout"):
        for name in ("xxh3_64", "xxh3_64 per value", "HostChecker.check_values (the scan's call)", "before"):
            assert (f"check {layout}", name) in rows, (layout, name)
    for workload in ("tp2", "tp1", "4k"):
        for name in ("fetch-only", "scan core", "scan full", "naive", "before", "serial"):
            assert (f"transfer {workload}", name) in rows, (workload, name)
    assert ("transfer fixed costs", "open_store() + store.close() (part of scan full)") in rows
    assert ("transfer tp2", "GIL probe") in rows
    assert ("enumeration", "AdminListing.list()") in rows and ("enumeration", "parse every listed key (parse_key)") in rows
    assert all(row["seconds"] and min(row["seconds"]) > 0 for row in result["rows"])
    assert any(row["rss_mib"] for row in result["rows"] if row["section"] == "enumeration")
    ratios = {line["ratio"] for line in result["ratios"]}
    assert "tp1: scan core / fetch-only (throughput)" in ratios and "tp1: scan core / naive" in ratios
    assert "mamba-130m TP1: region check / raw xxh3" in ratios
    assert "scan core" in done.stdout and "| section |" in markdown.read_text()


def test_host_checker_matches_the_reference_checker():
    """The optimised HostChecker against the code it replaced (benchmarks/reference_checker.py),
    on random layouts of every dtype and batches with gaps, odd offsets, zeros, NaN and Inf."""
    import random

    import numpy as np

    from audit.checks.host import HostChecker
    from audit.layouts.model import DTYPE_SIZES, Layout, Region, Segment
    from benchmarks.reference_checker import ReferenceChecker

    rng, pick = np.random.default_rng(7), random.Random(7)
    reference = ReferenceChecker()

    def layout(dtypes=None):
        segments, offset = [], 0
        for index in range(pick.randint(1, 4)):
            regions, start = [], offset
            for number in range(pick.randint(1, 3)):
                dtype = pick.choice(dtypes or list(DTYPE_SIZES))
                count = pick.choice([1, 3, 64, 700, 5000])
                regions.append(Region(f"r{number}", pick.choice(["state", "kv", "padding"]), offset,
                                      count * DTYPE_SIZES[dtype], dtype, (count,)))
                offset += count * DTYPE_SIZES[dtype]
            segments.append(Segment(index, f"layers.{index}", index, start, offset - start, tuple(regions)))
        return Layout("m", 0, "mamba1", 1, tuple(segments))

    def value(shape, clean=False):
        """Random bytes; regions zeroed, made finite (top exponent bit cleared), NaN planted."""
        data = rng.integers(0, 256, shape.size, dtype=np.uint8)
        for _, region in shape.regions():
            view, size = data[region.offset: region.offset + region.length], DTYPE_SIZES[region.dtype]
            roll = pick.random()
            if roll < 0.2:
                view[:] = 0
            elif roll < 0.8 or clean:
                top = view[size - 1::size] if size > 1 else view
                top &= 0xBF if size > 1 else 0xB7
                if pick.random() < (0.02 if clean else 0.3):
                    at = pick.randrange(region.length // size) * size
                    view[at: at + size] = 0xFF
        return data

    def small(dtype):  # a one-dtype layout of a few KiB: screened a stretch of values at a time
        length = 256 * DTYPE_SIZES[dtype]
        return Layout("s", 0, "mamba1", 1, (Segment(0, "layers.0", 0, 0, 2 * length, (
            Region("conv", "state", 0, length, dtype, (256,)), Region("ssm", "state", length, length, dtype, (256,)))),))

    layouts = [layout() for _ in range(6)] + [layout(["bfloat16"]), small("bfloat16"), small("float32"),
                                              small("float8_e4m3fn")]
    checker = HostChecker(piece_bytes=4096)
    for shape in layouts:
        for _ in range(4):
            data = value(shape)
            assert checker.check_value(data, shape) == reference.check_value(data, shape)
            assert HostChecker().check_value(data[:-1], shape) == reference.check_value(data[:-1], shape)
    buffer, items, offset = np.zeros(4 << 20, np.uint8), [], 0
    current = layouts[-3]
    while len(items) < 600:
        if pick.random() < 0.15:
            current = pick.choice(layouts + [None])
        size = current.size if current is not None else pick.randint(1, 3000)
        if offset + size > buffer.nbytes:
            break
        buffer[offset: offset + size] = value(current, clean=pick.random() < 0.95) if current is not None else 0
        items.append((offset, size, current))
        offset += size + pick.choice([0, 0, 0, 1, 2, 64])
        if pick.random() < 0.8:  # the scan puts every value on a 64-byte boundary
            offset = (offset + 63) // 64 * 64
    assert HostChecker().check_values(buffer, items) == [
        reference.check_value(buffer[start: start + size], shape) for start, size, shape in items]


def test_the_key_binding_benchmark_runs_and_checks_its_verdicts():
    """`benchmarks.key_binding` at its smallest: both guards and both scans run, and it exits 0 only
    when nothing healthy was refused or flagged and every page's K was checked."""
    done = subprocess.run([sys.executable, "-m", "benchmarks.key_binding", "--calls", "3", "--pages", "8",
                           "--rounds", "1"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "MC_LOG_LEVEL": "ERROR"})
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert [line.split(",")[0] for line in lines] == ["guard", "scan"] and all(" K " in line for line in lines)
