"""Token images: what one token leaves in layer 0's state rows under a checkpoint's weights.

At layer 0 a mixer's input is a function of the token alone, and a conv state holds the conv inputs
of the last ``d_conv - 1`` tokens before its boundary (FACTS §11): each of its rows is the image of
one token. A family's module says which tensors make that image and which columns a TP rank holds
(`Family.token_images`); this module holds the arithmetic they share (`audit.layouts.weights` finds a
model directory's rule). The image is ``(rmsnorm(embed[t] * scale) @ weight.T)`` over the rank's columns."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np

PROBE_COLUMNS = 16  # the columns a row is first matched on (`probe`): the vocabulary search stays small
PROBE_BLOCK_ROWS = 8192  # vocabulary rows converted to float32 at a time while the probe is built


def cache_dir() -> Path:
    """Where built probes are kept: ``MOONCAKE_AUDIT_CACHE``, else the user's cache directory."""
    root = os.environ.get("MOONCAKE_AUDIT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "mooncake-audit")
    return Path(root) / "token-images"


@dataclass(frozen=True)
class TokenImages:
    """One TP rank's layer-0 state rows of every token: ``images(tokens)`` (n, columns), float32."""

    model: str
    tp_size: int
    tp_rank: int
    embeddings: object              # (vocab, hidden): a `checkpoint.Matrix`, read by rows
    norm_weight: np.ndarray | None  # layer 0's RMSNorm weight (hidden,), or None: no norm before the mixer
    eps: float
    weight: np.ndarray              # (columns, hidden): the rank's rows of the input projection
    embedding_scale: float = 1.0
    source: dict = field(default_factory=dict)  # which tensors, for the report
    checkpoint: str = ""            # the checkpoint's identity (`Checkpoint.identity`): the probe's cache key

    @property
    def vocab_size(self) -> int:
        return self.embeddings.shape[0]

    @property
    def columns(self) -> int:
        return self.weight.shape[0]

    def images(self, tokens) -> np.ndarray:
        return self._normed(self.embeddings.rows(np.asarray(tokens))) @ self.weight.T

    def _normed(self, embedded: np.ndarray) -> np.ndarray:
        """Layer 0's mixer input of embedded tokens: scaled, then through the RMSNorm."""
        h = embedded * np.float32(self.embedding_scale)
        if self.norm_weight is None:
            return h
        return h / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + np.float32(self.eps)) * self.norm_weight

    @cached_property
    def probe_columns(self) -> np.ndarray:
        return np.unique(np.linspace(0, self.columns - 1, min(PROBE_COLUMNS, self.columns)).astype(np.int64))

    @cached_property
    def probe_squares(self) -> np.ndarray:
        """Each token's squared norm on the probe columns (vocab,)."""
        return np.einsum("ij,ij->i", self.probe, self.probe)

    @cached_property
    def probe(self) -> np.ndarray:
        """Every token's image on `probe_columns` (vocab, probe): the index a row is looked up in,
        kept in the user's cache (`cache_dir`) once built: a scan from cron reads it instead of the
        embeddings."""
        path = self._cache_path()
        try:
            cached = np.load(path) if path is not None and path.is_file() else None
        except (OSError, ValueError):
            cached = None
        if cached is not None and cached.shape == (self.vocab_size, len(self.probe_columns)):
            return cached
        probe = self._build_probe()
        if path is not None:
            with contextlib.suppress(OSError):  # a cache that cannot be written is only slower
                path.parent.mkdir(parents=True, exist_ok=True)
                partial = path.with_name(f"{path.name}.{os.getpid()}.partial.npy")
                np.save(partial, probe)
                os.replace(partial, path)
        return probe

    def _cache_path(self) -> Path | None:
        if not self.checkpoint:
            return None
        key = json.dumps([self.checkpoint, self.tp_size, self.tp_rank, self.columns, self.probe_columns.tolist(),
                          self.eps, self.embedding_scale, self.source], sort_keys=True)
        return cache_dir() / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.npy"

    def _build_probe(self) -> np.ndarray:
        """The norm is a scalar per token, so the projection runs on the raw embeddings, a block of
        the vocabulary at a time, and each row is divided by its token's RMS after."""
        weight = self.weight[self.probe_columns] * (self.norm_weight if self.norm_weight is not None else 1)
        probe = np.empty((self.vocab_size, len(self.probe_columns)), dtype=np.float32)
        scale = np.float32(self.embedding_scale)
        for first, block in self.embeddings.blocks(PROBE_BLOCK_ROWS):
            projected = block @ weight.T * scale
            if self.norm_weight is not None:
                mean_square = np.einsum("ij,ij->i", block, block) / block.shape[1] * scale * scale
                projected /= np.sqrt(mean_square + np.float32(self.eps))[:, None]
            probe[first:first + len(block)] = projected
        return probe
