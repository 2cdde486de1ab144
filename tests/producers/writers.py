"""Keys and values as LMCache and SGLang write them, for tests.

LMCache's are built by its documented format and checked byte for byte against what LMCache
0.5.6's own code made (`lmcache_0_5_6.json`: CacheEngineKey.to_string, LayerCacheEngineKey and
RemoteMetadata.serialize, run in a scratch venv on this machine; test_writers.py compares). Its
Mooncake connector stores `put_parts(key, header, kv)`: the header's bytes, then the KV's. The
checksum frame follows LMCache PR #4558 (`distributed/serde/checksum.py`, not in 0.5.6).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import xxhash

GOLDEN = json.loads((Path(__file__).parent / "lmcache_0_5_6.json").read_text())
KV_2LTD, KV_T2D = 1, 2  # MemoryFormat codes
DTYPE_CODES = {np.dtype(np.float16): 2, np.dtype(np.float32): 4, np.dtype(np.uint8): 6}


def lmcache_key(model: str, world_size: int, worker_id: int, chunk_hash: int, dtype: str, *,
                layer: int | None = None, tags: dict | None = None) -> str:
    key = f"{model}@{world_size}@{worker_id}@{chunk_hash:x}@{dtype}"
    if layer is not None:
        key += f"@{layer}"
    return key + "".join(f"@{name}%{value}" for name, value in (tags or {}).items())


def object_key(model: str, chunk_hash: bytes, *, world_size: int = 1, worker_id: int = 0,
               local_world_size: int = 1, local_rank: int = 0, object_group: int = 0) -> str:
    kv_rank = world_size << 24 | worker_id << 16 | local_world_size << 8 | local_rank
    return f"{model}@{kv_rank:08x}@{object_group:x}@{chunk_hash.hex()}"


def header_bytes(length: int, fmt: int, groups: list[tuple[int, tuple[int, ...]]]) -> bytes:
    """RemoteMetadata as LMCache serializes it: `groups` are (dtype code, shape)."""
    params = [length, fmt]
    for code, shape in groups:
        params += [code, *shape, *[0] * (4 - len(shape))]
    return struct.pack(f"<{len(params)}i", *params)


def lmcache_value(kv: np.ndarray, fmt: int = KV_2LTD, *, header: bool = True) -> bytes:
    """One chunk's value: the header (save_chunk_meta, the default) and the KV tensor's bytes."""
    data = kv.tobytes()
    if not header:
        return data
    return header_bytes(len(data), fmt, [(DTYPE_CODES[kv.dtype], kv.shape)]) + data


def checksum_frame(payload: bytes, chunk_hash: bytes) -> bytes:
    fingerprint = chunk_hash[:8].ljust(8, b"\0")
    return bytes((1,)) + fingerprint + xxhash.xxh3_64(payload).digest() + payload


def kv_chunk(rng: np.random.Generator, layers: int = 2, tokens: int = 256, hidden: int = 64,
             dtype=np.float32) -> np.ndarray:
    """A KV_2LTD tensor [2, layers, tokens, hidden] of plausible, non-zero values."""
    return rng.normal(0, 1, (2, layers, tokens, hidden)).astype(dtype)
