"""What an LMCache value says about itself, checked against its size and its key: the header
before a Mooncake connector's value, or the checksum frame around a multiprocess L2 value; and the
layout its bytes are then checked with (one region per layer and K/V half of each group)."""

from __future__ import annotations

from functools import lru_cache

from audit.layouts.model import DTYPE_SIZES, Layout, Region, Segment
from audit.producers.base import Disagreement, ValueReading
from audit.producers.lmcache.checksum_frame import FRAME_BYTES, read_frame
from audit.producers.lmcache.header import (FIXED_BYTES, FORMATS, GROUP_BYTES, KEY_DTYPES, KV_FORMATS, MAX_GROUPS,
                                            Group, Header, read_header)

HEAD_BYTES = FIXED_BYTES + GROUP_BYTES * MAX_GROUPS


def read_lmcache_value(fields: dict, value) -> ValueReading | None:
    """An ObjectKey's value may be a checksum frame; any other LMCache key's may start with a header."""
    if "kv_rank" in fields:
        return _read_frame(fields, value)
    return _read_header(fields, value)


def _read_header(fields: dict, value) -> ValueReading | None:
    size = len(value)
    header = read_header(bytes(value[:HEAD_BYTES]), size)
    if header is None:
        return None
    disagreements = []
    if header.shape_bytes != header.length or header.nbytes + header.length != size:
        disagreements.append(Disagreement("size", {
            "value_size": size, "header_bytes": header.nbytes, "header_length": header.length,
            "shape_bytes": header.shape_bytes, "expected_size": header.nbytes + header.shape_bytes}))
    key_dtype = KEY_DTYPES.get(fields.get("dtype"))
    if header.fmt in KV_FORMATS and key_dtype and all(group.dtype != key_dtype for group in header.groups):
        disagreements.append(Disagreement("identity", {
            "key_dtype": fields["dtype"], "header_dtypes": [group.dtype for group in header.groups]}))
    sized = not any(disagreement.kind == "size" for disagreement in disagreements)
    layout = _header_layout(header, fields.get("layer", 0), max(fields.get("world_size", 1), 1)) if sized else None
    return ValueReading(layout, {"header": header.describe()}, tuple(disagreements))


def _read_frame(fields: dict, value) -> ValueReading | None:
    frame = read_frame(value, fields["chunk_hash"])
    if frame is None:
        return None
    disagreements = []
    if not frame.fingerprint_matches:
        disagreements.append(Disagreement("identity", {"frame_fingerprint": frame.fingerprint.hex(),
                                                       "key_fingerprint": frame.expected_fingerprint.hex()}))
    if not frame.digest_matches:
        disagreements.append(Disagreement("checksum", {"stored_xxh3": f"{frame.stored_xxh3:016x}",
                                                       "payload_xxh3": f"{frame.payload_xxh3:016x}"}))
    layout = _frame_layout(len(value), max(fields.get("world_size", 1), 1)) if len(value) > FRAME_BYTES else None
    return ValueReading(layout, {"checksum_frame": frame.describe()}, tuple(disagreements))


def _runs(fmt: int, group: Group, layer: int):
    """(name, layer, shape) of each contiguous run of a group's tensor, in byte order."""
    shape = group.shape
    if fmt == 1 and len(shape) == 4 and shape[0] == 2:      # KV_2LTD [2, layers, tokens, hidden]
        for half in ("k", "v"):
            for index in range(shape[1]):
                yield half, index, shape[2:]
    elif fmt == 6 and len(shape) == 4 and shape[0] == 1:    # KV_MLA_FMT [1, layers, tokens, latent]
        for index in range(shape[1]):
            yield "kv", index, shape[2:]
    elif fmt == 3 and len(shape) == 3 and shape[0] == 2:    # KV_2TD [2, tokens, hidden]: one layer
        yield "k", layer, shape[1:]
        yield "v", layer, shape[1:]
    else:                                                   # KV_T2D interleaves K and V per token
        yield "kv" if fmt in KV_FORMATS else "payload", layer, shape


def _region(name: str, kind: str, offset: int, dtype: str, shape: tuple[int, ...], itemsize: int) -> Region:
    length = itemsize
    for dim in shape:
        length *= dim
    if dtype not in DTYPE_SIZES:  # float64 and uint8 tensors: checked as bytes (zero, digest)
        return Region(name, kind, offset, length, "raw", (length,))
    return Region(name, kind, offset, length, dtype, shape)


def _segments(runs) -> tuple[Segment, ...]:
    segments = []
    offset = 0
    for name, layer, region in runs:
        segments.append(Segment(len(segments), name, layer, offset, region.length, (region,)))
        offset += region.length
    return tuple(segments)


@lru_cache(maxsize=256)
def _header_layout(header: Header, layer: int, world_size: int) -> Layout:
    """One layout per distinct header (cached: the checker plans each layout once)."""
    runs = [("header", -1, Region("header", "header", 0, header.nbytes, "raw", (header.nbytes,)))]
    offset = header.nbytes
    many = len(header.groups) > 1
    for index, group in enumerate(header.groups):
        for name, layer_index, shape in _runs(header.fmt, group, layer):
            region = _region(name, "kv", offset, group.dtype, tuple(shape), group.itemsize)
            prefix = f"group{index}." if many else ""
            runs.append((f"{prefix}{name}.layers.{layer_index}", layer_index, region))
            offset += region.length
    return Layout(f"lmcache {FORMATS[header.fmt]}", None, "attention", world_size, _segments(runs))


@lru_cache(maxsize=64)
def _frame_layout(size: int, world_size: int) -> Layout:
    payload = size - FRAME_BYTES
    runs = [("frame", -1, Region("frame", "header", 0, FRAME_BYTES, "raw", (FRAME_BYTES,))),
            ("payload", 0, Region("payload", "kv", FRAME_BYTES, payload, "raw", (payload,)))]
    return Layout("lmcache checksum serde", None, "attention", world_size, _segments(runs))
