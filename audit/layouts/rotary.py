"""Rotary position embeddings as vLLM 0.32 computes them (``model_executor/layers/rotary_embedding``).

Layer 0's K of a token is its pre-rotary K turned, in each pair of columns, by the token's position
times that pair's frequency: K names the position its row was computed at, where V names only the
token (issue #40). `Rotary` is one model's frequencies and pairing; `rotary_of` reads them from a
config the way ``get_rope`` does, and refuses the variants whose angle is not position times a
fixed frequency (YaRN's and LongRoPE's scaled magnitudes, dynamic NTK, M-RoPE), so that a K is never
judged by the wrong rotation."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .model import LayoutError

PROBED_PAIRS = 16  # the pairs of a head a K row is compared on: every frequency band, the fastest first


@dataclass(frozen=True)
class Rotary:
    """``inv_freq`` (rotary_dim // 2,): each pair's turn per position, as float32 (``_compute_inv_freq``);
    ``neox``: pair i is columns (i, i + rotary_dim // 2), else (2i, 2i + 1) (GPT-J's interleaving)."""

    inv_freq: np.ndarray
    rotary_dim: int
    neox: bool = True
    max_position: int = 1 << 20  # positions a key may hold (max_position_embeddings, scaled)

    def columns(self, pairs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """A head's two columns of each pair in `pairs`."""
        half = self.rotary_dim // 2
        return (pairs, pairs + half) if self.neox else (2 * pairs, 2 * pairs + 1)

    @property
    def probed_pairs(self) -> np.ndarray:
        """The pairs K is checked on: spread evenly by index, so over every frequency band."""
        half = self.rotary_dim // 2
        return np.unique(np.linspace(0, half - 1, min(PROBED_PAIRS, half)).round().astype(np.int64))

    def describe(self) -> dict:
        """For the report: the rotated columns, the pairs checked and their pairing."""
        return {"rotary_dim": self.rotary_dim, "pairs": len(self.probed_pairs), "neox": self.neox}

    def angles(self, positions: np.ndarray, pairs: np.ndarray) -> np.ndarray:
        """(rows, pairs): each position's angle in each pair, as vLLM's cache holds it (float32
        position times float32 frequency, then cos and sin)."""
        return np.asarray(positions, np.float32)[:, None] * self.inv_freq[pairs][None, :]


def rope_parameters(config: dict, layer_kind: str | None = None) -> dict:
    """The rope parameters of a layer, as vLLM 0.32 reads them: transformers 5's ``rope_parameters``
    (per layer kind where it is keyed so, as Gemma 3's ``sliding_attention`` / ``full_attention``), else
    the older ``rope_theta`` and ``rope_scaling``."""
    params = config.get("rope_parameters")
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        params = params.get(layer_kind or "full_attention") or params.get("full_attention")
    if isinstance(params, dict) and params:
        return dict(params)
    scaling = config.get("rope_scaling")
    found = dict(scaling) if isinstance(scaling, dict) else {}
    found.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    if "partial_rotary_factor" in config:
        found.setdefault("partial_rotary_factor", config["partial_rotary_factor"])
    return found


def rotary_of(config: dict, head_size: int, layer_kind: str | None = None, neox: bool = True) -> Rotary:
    """One layer's `Rotary` (``get_rope``): the base and rotary dim, and the scalings that change only
    the frequencies (``default``, ``linear``, ``llama3``); any other is refused (`LayoutError`)."""
    params = rope_parameters(config, layer_kind)
    kind = params.get("rope_type") or params.get("type") or "default"
    base = float(params.get("rope_theta", 10000.0))
    rotary_dim = params.get("rope_dim") or int(head_size * float(params.get("partial_rotary_factor", 1.0)))
    if not 2 <= rotary_dim <= head_size or rotary_dim % 2:
        raise LayoutError(f"rotary dim {rotary_dim} of head {head_size}: K not bound")
    if "mrope_section" in params:
        raise LayoutError("M-RoPE (positions per section): K not bound")
    inv_freq = (1.0 / (np.float32(base) ** (np.arange(0, rotary_dim, 2, dtype=np.float32) / np.float32(rotary_dim)))
                ).astype(np.float32)
    max_position = int(config.get("max_position_embeddings") or 1 << 20)
    if kind == "linear":  # positions / factor: the same as every frequency / factor
        factor = float(params["factor"])
        inv_freq, max_position = (inv_freq / np.float32(factor)).astype(np.float32), int(max_position * factor)
    elif kind == "llama3":
        inv_freq = _llama3(inv_freq, params)
    elif kind != "default":
        raise LayoutError(f"rope_type {kind!r}: K not bound (only default, linear and llama3 rotations are)")
    return Rotary(inv_freq, int(rotary_dim), neox, max_position)


def _llama3(inv_freq: np.ndarray, params: dict) -> np.ndarray:
    """``Llama3RotaryEmbedding._compute_inv_freq``: low frequencies divided by ``factor``, high ones
    kept, a smooth blend between."""
    factor, low, high = float(params["factor"]), float(params["low_freq_factor"]), float(params["high_freq_factor"])
    original = float(params["original_max_position_embeddings"])
    wave_len = np.float32(2 * math.pi) / inv_freq
    smooth = (original / wave_len - low) / (high - low) if low != high else np.zeros_like(inv_freq)
    blended = (1 - smooth) * inv_freq / np.float32(factor) + smooth * inv_freq
    scaled = np.where(wave_len > original / low, inv_freq / np.float32(factor), blended)
    return np.where(wave_len < original / high, inv_freq, scaled).astype(np.float32)


def rotate(first: np.ndarray, second: np.ndarray, angles: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each pair turned by its angle (``ApplyRotaryEmb``: x1 cos - x2 sin, x2 cos + x1 sin)."""
    cos, sin = np.cos(angles), np.sin(angles)
    return first * cos - second * sin, second * cos + first * sin


def decode_start(observed: np.ndarray, pre: np.ndarray, rotary: Rotary, pairs: np.ndarray) -> int:
    """The position of a page's first row, from K rows at consecutive positions and their tokens' K
    before the rotation, each pair as one complex number (rows, pairs): each pair's turn, summed over
    the rows, gives the start times its frequency modulo a turn; unwrapped from the slowest pair to
    the fastest, each narrowing the estimate. Evidence only: a row is judged by its distance at a
    position (`audit.checks.binding.key_distances`), never by this estimate."""
    steps = np.arange(len(observed), dtype=np.float64)[:, None] * rotary.inv_freq[pairs].astype(np.float64)
    turned = (observed.astype(np.complex128) * np.conj(pre) * np.exp(-1j * steps)).sum(axis=0)
    strength = np.abs(turned)
    order = [int(i) for i in np.argsort(rotary.inv_freq[pairs]) if strength[i] > 1e-3 * strength.max()]
    if not order:
        return 0
    phases, freqs = np.angle(turned), rotary.inv_freq[pairs].astype(np.float64)
    slowest = phases[order[0]] / freqs[order[0]]  # within half a turn of 0: a start near 0 may read negative
    candidates = [slowest] if slowest >= 0 else [slowest, slowest + 2 * math.pi / freqs[order[0]]]
    best, missed = 0, math.inf
    for estimate in candidates:
        for i in order[1:]:
            turns = round((estimate * freqs[i] - phases[i]) / (2 * math.pi))
            estimate = (phases[i] + 2 * math.pi * turns) / freqs[i]
        start = max(int(round(estimate)), 0)
        off = np.angle(np.exp(1j * (start * freqs[order] - phases[order])))
        if (miss := float((strength[order] * np.abs(off)).sum())) < missed:
            best, missed = start, miss
    return best
