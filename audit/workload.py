"""Publishing test workloads into a cluster, the way a producer would (demo, tests, benchmarks).

This is the only module that writes to a store, and only to the store it is given: the audit path
never imports it.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from audit.connection import Settings, open_store
from audit.errors import AuditError
from audit.keys import vllm_key

MAMBA_130M_KEY_BYTES = 1_400_832  # 24 layers x (conv 3x1536 + ssm 1536x16) x bf16, TP 1


class Publisher:
    """A producer-side store client (mounts no segment; the holders keep the bytes)."""

    def __init__(self, settings: Settings):
        self.store = open_store(settings)

    def put(self, key: str, value: bytes | np.ndarray) -> None:
        data = value.tobytes() if isinstance(value, np.ndarray) else value
        rc = self.store.put(key, data)
        if rc != 0:
            raise AuditError(f"publishing {key[:80]!r} failed ({rc})")

    def put_many(self, items: Iterable[tuple[str, bytes | np.ndarray]]) -> int:
        count = 0
        for key, value in items:
            self.put(key, value)
            count += 1
        return count

    def remove(self, key: str) -> int:
        return self.store.remove(key)

    def close(self) -> None:
        self.store.close()


def state_like_bytes(rng: np.random.Generator, nbytes: int) -> np.ndarray:
    """Non-zero bytes shaped like recurrent state: bf16 values of small magnitude."""
    values = rng.standard_normal(nbytes // 4, dtype=np.float32) * 0.05
    bf16 = (values.view(np.uint32) >> 16).astype(np.uint16)
    out = np.zeros(nbytes, dtype=np.uint8)
    out[: bf16.nbytes] = bf16.view(np.uint8)
    return out


def vllm_demo_workload(seed: int = 0, chunks: int = 24, tp_size: int = 2, zero_every: int = 8,
                       model: str = "mamba-130m-hf") -> Iterable[tuple[str, np.ndarray, bool]]:
    """(key, value, is_zero) for a mamba-130m-like workload: a few all-zero values among real ones."""
    rng = np.random.default_rng(seed)
    per_rank = MAMBA_130M_KEY_BYTES // tp_size
    for chunk in range(chunks):
        chunk_hash = f"{rng.integers(0, 2**63):016x}{rng.integers(0, 2**63):016x}"
        for tp_rank in range(tp_size):
            zero = chunk % zero_every == zero_every - 1
            value = np.zeros(per_rank, np.uint8) if zero else state_like_bytes(rng, per_rank)
            yield vllm_key(model, chunk_hash, tp_rank=tp_rank), value, zero
