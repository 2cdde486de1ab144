"""``check_regions``: one kernel launch per float layout for the regions the kernel hashes exactly,
the host (the ``xxhash`` package) for the rest, results in input order."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from functools import cache

import numpy as np
import torch
import xxhash
from triton.runtime.interpreter import InterpretedFunction

from audit.checks.floats import FLOAT_DTYPES, count_nonfinite
from audit.checks.types import RegionCheck
from audit.kernels import xxh3_constants as xc
from audit.kernels.float_masks import float_word_masks
from audit.kernels.region_kernel import region_check_kernel

DTYPES = frozenset({"raw", "uint8", "int8", "int32", "int64", *FLOAT_DTYPES})

# Eight 1 KiB blocks per loop step: 64 KiB in flight per program on a GPU; fewer, wider tensor
# operations under the interpreter. Larger steps mostly add masked work for small regions.
BLOCKS_PER_STEP = 8


def _runs_in_kernel(address: int, length: int) -> bool:
    """The kernel implements only XXH3's long-input algorithm, on whole aligned 64-bit words."""
    return length > xc.MIDSIZE_MAX and length % 8 == 0 and address % 8 == 0


def _check_on_host(data: np.ndarray, dtype: str) -> RegionCheck:
    nan, inf = count_nonfinite(data, dtype)
    return RegionCheck(xxhash.xxh3_64_intdigest(data), not data.any(), nan, inf)


@cache
def _secret_table(device: torch.device) -> torch.Tensor:
    return torch.from_numpy(xc.secret_table()).to(device)


def _validate(buf: torch.Tensor, offsets, lengths, dtypes) -> None:
    if buf.dtype != torch.uint8 or buf.dim() != 1 or not buf.is_contiguous():
        raise ValueError(f"buf must be a contiguous 1-D uint8 tensor, got {buf.dtype} {tuple(buf.shape)}")
    if not len(offsets) == len(lengths) == len(dtypes):
        raise ValueError("offsets, lengths and dtypes must have the same length")
    if buf.device.type == "cpu" and not isinstance(region_check_kernel, InterpretedFunction):
        raise ValueError("a CPU buffer needs TRITON_INTERPRET=1 set before audit.kernels is imported")
    for offset, length, dtype in zip(offsets, lengths, dtypes):
        if offset < 0 or length < 0 or offset + length > buf.numel():
            raise ValueError(f"region [{offset}, +{length}) is outside the {buf.numel()}-byte buffer")
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(DTYPES)}")


def check_regions(
    buf: torch.Tensor, offsets: Sequence[int], lengths: Sequence[int], dtypes: Sequence[str]
) -> list[RegionCheck]:
    """XXH3-64, all-zero flag and NaN/Inf counts of each region ``buf[offset:offset+length]``.

    ``buf`` is a contiguous uint8 tensor on CUDA (or CPU under TRITON_INTERPRET=1). The result is
    bit-identical to ``xxhash.xxh3_64_intdigest`` and ``audit.checks.floats.count_nonfinite``.
    """
    offsets, lengths, dtypes = [int(o) for o in offsets], [int(n) for n in lengths], list(dtypes)
    _validate(buf, offsets, lengths, dtypes)
    results: list[RegionCheck | None] = [None] * len(offsets)

    base = buf.data_ptr()
    kernel_regions = [i for i in range(len(offsets)) if _runs_in_kernel(base + offsets[i], lengths[i])]
    host_regions = sorted(set(range(len(offsets))) - set(kernel_regions))
    if host_regions:  # one device-to-host copy for all of them
        host_bytes = torch.cat([buf[offsets[i]:offsets[i] + lengths[i]] for i in host_regions]).cpu().numpy()
        start = 0
        for i in host_regions:
            results[i] = _check_on_host(host_bytes[start:start + lengths[i]], dtypes[i])
            start += lengths[i]

    if kernel_regions:
        # One launch per float layout, which is compiled in; all non-float dtypes share one.
        groups: dict[str, list[int]] = {}
        for i in kernel_regions:
            groups.setdefault(dtypes[i] if dtypes[i] in FLOAT_DTYPES else "raw", []).append(i)
        order = [i for group in groups.values() for i in group]
        spans = torch.tensor([[offsets[i] for i in order], [lengths[i] for i in order]], device=buf.device)
        out = torch.empty((len(order), 4), dtype=torch.int64, device=buf.device)
        secret = _secret_table(buf.device)
        first = 0
        with torch.cuda.device(buf.device) if buf.is_cuda else nullcontext():
            for layout, group in groups.items():
                last = first + len(group)
                region_check_kernel[(len(group),)](
                    buf, spans[0, first:last], spans[1, first:last], secret, out[first:last],
                    BLOCKS_PER_STEP=BLOCKS_PER_STEP, **float_word_masks(layout),
                )
                first = last
        for i, (digest, zero, nan, inf) in zip(order, out.cpu().tolist()):
            results[i] = RegionCheck(digest & 0xFFFFFFFFFFFFFFFF, bool(zero), nan, inf)
    return results
