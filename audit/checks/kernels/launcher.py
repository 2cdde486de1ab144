"""``check_regions``: the regions the kernel hashes exactly go to one kernel launch per float
layout, the rest to the host (the ``xxhash`` package); results come back in input order."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from functools import cache

import numpy as np
import torch
import xxhash
from triton.runtime.interpreter import InterpretedFunction

from audit.checks.floats import FLOAT_DTYPES, count_nonfinite
from audit.checks.types import RegionCheck, make_region_check
from audit.checks.kernels import xxh3_constants as xc
from audit.checks.kernels.float_masks import float_word_masks
from audit.checks.kernels.region_kernel import region_check_kernel

DTYPES = frozenset({"raw", "uint8", "int8", "int32", "int64", *FLOAT_DTYPES})

# Eight 1 KiB blocks per loop step: 8 KiB of loads in flight per program on a GPU, and fewer,
# wider tensor operations under the interpreter. Larger steps mostly add masked work.
BLOCKS_PER_STEP = 8


@cache
def _secret_table(device: torch.device) -> torch.Tensor:
    return torch.from_numpy(xc.secret_table()).to(device)


def launch_region_kernel(
    buf: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor, layout: str, out: torch.Tensor
) -> None:
    """Enqueue the kernel for regions that all qualify (see ``check_regions``) and share a float
    layout (a float dtype name, or "raw" for none). Writes ``out[i] = (xxh3 bits, zero, nan, inf)``;
    no synchronisation, so benchmarks can time the kernel alone."""
    with torch.cuda.device(buf.device) if buf.is_cuda else nullcontext():
        region_check_kernel[(len(starts),)](
            buf, starts, lengths, _secret_table(buf.device), out,
            BLOCKS_PER_STEP=BLOCKS_PER_STEP, **float_word_masks(layout),
        )


def _validate(buf: torch.Tensor, offsets: np.ndarray, lengths: np.ndarray, dtypes: list[str]) -> None:
    if buf.dtype != torch.uint8 or buf.dim() != 1 or not buf.is_contiguous():
        raise ValueError(f"buf must be a contiguous 1-D uint8 tensor, got {buf.dtype} {tuple(buf.shape)}")
    if buf.device.type == "cpu" and not isinstance(region_check_kernel, InterpretedFunction):
        raise ValueError("a CPU buffer needs TRITON_INTERPRET=1 set before audit.checks.kernels is imported")
    if not len(offsets) == len(lengths) == len(dtypes):
        raise ValueError("offsets, lengths and dtypes must have the same length")
    outside = (offsets < 0) | (lengths < 0) | (offsets + lengths > buf.numel())
    if outside.any():
        i = int(np.argmax(outside))
        raise ValueError(f"region [{offsets[i]}, +{lengths[i]}) is outside the {buf.numel()}-byte buffer")
    unknown = set(dtypes) - DTYPES
    if unknown:
        raise ValueError(f"unknown dtypes {sorted(unknown)}; expected one of {sorted(DTYPES)}")


def _check_on_host(data: np.ndarray, dtype: str) -> RegionCheck:
    nan, inf = count_nonfinite(data, dtype)
    return RegionCheck(xxhash.xxh3_64_intdigest(data), not data.any(), nan, inf)


def check_regions(
    buf: torch.Tensor, offsets: Sequence[int], lengths: Sequence[int], dtypes: Sequence[str]
) -> list[RegionCheck]:
    """XXH3-64, all-zero flag and NaN/Inf counts of each region ``buf[offset:offset+length]``.

    ``buf`` is a contiguous uint8 tensor on CUDA (or CPU under TRITON_INTERPRET=1). Results are
    identical to ``xxhash.xxh3_64_intdigest`` and ``audit.checks.floats.count_nonfinite``. The
    kernel implements XXH3's long-input algorithm on aligned 64-bit words, so regions of at most
    240 bytes, or whose length or start address is not a multiple of 8, are checked on the host.
    """
    offsets = np.asarray(offsets, dtype=np.int64).reshape(-1)
    lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
    dtypes = list(dtypes)
    _validate(buf, offsets, lengths, dtypes)
    results: list[RegionCheck | None] = [None] * len(offsets)

    in_kernel = (lengths > xc.MIDSIZE_MAX) & (lengths % 8 == 0) & ((buf.data_ptr() + offsets) % 8 == 0)
    on_host = np.flatnonzero(~in_kernel)
    if len(on_host):  # one device-to-host copy for all of them
        pieces = [buf[offsets[i]:offsets[i] + lengths[i]] for i in on_host]
        host_bytes = torch.cat(pieces).cpu().numpy()
        ends = np.cumsum(lengths[on_host])
        for i, end in zip(on_host, ends):
            results[i] = _check_on_host(host_bytes[end - lengths[i]:end], dtypes[i])

    # Per-region work stays in numpy until the results are made: at 64 KiB a region is checked in
    # tens of nanoseconds on an H200, so host bookkeeping, not the kernel, sets the pace.
    names, inverse = np.unique(np.asarray(dtypes, dtype=object).astype(str), return_inverse=True)
    layouts = np.array([name if name in FLOAT_DTYPES else "raw" for name in names])[inverse.reshape(-1)]
    kernel_layouts = sorted(set(layouts[in_kernel].tolist()))
    groups = {layout: np.flatnonzero(in_kernel & (layouts == layout)) for layout in kernel_layouts}
    if groups:
        order = np.concatenate(list(groups.values()))
        spans = torch.from_numpy(np.stack([offsets[order], lengths[order]])).to(buf.device)
        out = torch.empty((len(order), 4), dtype=torch.int64, device=buf.device)
        first = 0
        for layout, group in groups.items():
            last = first + len(group)
            launch_region_kernel(buf, spans[0, first:last], spans[1, first:last], layout, out[first:last])
            first = last
        found = out.cpu().numpy()
        made = list(map(make_region_check, found[:, 0].view(np.uint64).tolist(), found[:, 1].astype(bool).tolist(),
                        found[:, 2].tolist(), found[:, 3].tolist()))
        placed = np.empty(len(results), dtype=object)
        placed[:] = results
        placed[order] = made
        results = placed.tolist()
    return results
