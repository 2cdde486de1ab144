"""What an LMCache value says about itself, checked against its size and its key: the header
before a Mooncake connector's value, or the checksum frame around a multiprocess L2 value; and the
layout its bytes are then checked with (one region per layer and K/V half of each group). A value
without a header (`save_chunk_meta: false`) is read by its model's config (`read_headerless_value`)."""

from __future__ import annotations

from functools import lru_cache

from audit.layouts.config_shapes import attention_kv_shape
from audit.layouts.model import DTYPE_SIZES, Layout, Region, Segment
from audit.producers.base import Disagreement, ValueReading
from audit.producers.lmcache.checksum_frame import FRAME_BYTES, read_frame
from audit.producers.lmcache.header import (FIXED_BYTES, FORMATS, GROUP_BYTES, KEY_DTYPES, KV_FORMATS, MAX_GROUPS,
                                            Group, Header, read_header)

HEAD_BYTES = FIXED_BYTES + GROUP_BYTES * MAX_GROUPS
_ITEMSIZES = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "uint8": 1, "float8_e4m3fn": 1,
              "float8_e5m2": 1}


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


def kv_shape(config: dict, world_size: int) -> tuple[int, int, int] | None:
    """(layers, KV heads per worker, head dim) of a plain attention model's config, as LMCache's
    vLLM connector sizes a worker's KV (vLLM replicates heads above the head count); None for
    what it does not describe so (see `attention_kv_shape`)."""
    shape = attention_kv_shape(config)
    if shape is None:
        return None
    layers, heads, head_dim = shape
    return layers, max(1, heads // max(world_size, 1)), head_dim


def read_headerless_value(fields: dict, value, config: dict) -> ValueReading | None:
    """A value without a header read as the KV its key's model config says (`KV_2LTD` `[2, layers,
    tokens, kv_heads_per_rank * head_dim]` in the key's dtype; one layer's `[tokens, 2, hidden]` for a
    layerwise key). Its size must be a whole number of tokens: any number, as LMCache's
    `chunk_size` (256 by default) is not in its key, and a prompt's last chunk may be short. None
    where the config or the key cannot say (see `kv_shape`; ObjectKeys, keys without a dtype
    LMCache's reader knows)."""
    dtype = KEY_DTYPES.get(fields.get("dtype"))
    world_size = max(fields.get("world_size", 1), 1)
    shape = None if "kv_rank" in fields or dtype is None else kv_shape(config, world_size)
    if shape is None:
        return None
    layers, heads, head_dim = shape
    layerwise = "layer" in fields
    stored_layers = 1 if layerwise else layers
    itemsize = _ITEMSIZES[dtype]
    per_token = 2 * stored_layers * heads * head_dim * itemsize
    size = len(value)
    tokens, rest = divmod(size, per_token)
    described = {"format": "KV_T2D" if layerwise else "KV_2LTD", "dtype": dtype, "layers": layers,
                 "kv_heads_per_rank": heads, "head_dim": head_dim, "bytes_per_token": per_token}
    if rest or not tokens:
        evidence = {"value_size": size, "bytes_per_token": per_token, "tokens": round(size / per_token, 3),
                    "expected_size": f"a positive multiple of {per_token}"}
        return ValueReading(None, {"headerless": described}, (Disagreement("size", evidence),))
    hidden = heads * head_dim
    described["shape"] = [tokens, 2, hidden] if layerwise else [2, layers, tokens, hidden]
    layout = _headerless_layout(layerwise, fields.get("layer", 0), layers, tokens, hidden, dtype, world_size)
    return ValueReading(layout, {"headerless": described})


@lru_cache(maxsize=256)
def _headerless_layout(layerwise: bool, layer: int, layers: int, tokens: int, hidden: int, dtype: str,
                       world_size: int) -> Layout:
    """The regions a header of that shape would give, without the header's."""
    itemsize = _ITEMSIZES[dtype]
    if layerwise:
        runs = [("kv", layer, (tokens, 2, hidden))]
        fmt = "KV_T2D"
    else:
        runs = [(half, index, (tokens, hidden)) for half in ("k", "v") for index in range(layers)]
        fmt = "KV_2LTD"
    regions, offset = [], 0
    for name, index, shape in runs:
        region = _region(name, "kv", offset, dtype, shape, itemsize)
        regions.append((f"{name}.layers.{index}", index, region))
        offset += region.length
    return Layout(f"lmcache {fmt} headerless", None, "attention", world_size, _segments(regions))


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
