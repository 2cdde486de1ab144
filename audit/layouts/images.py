"""Token images: what one token leaves in layer 0's state rows under a checkpoint's weights.

At layer 0 a mixer's input is a function of the token alone, and a conv state holds the conv inputs
of the last ``d_conv - 1`` tokens before its boundary (FACTS §11): each of its rows is the image of
one token; so is each token's V in an attention page (`region` "v"). A family's module says which
tensors make that image and which columns a TP rank holds (`Family.token_images`); this module holds
the arithmetic they share (`audit.layouts.weights` finds a model directory's rule). The image is
``n @ weight.T (+ bias)`` over the rank's columns, ``n = rmsnorm(embed[t] * scale)``; a gated rule
(ShortConv's ``B * x``) multiplies it by ``n @ gate.T`` column by column, a normed one (MLA's latent)
puts it through an RMSNorm of its own."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np

from .rotary import Rotary

CHECK_COLUMNS = 64  # the columns a row is compared with its token's image on (all, below that many)
# Of those, the ones a row is looked up by (their signs: a 32-bit code) and searched for on. 16 left
# 16% of a hidden-32 Mamba2's rows on codes that more than 8 tokens share (each then a vocabulary
# search: 60x slower); 32 leave none (at most 2 tokens a code; mamba2-130m's geometry: 1).
PROBE_COLUMNS = 32
TABLE_BLOCK_ROWS = 8192  # vocabulary rows converted to float32 at a time while the table is built


def sign_codes(probed: np.ndarray, centers: np.ndarray) -> np.ndarray:
    """Each row's probe columns as bits: 1 where it is above that column's center."""
    if probed.shape[1] == 32:
        bits = probed > centers
    else:  # (fewer probe columns: the rest of the 32 bits zero; np.pad costs four times the whole)
        bits = np.zeros((len(probed), 32), dtype=bool)
        np.greater(probed, centers, out=bits[:, :probed.shape[1]])
    return np.packbits(bits, bitorder="little").view("<u4")  # column c: bit c of its row's four bytes


def cache_dir() -> Path:
    """Where built probes are kept: ``MOONCAKE_AUDIT_CACHE``, else the user's cache directory."""
    root = os.environ.get("MOONCAKE_AUDIT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "mooncake-audit")
    return Path(root) / "token-images"


def cached_table(path: Path | None, shape: tuple[int, int], build) -> np.ndarray:
    """The table kept at `path` where it has `shape`, else `build()`'s, kept there (a cache that
    cannot be written only makes the next process build it again)."""
    try:
        cached = np.load(path) if path is not None and path.is_file() else None
    except (OSError, ValueError):
        cached = None
    if cached is not None and cached.shape == shape:
        return cached
    table = build()
    if path is not None:
        with contextlib.suppress(OSError):
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_name(f"{path.name}.{os.getpid()}.partial.npy")
            np.save(partial, table)
            os.replace(partial, path)
    return table


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
    gate: np.ndarray | None = None  # (columns, hidden): a second projection the image is multiplied by
    bias: np.ndarray | None = None  # (columns,): the projection's bias (Qwen2's qkv_bias), added after it
    gate_bias: np.ndarray | None = None  # (columns,): the gate's bias (LFM2's conv_bias: B and x each biased)
    post_norm: np.ndarray | None = None  # (columns,): an RMSNorm's weight over the projection (MLA's kv_a_layernorm)
    post_eps: float = 1e-6
    region: str = "conv"            # which layer-0 rows are images: "conv" (a conv state's), "v" (attention's V),
    #                                 "latent" (an MLA page's normed latent, the first `columns` numbers a token)
    source: dict = field(default_factory=dict)  # which tensors, for the report
    checkpoint: str = ""            # the checkpoint's identity (`Checkpoint.identity`): the probe's cache key
    keys: KeyImages | None = None   # attention's K before its rotation (`region` "v"), where its rule is known
    keys_not_bound: str = ""        # why K is not bound (an attention rule without `keys`)
    encoder_inputs: tuple = ()      # the config's fields saying an encoder's embeddings reach layer 0
    #                                 (`hf_config.encoder_inputs`): rows of those are no token's image

    def __post_init__(self):
        if self.post_norm is not None and (self.gate is not None or self.bias is not None):
            raise ValueError("a norm after a gated or biased projection has no table rule")
        if self.gate_bias is not None and self.gate is None:
            raise ValueError("a gate's bias without a gate")

    @property
    def vocab_size(self) -> int:
        return self.embeddings.shape[0]

    @property
    def columns(self) -> int:
        return self.weight.shape[0]

    def images(self, tokens) -> np.ndarray:
        """Every column of the tokens' images, computed from the checkpoint."""
        normed = self.normed(self.embeddings.rows(np.asarray(tokens)))
        projected = normed @ self.weight.T
        if self.bias is not None:
            projected += self.bias
        if self.post_norm is not None:
            return self._post_normed(projected)
        if self.gate is None:
            return projected
        gated = normed @ self.gate.T
        if self.gate_bias is not None:
            gated += self.gate_bias
        return projected * gated

    def _post_normed(self, projected: np.ndarray) -> np.ndarray:
        mean_square = np.mean(projected * projected, axis=-1, keepdims=True)
        return projected / np.sqrt(mean_square + np.float32(self.post_eps)) * self.post_norm

    def checked_images(self, tokens) -> np.ndarray:
        """The tokens' images on `check_columns`: what a row is compared with, read from the table."""
        return self.table[np.asarray(tokens)]

    @cached_property
    def check_columns(self) -> np.ndarray:
        return np.unique(np.linspace(0, self.columns - 1, min(CHECK_COLUMNS, self.columns)).astype(np.int64))

    @cached_property
    def checks_every_column(self) -> bool:
        """Whether `check_columns` is every column in order (an image of at most CHECK_COLUMNS): a
        row is then compared as it is, with no copy of its columns."""
        return len(self.check_columns) == self.columns

    @cached_property
    def probe_index(self) -> np.ndarray:
        """Which of the check columns are the probe's: evenly spread, at most PROBE_COLUMNS."""
        return np.unique(np.linspace(0, len(self.check_columns) - 1,
                                     min(PROBE_COLUMNS, len(self.check_columns))).astype(np.int64))

    @cached_property
    def probe_columns(self) -> np.ndarray:
        return self.check_columns[self.probe_index]

    @cached_property
    def probe(self) -> np.ndarray:
        """Every token's image on `probe_columns` (vocab, probe): what a row is searched for in."""
        return np.ascontiguousarray(self.table[:, self.probe_index])

    @cached_property
    def probe_squares(self) -> np.ndarray:
        """Each token's squared norm on the probe columns (vocab,)."""
        return np.einsum("ij,ij->i", self.probe, self.probe)

    @cached_property
    def table_squares(self) -> np.ndarray:
        """Each token's squared norm on the check columns (vocab,): a distance's denominator."""
        return np.einsum("ij,ij->i", self.table, self.table)

    @cached_property
    def probe_signs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The index of exact lookups: each probe column's median over the vocabulary, and every
        token's probe as bits (above the median or not), sorted, with the tokens in that order. A
        row is looked up by its own bits first; most rows find their one token there."""
        centers = np.median(self.probe, axis=0).astype(np.float32)
        codes = sign_codes(self.probe, centers)
        order = np.argsort(codes, kind="stable")
        return centers, codes[order], order

    @cached_property
    def twins(self) -> dict[int, np.ndarray]:
        """Tokens whose images are identical (untrained or tied embeddings), each mapped to its whole
        class: a row decodes to one of them, and any of them may be the token it was made of."""
        rows = np.ascontiguousarray(self.table)
        keys = rows.view(np.dtype((np.void, rows.dtype.itemsize * rows.shape[1]))).ravel()
        _, inverse, counts = np.unique(keys, return_inverse=True, return_counts=True)
        shared = np.flatnonzero(counts[inverse] > 1)
        grouped = shared[np.argsort(inverse[shared], kind="stable")]
        classes: dict[int, np.ndarray] = {}
        for members in np.split(grouped, np.flatnonzero(np.diff(inverse[grouped])) + 1) if len(grouped) else ():
            for token in members:
                classes[int(token)] = members
        return classes

    def normed(self, embedded: np.ndarray) -> np.ndarray:
        """Layer 0's mixer input of embedded tokens: scaled, then through the RMSNorm."""
        h = embedded * np.float32(self.embedding_scale)
        if self.norm_weight is None:
            return h
        return h / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + np.float32(self.eps)) * self.norm_weight

    @cached_property
    def table(self) -> np.ndarray:
        """Every token's image on `check_columns` (vocab, check), kept in the user's cache
        (`cache_dir`) once built: a scan from cron reads it instead of the embeddings, and judging a
        row then multiplies nothing (a row of it per candidate token)."""
        return cached_table(self._cache_path(), (self.vocab_size, len(self.check_columns)), self._build_table)

    def _cache_path(self) -> Path | None:
        if not self.checkpoint:
            return None
        # the projections' checked rows too: a scaling read from config.json (not a checkpoint file) is in them
        rows = hashlib.sha256(np.ascontiguousarray(self.weight[self.check_columns]).tobytes())
        for extra in (self.gate, self.bias, self.gate_bias, self.post_norm):
            if extra is not None:
                rows.update(np.ascontiguousarray(extra[self.check_columns]).tobytes())
        key = json.dumps([self.checkpoint, self.tp_size, self.tp_rank, self.columns, self.check_columns.tolist(),
                          self.eps, self.post_eps, self.embedding_scale, self.source, rows.hexdigest()], sort_keys=True)
        return cache_dir() / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.npy"

    def _build_table(self) -> np.ndarray:
        """The norm is a scalar per token, so the projections run on the raw embeddings, a block of
        the vocabulary at a time, and each row is divided by its token's RMS after (by its mean
        square for a gated image: the scalar is in both factors); a bias is added to its factor after
        the division, unscaled.
        A norm after the projection needs every column of it: that image is computed whole."""
        if self.post_norm is not None:
            table = np.empty((self.vocab_size, len(self.check_columns)), dtype=np.float32)
            for first, block in self.embeddings.blocks(TABLE_BLOCK_ROWS):
                projected = self._post_normed(self.normed(block) @ self.weight.T)
                table[first:first + len(block)] = projected[:, self.check_columns]
            return table
        norm = self.norm_weight if self.norm_weight is not None else 1
        weight = self.weight[self.check_columns] * norm
        gate = None if self.gate is None else self.gate[self.check_columns] * norm
        bias, gate_bias = (None if extra is None else extra[self.check_columns] for extra in (self.bias, self.gate_bias))
        table = np.empty((self.vocab_size, len(self.check_columns)), dtype=np.float32)
        scale = np.float32(self.embedding_scale)
        for first, block in self.embeddings.blocks(TABLE_BLOCK_ROWS):
            rms = np.float32(1)
            if self.norm_weight is not None:
                mean_square = np.einsum("ij,ij->i", block, block) / block.shape[1] * scale * scale
                rms = np.sqrt(mean_square + np.float32(self.eps))[:, None]
            projected = block @ weight.T * scale
            if gate is not None and bias is None and gate_bias is None:  # both factors hold the scalar
                projected *= block @ gate.T * scale
                projected /= rms * rms
            else:
                projected /= rms
                if bias is not None:
                    projected += bias
                if gate is not None:
                    gated = block @ gate.T * scale / rms
                    projected *= gated if gate_bias is None else gated + gate_bias
            table[first:first + len(block)] = projected
        return table


@dataclass(frozen=True)
class KeyImages:
    """Layer 0's K of every token before its rotation, for one of a rank's KV heads, on the columns of
    `rotary.probed_pairs` (vocab, 2 * pairs: each pair's two columns side by side). The input is
    V's (`normed_by`: the same embeddings, scale and norm); a per-head norm (``k_norm``: Qwen3's,
    Gemma 3's) needs the head's every column, so a block of the vocabulary is projected whole on it;
    a norm over every KV head (OLMo2's: vLLM gathers K across the ranks for it) needs every head's
    (`norm_heads`), and scales the head's columns by their mean square."""

    normed_by: TokenImages
    weight: np.ndarray               # (head_size, hidden): the head's rows of the K projection
    rotary: Rotary
    head: int = 0                    # which of the rank's KV heads these rows are
    bias: np.ndarray | None = None   # (head_size,)
    head_norm: np.ndarray | None = None  # (head_size,): the k_norm's weight (already 1 + w for a Gemma norm)
    head_eps: float = 1e-6
    norm_heads: np.ndarray | None = None  # (every KV head's size, hidden): K's rows whose mean square the norm takes
    other_rotations: tuple = ()      # the other `Rotary`s K may be turned by (LongRoPE's short factors)
    source: dict = field(default_factory=dict)  # which tensors and rotation, for the report

    @cached_property
    def pairs(self) -> np.ndarray:
        return self.rotary.probed_pairs

    @property
    def rotations(self) -> tuple:
        """Every rotation a page's K is judged under, the likeliest (`rotary`) first."""
        return (self.rotary, *self.other_rotations)

    @cached_property
    def columns(self) -> np.ndarray:
        """The head's columns the table holds, each probed pair's two side by side: a row of them read
        as complex64 is each pair as one number (`turned`), which a rotation multiplies."""
        return np.stack(self.rotary.columns(self.pairs), axis=1).reshape(-1)

    @cached_property
    def turned(self) -> np.ndarray:
        """The table as complex64 (vocab, pairs): each pair's first column the real part, its second the imaginary."""
        return self.table.view(np.complex64)

    @cached_property
    def table_squares(self) -> np.ndarray:
        """Each token's squared norm on the table's columns (a turn keeps it): a distance's denominator."""
        return np.einsum("ij,ij->i", self.table, self.table)

    def pre_rotary(self, normed: np.ndarray) -> np.ndarray:
        """Normed inputs' K over the head's every column, before the rotation."""
        k = normed @ self.weight.T
        if self.bias is not None:
            k += self.bias
        if self.head_norm is not None:
            spanned = k if self.norm_heads is None else normed @ self.norm_heads.T
            k = k / np.sqrt(np.mean(spanned * spanned, axis=-1, keepdims=True) + np.float32(self.head_eps)) * self.head_norm
        return k

    @cached_property
    def table(self) -> np.ndarray:
        images = self.normed_by
        digest = hashlib.sha256(np.ascontiguousarray(self.weight).tobytes())
        for extra in (self.bias, self.head_norm, self.norm_heads, self.rotary.inv_freq):
            if extra is not None:
                digest.update(np.ascontiguousarray(extra).tobytes())
        key = json.dumps(["k", images.checkpoint, images.tp_size, images.tp_rank, self.head, self.columns.tolist(),
                          images.eps, self.head_eps, images.embedding_scale, self.source, digest.hexdigest()])
        path = cache_dir() / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.npy" if images.checkpoint else None
        return cached_table(path, (images.vocab_size, len(self.columns)), self._build_table)

    def _build_table(self) -> np.ndarray:
        images = self.normed_by
        table = np.empty((images.vocab_size, len(self.columns)), dtype=np.float32)
        for first, block in images.embeddings.blocks(TABLE_BLOCK_ROWS):
            table[first:first + len(block)] = self.pre_rotary(images.normed(block))[:, self.columns]
        return table
