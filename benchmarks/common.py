"""Shared pieces of the benchmarks: sizes per mode, timing, rows of the result table, machine facts."""

from __future__ import annotations

import contextlib
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

# state-spaces/mamba-130m-hf: 24 layers, d_model 768, d_inner 1536, d_state 16, d_conv 4.
MAMBA_130M = {"model_type": "mamba", "hidden_size": 768, "intermediate_size": 1536, "state_size": 16,
              "conv_kernel": 4, "num_hidden_layers": 24}
MAMBA_130M_NAME = "mamba-130m-hf"
# A one-layer Mamba whose key is exactly 4 KiB: conv (3, 128) + ssm (128, 13) bf16 = 4,096 bytes.
TINY_4K = {"model_type": "mamba", "hidden_size": 64, "intermediate_size": 128, "state_size": 13,
           "conv_kernel": 4, "num_hidden_layers": 1}
TINY_4K_NAME = "tiny-mamba-4k"
ZERO_EVERY = 50              # one value in 50 is all zero (a NULL-block state)


class BenchmarkError(RuntimeError):
    """A measurement could not be made, or measured something other than intended."""


@dataclass(frozen=True)
class Sizes:
    """How much each section does; `full` is the documented run, `quick` a smoke run."""

    runs: int                 # alternating timed runs per method (transfer sections, kernels)
    tp2_keys: int             # mamba-130m TP 2 values (700,416 B)
    tp1_keys: int             # mamba-130m TP 1 values (1,400,832 B)
    small_keys: int           # 4 KiB values
    kernel_mib: int           # buffer of the check-kernel section
    enum_keys: int            # keys listed in the enumeration section
    enum_runs: int


MODES = {
    "full": Sizes(runs=5, tp2_keys=2000, tp1_keys=2000, small_keys=20000, kernel_mib=256,
                  enum_keys=500_000, enum_runs=5),
    "quick": Sizes(runs=3, tp2_keys=300, tp1_keys=200, small_keys=3000, kernel_mib=64,
                   enum_keys=50_000, enum_runs=3),
    # For the smoke test: every row, seconds of work.
    "tiny": Sizes(runs=1, tp2_keys=12, tp1_keys=8, small_keys=200, kernel_mib=8,
                  enum_keys=2000, enum_runs=1),
}


@dataclass
class Row:
    """One line of the result table: a measurement repeated `len(seconds)` times."""

    section: str
    name: str
    keys: int
    nbytes: int
    seconds: list[float] = field(default_factory=list)
    rss_mib: float | None = None   # peak RSS of the measured process, where it was measured alone
    note: str = ""
    cpu_self: list[float] = field(default_factory=list)     # CPU seconds of this process per run
    cpu_daemons: list[float] = field(default_factory=list)  # CPU seconds of the cluster's daemons per run

    def cpu_note(self) -> str:
        """Average cores kept busy: shows whether the machine had CPU to spare for overlap."""
        if not self.cpu_self:
            return ""
        wall = sum(self.seconds)
        return (f"cores busy: auditor {sum(self.cpu_self) / wall:.2f}"
                + (f" + daemons {sum(self.cpu_daemons) / wall:.2f}" if self.cpu_daemons else ""))

    @property
    def best(self) -> float:
        return min(self.seconds)

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def worst(self) -> float:
        return max(self.seconds)

    def gbps(self, seconds: float) -> float | None:
        return self.nbytes / seconds / 1e9 if self.nbytes and seconds > 0 else None

    def keys_per_s(self, seconds: float) -> float | None:
        return self.keys / seconds if self.keys and seconds > 0 else None


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    started = time.perf_counter()
    result = fn()
    return time.perf_counter() - started, result


_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of other processes so far (Linux /proc), 0 where unreadable."""
    total = 0.0
    for pid in pids:
        with contextlib.suppress(OSError, IndexError, ValueError):  # a process gone meanwhile counts 0
            with open(f"/proc/{pid}/stat") as handle:
                fields_ = handle.read().rsplit(")", 1)[1].split()
            total += (int(fields_[11]) + int(fields_[12])) / _TICK  # utime, stime
    return total


def own_cpu_seconds() -> float:
    usage = os.times()
    return usage.user + usage.system


def _proc_line_value(path: str, prefix: str, parse):
    """`parse` of the first line of a /proc file starting with `prefix`; None where unreadable."""
    with contextlib.suppress(OSError):
        with open(path) as handle:
            for line in handle:
                if line.startswith(prefix):
                    return parse(line)
    return None


def machine() -> dict:
    model = platform.processor() or "unknown"
    model = _proc_line_value("/proc/cpuinfo", "model name", lambda line: line.split(":", 1)[1].strip()) or model
    mem_gib = _proc_line_value("/proc/meminfo", "MemTotal:", lambda line: int(line.split()[1]) / (1 << 20))
    import xxhash
    try:
        from importlib.metadata import version
        mooncake = version("mooncake-transfer-engine-non-cuda")
    except Exception:  # noqa: BLE001 - the CUDA wheel, or none
        mooncake = "unknown"
    return {
        "nproc": os.cpu_count(),
        "cpu": model,
        "ram_gib": None if mem_gib is None else round(mem_gib, 1),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "xxhash": getattr(xxhash, "VERSION", "?"),
        "mooncake": mooncake,
        "kernel": platform.release(),
        "loadavg_start": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }


def fmt(value: float | None, digits: int = 2) -> str:
    if value is None:
        return "-"
    if value >= 1000:
        return f"{value:,.0f}"
    return f"{value:.{digits}f}"


HEADER = ["section", "measurement", "keys", "MB", "runs", "s min", "s median", "s max",
          "GB/s best", "GB/s median", "keys/s median", "peak RSS MiB", "note"]


def table(rows: list[Row]) -> list[list[str]]:
    lines = []
    for row in rows:
        lines.append([
            row.section, row.name, f"{row.keys:,}" if row.keys else "-",
            fmt(row.nbytes / 1e6, 1) if row.nbytes else "-", str(len(row.seconds)),
            fmt(row.best, 3), fmt(row.median, 3), fmt(row.worst, 3),
            fmt(row.gbps(row.best)), fmt(row.gbps(row.median)), fmt(row.keys_per_s(row.median), 0),
            fmt(row.rss_mib, 0), "; ".join(part for part in (row.cpu_note(), row.note) if part),
        ])
    return lines


def markdown_table(header: list[str], lines: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(cell.replace("|", "\\|") for cell in line) + " |" for line in lines]
    return "\n".join(out)


def text_table(header: list[str], lines: list[list[str]]) -> str:
    widths = [max(len(header[i]), *(len(line[i]) for line in lines)) if lines else len(header[i])
              for i in range(len(header))]
    def one(cells):
        return "  ".join(cell.ljust(widths[i]) if i < 2 or i == len(cells) - 1 else cell.rjust(widths[i])
                         for i, cell in enumerate(cells)).rstrip()
    return "\n".join([one(header), one(["-" * w for w in widths]), *(one(line) for line in lines)])


def state_like(rng: np.random.Generator, nbytes: int) -> np.ndarray:
    """Every byte of a bf16 state: small normal values (|x| ~ 0.05), no exact zeros to speak of."""
    values = rng.standard_normal((nbytes + 1) // 2, dtype=np.float32) * 0.05
    bf16 = (values.view(np.uint32) >> 16).astype(np.uint16)
    return bf16.view(np.uint8)[:nbytes].copy()


def stamp(slot: np.ndarray, index: int) -> None:
    """Make the value unique (no SHARED_CONTENT among benchmark keys): its first four bf16
    elements become small finite numbers (exponent 0x78) carrying 28 bits of the index."""
    lanes = np.array([0x3C00 | ((index >> (7 * k)) & 0x7F) for k in range(4)], np.uint16)
    slot[:8] = lanes.view(np.uint8)
