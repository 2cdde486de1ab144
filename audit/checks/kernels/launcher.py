"""``check_regions`` and ``check_region_readings``: the regions the kernel hashes exactly go to one
kernel launch per set of float dtypes counted (one dtype, or every dtype a region may be read as),
the rest to the host (the ``xxhash`` package); results come back in input order."""

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
from audit.checks.kernels.float_masks import mask_table
from audit.checks.kernels.region_kernel import region_check_kernel

DTYPES = frozenset({"raw", "uint8", "int8", "int32", "int64", *FLOAT_DTYPES})

# Eight 1 KiB blocks per loop step: 8 KiB of loads in flight per program on a GPU, and fewer,
# wider tensor operations under the interpreter. Larger steps mostly add masked work.
BLOCKS_PER_STEP = 8


@cache
def _secret_table(device: torch.device) -> torch.Tensor:
    return torch.from_numpy(xc.secret_table()).to(device)


def counted_dtypes(dtypes: Sequence[str]) -> tuple[str, ...]:
    """The float dtypes among `dtypes`, once each, in order: what a launch counts NaN/Inf for."""
    return tuple(dict.fromkeys(dtype for dtype in dtypes if dtype in FLOAT_DTYPES))


def _rows(counted: tuple[str, ...]) -> int:
    """Mask rows for `counted`: a power of two (the kernel's tl.arange), at least one."""
    return 1 << max(len(counted) - 1, 0).bit_length()


@cache
def _mask_table(counted: tuple[str, ...], device: torch.device) -> torch.Tensor:
    return torch.from_numpy(mask_table(counted, _rows(counted))).to(device)


def launch_region_kernel(
    buf: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor, dtypes: str | Sequence[str], out: torch.Tensor
) -> None:
    """Enqueue the kernel for regions that all qualify (see ``check_regions``) and are read as the
    same dtypes (`dtypes`: one name, or every name the regions may be read as; only float dtypes
    are counted). Writes ``out[i] = (xxh3 bits, zero, then two counts per counted dtype)`` (see
    ``region_kernel``; one float dtype with Inf: xxh3, zero, nan, inf); ``out`` has a row of at
    least ``2 + 2 * rows`` elements. No synchronisation, so benchmarks can time the kernel alone."""
    counted = counted_dtypes((dtypes,) if isinstance(dtypes, str) else dtypes)
    with torch.cuda.device(buf.device) if buf.is_cuda else nullcontext():
        region_check_kernel[(len(starts),)](
            buf, starts, lengths, _secret_table(buf.device), _mask_table(counted, buf.device), out, out.stride(0),
            BLOCKS_PER_STEP=BLOCKS_PER_STEP, READINGS=_rows(counted), COUNT=bool(counted),
        )


def _validate_tensor(buf: torch.Tensor) -> None:
    if buf.dtype != torch.uint8 or buf.dim() != 1 or not buf.is_contiguous():
        raise ValueError(f"buf must be a contiguous 1-D uint8 tensor, got {buf.dtype} {tuple(buf.shape)}")
    if buf.device.type == "cpu" and not isinstance(region_check_kernel, InterpretedFunction):
        raise ValueError("a CPU buffer needs TRITON_INTERPRET=1 set before audit.checks.kernels is imported")


def _validate(buf: torch.Tensor, offsets: np.ndarray, lengths: np.ndarray, dtypes: list) -> None:
    _validate_tensor(buf)
    if not len(offsets) == len(lengths) == len(dtypes):
        raise ValueError("offsets, lengths and dtypes must have the same length")
    _validate_bounds(offsets, lengths, buf.numel())


def _validate_bounds(offsets: np.ndarray, lengths: np.ndarray, sizes) -> None:
    """Every region within its buffer of `sizes` bytes (one size, or one per region)."""
    outside = (offsets < 0) | (lengths < 0) | (offsets + lengths > sizes)
    if outside.any():
        i = int(np.argmax(outside))
        size = sizes if np.ndim(sizes) == 0 else sizes[i]
        raise ValueError(f"region [{offsets[i]}, +{lengths[i]}) is outside the {size}-byte buffer")


def _known(dtypes: set) -> None:
    unknown = dtypes - DTYPES
    if unknown:
        raise ValueError(f"unknown dtypes {sorted(unknown)}; expected one of {sorted(DTYPES)}")


def _check_on_host(data: np.ndarray, dtypes: tuple[str, ...]) -> tuple[RegionCheck, ...]:
    digest, zero = xxhash.xxh3_64_intdigest(data), not data.any()
    return tuple(RegionCheck(digest, zero, *count_nonfinite(data, dtype)) for dtype in dtypes)


def _checked(buf: torch.Tensor, offsets: np.ndarray, lengths: np.ndarray, readings: list[tuple[str, ...]],
             kind: np.ndarray, piece=None) -> tuple[list, list]:
    """Region i read as each dtype of ``readings[kind[i]]``, its bytes read once for all of them:
    on the host (a tuple of RegionChecks per region there, None elsewhere), or in one launch per
    set of counted dtypes: (counted dtypes, region indexes, the kernel's rows) per launch. The
    kernel reads region i at ``buf``'s address plus ``offsets[i]``; ``piece(i)`` is its bytes as a
    tensor (default: that slice of ``buf``)."""
    results: list = [None] * len(offsets)
    in_kernel = (lengths > xc.MIDSIZE_MAX) & (lengths % 8 == 0) & ((buf.data_ptr() + offsets) % 8 == 0)
    on_host = np.flatnonzero(~in_kernel)
    if len(on_host):  # one device-to-host copy for all of them
        pieces = [piece(i) if piece is not None else buf[offsets[i]:offsets[i] + lengths[i]] for i in on_host]
        host_bytes = torch.cat(pieces).cpu().numpy()
        ends = np.cumsum(lengths[on_host])
        for i, end in zip(on_host, ends):
            results[i] = _check_on_host(host_bytes[end - lengths[i]:end], readings[kind[i]])

    # Per-region work stays in numpy until the results are made: at 64 KiB a region is checked in
    # tens of nanoseconds on an H200, so host bookkeeping, not the kernel, sets the pace.
    launches: dict[tuple, list[int]] = {}  # counted dtypes -> the kinds counted so
    for number, dtypes in enumerate(readings):
        launches.setdefault(counted_dtypes(dtypes), []).append(number)
    groups = [(counted, np.flatnonzero(in_kernel & np.isin(kind, kinds))) for counted, kinds in launches.items()]
    groups = [(counted, group) for counted, group in groups if len(group)]
    if not groups:
        return results, []
    order = np.concatenate([group for _, group in groups])
    spans = torch.from_numpy(np.stack([offsets[order], lengths[order]])).to(buf.device)
    out = torch.empty((len(order), 2 + 2 * max(_rows(counted) for counted, _ in groups)), dtype=torch.int64,
                      device=buf.device)
    first = 0
    for counted, group in groups:
        last = first + len(group)
        launch_region_kernel(buf, spans[0, first:last], spans[1, first:last], counted, out[first:last])
        first = last
    found, first, launched = out.cpu().numpy(), 0, []
    for counted, group in groups:
        launched.append((counted, group, found[first:first + len(group)]))
        first += len(group)
    return results, launched


def _nan_inf(rows: np.ndarray, counted: tuple[str, ...], dtype: str) -> tuple[list, list]:
    """NaN and Inf counts of `dtype` from the kernel's rows of a launch that counted `counted`."""
    if dtype not in counted:
        return [0] * len(rows), [0] * len(rows)
    column = counted.index(dtype)
    flagged, rest = rows[:, 2 + 2 * column].tolist(), rows[:, 3 + 2 * column].tolist()
    return (flagged, rest) if FLOAT_DTYPES[dtype].has_inf else (rest, [0] * len(rows))


def _head(rows: np.ndarray) -> tuple[list, list]:
    """Digests and zero flags of the kernel's rows."""
    return rows[:, 0].view(np.uint64).tolist(), rows[:, 1].astype(bool).tolist()


def _arrays(offsets, lengths) -> tuple[np.ndarray, np.ndarray]:
    return np.asarray(offsets, dtype=np.int64).reshape(-1), np.asarray(lengths, dtype=np.int64).reshape(-1)


def check_regions(
    buf: torch.Tensor, offsets: Sequence[int], lengths: Sequence[int], dtypes: Sequence[str]
) -> list[RegionCheck]:
    """XXH3-64, all-zero flag and NaN/Inf counts of each region ``buf[offset:offset+length]``.

    ``buf`` is a contiguous uint8 tensor on CUDA (or CPU under TRITON_INTERPRET=1). Results are
    identical to ``xxhash.xxh3_64_intdigest`` and ``audit.checks.floats.count_nonfinite``. The
    kernel implements XXH3's long-input algorithm on aligned 64-bit words, so regions of at most
    240 bytes, or whose length or start address is not a multiple of 8, are checked on the host.
    """
    offsets, lengths = _arrays(offsets, lengths)
    dtypes = list(dtypes)
    _validate(buf, offsets, lengths, dtypes)
    return _single_checks(*_checked(buf, offsets, lengths, *_single_readings(dtypes)))


def _single_readings(dtypes: list[str]) -> tuple[list[tuple[str]], np.ndarray]:
    """`_checked`'s readings and kinds for regions each read as one dtype."""
    names, inverse = np.unique(np.asarray(dtypes, dtype=object).astype(str), return_inverse=True)
    names = names.tolist()
    _known(set(names))
    return [(name,) for name in names], inverse.reshape(-1)


def _single_checks(host: list, launched: list) -> list[RegionCheck]:
    """`_checked`'s results of regions each read as one dtype: a RegionCheck each, in input order."""
    results = np.empty(len(host), dtype=object)
    results[:] = [None if checks is None else checks[0] for checks in host]
    for counted, group, rows in launched:  # one dtype per region: a launch's rows share it
        dtype = counted[0] if counted else "raw"
        results[group] = list(map(make_region_check, *_head(rows), *_nan_inf(rows, counted, dtype)))
    return results.tolist()


def region_flags_across(
    views: Sequence[torch.Tensor], slots: Sequence[int], offsets: Sequence[int], lengths: Sequence[int],
    dtypes: Sequence[str],
) -> tuple[np.ndarray, np.ndarray]:
    """(all zero, holds NaN or Inf as its dtype) of each region of several uint8 tensors on one
    device (a KV cache's storages, a tensor a layer), as bool arrays: region i is
    ``views[slots[i]][offsets[i]:offsets[i]+lengths[i]]``, checked against its own view's bounds.
    The kernel takes them all in one launch per dtype, addressed from the lowest view's start, not
    one launch per view (a launch costs a few hundred microseconds of Python, and a batch's values
    span every layer); the answers stay arrays (what the load guard asks, region by region)."""
    offsets, lengths = _arrays(offsets, lengths)
    slots, dtypes = np.asarray(slots, dtype=np.int64).reshape(-1), list(dtypes)
    zero, nonfinite = np.zeros(len(offsets), dtype=bool), np.zeros(len(offsets), dtype=bool)
    if not len(offsets):
        return zero, nonfinite
    for view in views:  # each tensor's own kind; the regions' bounds below, at once
        _validate_tensor(view)
    if not len(slots) == len(offsets) == len(lengths) == len(dtypes):
        raise ValueError("slots, offsets, lengths and dtypes must have the same length")
    _validate_bounds(offsets, lengths, np.array([view.numel() for view in views], dtype=np.int64)[slots])
    anchor = min(views, key=lambda view: view.data_ptr())
    if any(view.device != anchor.device for view in views):
        raise ValueError("the views lie on more than one device")
    starts = np.array([view.data_ptr() - anchor.data_ptr() for view in views], dtype=np.int64)[slots] + offsets
    readings, kind = _single_readings(dtypes)
    host, launched = _checked(anchor, starts, lengths, readings, kind,
                              lambda i: views[slots[i]][offsets[i]:offsets[i] + lengths[i]])
    for i, checks in enumerate(host):
        if checks is not None:
            zero[i], nonfinite[i] = checks[0].zero, bool(checks[0].nan or checks[0].inf)
    for counted, group, rows in launched:  # one dtype per region: a launch's rows share it
        zero[group] = rows[:, 1] != 0
        if counted:
            nan, inf = _nan_inf(rows, counted, counted[0])
            nonfinite[group] = (np.asarray(nan) + np.asarray(inf)) > 0
    return zero, nonfinite


def check_region_readings(
    buf: torch.Tensor, offsets: Sequence[int], lengths: Sequence[int], readings: Sequence[tuple[str, ...]]
) -> list[tuple[RegionCheck, ...]]:
    """``check_regions`` for regions that may be read several ways: region i as each dtype of
    ``readings[i]``, one RegionCheck per dtype, its bytes read and hashed once for all of them
    (every float dtype of a region counted in the same launch)."""
    offsets, lengths = _arrays(offsets, lengths)
    _validate(buf, offsets, lengths, readings)
    kinds: dict[tuple, int] = {}
    kind = np.array([kinds.setdefault(tuple(dtypes), len(kinds)) for dtypes in readings], dtype=np.int64)
    _known({dtype for dtypes in kinds for dtype in dtypes})
    every = list(kinds)
    results, launched = _checked(buf, offsets, lengths, every, kind)
    for counted, group, rows in launched:
        digests, zeros = _head(rows)
        columns = {dtype: _nan_inf(rows, counted, dtype) for dtype in {d for k in set(kind[group].tolist())
                                                                       for d in every[k]}}
        for position, region in enumerate(group.tolist()):
            results[region] = tuple(make_region_check(digests[position], zeros[position], columns[dtype][0][position],
                                                      columns[dtype][1][position])
                                    for dtype in every[kind[region]])
    return results
