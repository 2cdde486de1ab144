"""Chained chunk hashes, the last field of a vLLM Store key.

vLLM hashes each full block of tokens together with its parent block's hash (prefix caching),
so a key names its whole prefix: equal keys mean equal token prefixes. The root parent stands in
for vLLM's ``NONE_HASH`` and is derived from the seed, so runs are reproducible.
"""

from __future__ import annotations

import hashlib

import numpy as np


def chunk_hashes(tokens: np.ndarray, block_size: int, seed: int) -> list[str]:
    """Hex hash of every full chunk: sha256(parent hash || the chunk's token ids as int32 LE)."""
    parent = hashlib.sha256(f"mooncake-audit simulate root {seed}".encode()).digest()
    hashes = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        chunk = np.asarray(tokens[start:start + block_size], dtype="<i4").tobytes()
        parent = hashlib.sha256(parent + chunk).digest()
        hashes.append(parent.hex())
    return hashes
