"""Rotary position embeddings as vLLM 0.32 computes them (``model_executor/layers/rotary_embedding``).

Layer 0's K of a token is its pre-rotary K turned, in each pair of columns, by the token's position
times that pair's frequency: K names the position its row was computed at, where V names only the
token (issue #40). `Rotary` is one model's frequencies and pairing; `rotary_of` reads them from a
config the way ``get_rope`` does (YaRN's and LongRoPE's turns scaled in magnitude too,
`Rotary.magnitude`; LongRoPE's two sets of frequencies, `rotations_of`), and refuses M-RoPE (its
positions per section), so that a K is never judged by the wrong rotation."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from .model import LayoutError

PROBED_PAIRS = 16  # the pairs of a head a K row is compared on: every frequency band, the fastest first
TURNS_KEPT = 1 << 16  # positions whose turns a rotation keeps in a table (16 pairs: 8 MiB at most)


@dataclass(frozen=True)
class Rotary:
    """``inv_freq`` (rotary_dim // 2,): each pair's turn per position, as float32 (``_compute_inv_freq``);
    ``neox``: pair i is columns (i, i + rotary_dim // 2), else (2i, 2i + 1) (GPT-J's interleaving);
    ``magnitude``: what cos and sin are multiplied by (YaRN's and LongRoPE's ``mscale``; 1 elsewhere);
    ``variant``: which of a model's rotations it is, where it has more than one (LongRoPE's)."""

    inv_freq: np.ndarray
    rotary_dim: int
    neox: bool = True
    max_position: int = 1 << 20  # positions a key may hold (max_position_embeddings, scaled)
    magnitude: float = 1.0
    variant: str = ""
    _turn_tables: dict = field(default_factory=dict, compare=False, repr=False)  # pairs' bytes -> turns (positions, pairs)

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
        described = {"rotary_dim": self.rotary_dim, "pairs": len(self.probed_pairs), "neox": self.neox}
        if self.magnitude != 1.0:
            described["magnitude"] = self.magnitude
        return {**described, "variant": self.variant} if self.variant else described

    def angles(self, positions: np.ndarray, pairs: np.ndarray) -> np.ndarray:
        """(rows, pairs): each position's angle in each pair, as vLLM's cache holds it (float32
        position times float32 frequency, then cos and sin)."""
        return np.asarray(positions, np.float32)[:, None] * self.inv_freq[pairs][None, :]

    def turns(self, positions: np.ndarray, pairs: np.ndarray) -> np.ndarray:
        """(rows, pairs) complex64: each position's turn in each pair, (cos + i sin) of its `angles`
        times `magnitude`, as vLLM turns K. Positions under TURNS_KEPT are read from a table kept per
        pairs and grown as larger ones come (a guard turns a few thousand positions load after load:
        a gather, not a cos and a sin a row); the same float32 operations make both, so the same bits."""
        positions = np.asarray(positions, np.int64)
        if not positions.size or positions.min() < 0 or (top := int(positions.max())) >= TURNS_KEPT:
            return _turns(self.angles(positions, pairs), self.magnitude)
        table = self._turn_tables.get(key := np.asarray(pairs, np.int64).tobytes())
        if table is None or top >= len(table):
            size = min(max(1024, 1 << top.bit_length()), TURNS_KEPT)
            table = self._turn_tables[key] = _turns(self.angles(np.arange(size), pairs), self.magnitude)
        return table[positions]


def _turns(angles: np.ndarray, magnitude: float) -> np.ndarray:
    """(cos + i sin) times `magnitude` of float32 angles as complex64, written in place (a complex exp
    costs five times as much)."""
    turns = np.empty(angles.shape, np.complex64)
    parts = turns.view(np.float32).reshape(*angles.shape, 2)
    np.cos(angles, out=parts[..., 0])
    np.sin(angles, out=parts[..., 1])
    if magnitude != 1.0:
        parts *= np.float32(magnitude)
    return turns


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


def rotations_of(config: dict, head_size: int, layer_kind: str | None = None) -> tuple[Rotary, ...]:
    """Every rotation a layer's K may have been turned by, the likeliest first: `rotary_of`'s one, or
    LongRoPE's two (``Phi3LongRoPEScaledRotaryEmbedding`` turns by its long factors where the engine's
    ``max_model_len`` exceeds the original context, as by default, else by its short ones: the
    engine's setting, not the checkpoint's)."""
    params = rope_parameters(config, layer_kind)
    if (params.get("rope_type") or params.get("type")) in ("longrope", "su"):
        return _longrope(config, params, head_size)
    return (rotary_of(config, head_size, layer_kind),)


def rotary_of(config: dict, head_size: int, layer_kind: str | None = None, neox: bool = True) -> Rotary:
    """One layer's `Rotary` (``get_rope``): the base and rotary dim, and the scalings (``default``,
    ``linear``, ``llama3``, ``dynamic``, ``yarn``); any other is refused (`LayoutError`; LongRoPE's two
    rotations are `rotations_of`'s)."""
    params = rope_parameters(config, layer_kind)
    kind = params.get("rope_type") or params.get("type") or "default"
    base, rotary_dim = float(params.get("rope_theta", 10000.0)), _rotary_dim(params, head_size)
    max_position = int(config.get("max_position_embeddings") or 1 << 20)
    if kind == "dynamic":  # (``DynamicNTK*RotaryEmbedding``: a base fixed once, from alpha or factor)
        base = _dynamic_base(base, rotary_dim, max_position, params)
    inv_freq = _inv_freq(base, rotary_dim)
    magnitude = 1.0
    if kind == "linear":  # positions / factor: the same as every frequency / factor
        factor = float(params["factor"])
        inv_freq, max_position = (inv_freq / np.float32(factor)).astype(np.float32), int(max_position * factor)
    elif kind == "llama3":
        inv_freq = _llama3(inv_freq, params)
    elif kind == "yarn":
        inv_freq, magnitude, max_position = _yarn(base, rotary_dim, params, max_position)
    elif kind not in ("default", "dynamic"):
        raise LayoutError(f"rope_type {kind!r}: K not bound (default, linear, llama3, dynamic, yarn and "
                          f"longrope rotations are)")
    return Rotary(inv_freq, rotary_dim, neox, max_position, magnitude)


def _rotary_dim(params: dict, head_size: int) -> int:
    """The rotated columns of a head (``rope_dim``, or ``partial_rotary_factor`` of it); M-RoPE refused."""
    rotary_dim = params.get("rope_dim") or int(head_size * float(params.get("partial_rotary_factor", 1.0)))
    if not 2 <= rotary_dim <= head_size or rotary_dim % 2:
        raise LayoutError(f"rotary dim {rotary_dim} of head {head_size}: K not bound")
    if "mrope_section" in params:
        raise LayoutError("M-RoPE (positions per section): K not bound")
    return int(rotary_dim)


def _longrope(config: dict, params: dict, head_size: int) -> tuple[Rotary, Rotary]:
    """LongRoPE's long and short rotations: each pair's frequency divided by its factor, cos and sin
    times ``long_mscale`` / ``short_mscale``, by default sqrt(1 + ln(max / original) / ln(original))."""
    base, rotary_dim = float(params.get("rope_theta", 10000.0)), _rotary_dim(params, head_size)
    max_position = int(config.get("max_position_embeddings") or 1 << 20)
    original = int(params.get("original_max_position_embeddings") or config.get("original_max_position_embeddings")
                   or max_position)
    scale = max_position / original
    default = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
    plain = np.float32(base) ** (np.arange(0, rotary_dim, 2, dtype=np.float32) / np.float32(rotary_dim))
    found = []
    for variant, positions in (("long", max_position), ("short", original)):
        factors = np.asarray(params[f"{variant}_factor"], dtype=np.float32)
        if factors.shape != (rotary_dim // 2,):
            raise LayoutError(f"longrope {variant}_factor of {factors.size}, not {rotary_dim // 2}: K not bound")
        magnitude = float(params.get(f"{variant}_mscale") or default)
        found.append(Rotary((1.0 / (factors * plain)).astype(np.float32), rotary_dim, True, positions, magnitude,
                            f"longrope {variant} factors"))
    return found[0], found[1]


def _inv_freq(base: float, rotary_dim: int) -> np.ndarray:
    """``_compute_inv_freq``: 1 / base^(2i / rotary_dim), in float32."""
    return (1.0 / (np.float32(base) ** (np.arange(0, rotary_dim, 2, dtype=np.float32) / np.float32(rotary_dim)))
            ).astype(np.float32)


def _dynamic_base(base: float, rotary_dim: int, max_position: int, params: dict) -> float:
    """The base a dynamic NTK rotation fixes once (vLLM computes its cache once, not per length):
    ``alpha``'s (Hunyuan) or ``factor``'s over the trained positions (the base itself where those
    are the model's maximum, as by default)."""
    exponent = rotary_dim / (rotary_dim - 2)
    if "alpha" in params:
        return base * float(params["alpha"]) ** exponent
    factor = float(params["factor"])
    trained = float(params.get("max_trained_positions", max_position))
    return base * (factor * max_position / trained - (factor - 1)) ** exponent


def _yarn(base: float, rotary_dim: int, params: dict, max_position: int) -> tuple[np.ndarray, float, int]:
    """``YaRNScalingRotaryEmbedding``: each frequency blended from its interpolated (/ factor) and its
    own by a ramp over the pairs between the correction dims of ``beta_fast`` and ``beta_slow``
    rotations in the original context; cos and sin times ``mscale`` (``attention_factor``, else
    0.1 ln(factor) + 1, or its ``mscale`` / ``mscale_all_dim`` ratio)."""
    factor = float(params["factor"])
    original = float(params.get("original_max_position_embeddings") or max_position)
    half = rotary_dim // 2

    def correction_dim(rotations: float) -> float:
        return rotary_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(float(params.get("beta_fast", 32))), correction_dim(float(params.get("beta_slow", 1)))
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    high = high + 0.001 if low == high else high
    ramp = np.clip((np.arange(half, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    powers = np.float32(base) ** (np.arange(0, rotary_dim, 2, dtype=np.float32) / np.float32(rotary_dim))
    kept = (1 - ramp).astype(np.float32)  # extrapolation's share: 1 for the fast pairs
    inv_freq = (1.0 / (np.float32(factor) * powers)) * (1 - kept) + (1.0 / powers) * kept

    def mscale(scale: float, weight: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * weight * math.log(scale) + 1.0

    if params.get("attention_factor") is not None:
        magnitude = float(params["attention_factor"])
    elif params.get("mscale") and params.get("mscale_all_dim"):
        magnitude = mscale(factor, float(params["mscale"])) / mscale(factor, float(params["mscale_all_dim"]))
    else:
        magnitude = mscale(factor)
    return inv_freq.astype(np.float32), float(magnitude), int(original * factor)


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
    before the rotation, each pair as one complex number (rows, pairs): `decode_starts` of one page."""
    return int(decode_starts(observed[None], pre[None], rotary, pairs)[0])


def decode_starts(observed: np.ndarray, pre: np.ndarray, rotary: Rotary, pairs: np.ndarray) -> np.ndarray:
    """Each page's first row's position (pages, rows, pairs: K rows at consecutive positions and their
    tokens' K before the rotation, each pair one complex number): each pair's turn, summed over the
    rows, gives the start times its frequency modulo a turn; unwrapped from the slowest pair to the
    fastest, each narrowing the estimate (pairs far weaker than a page's strongest left out; a
    page with none: 0). Every page at once. Evidence only: a row is judged by its distance at a
    position (`audit.checks.binding.key_distances`), never by this estimate."""
    freqs = rotary.inv_freq[pairs].astype(np.float64)
    steps = np.arange(observed.shape[1], dtype=np.float64)[:, None] * freqs
    # every row's products in complex64 (K rows hold float32 at best: its rounding is theirs), summed
    # over the rows, then (pages, pairs) in float64
    turned = np.asarray(observed, np.complex64) * np.conj(np.asarray(pre, np.complex64))
    turned *= np.exp(-1j * steps).astype(np.complex64)
    turned = turned.sum(axis=1).astype(np.complex128)  # (pages, pairs)
    strength = np.abs(turned)
    strong = strength > 1e-3 * strength.max(axis=1, keepdims=True)
    order = np.argsort(rotary.inv_freq[pairs], kind="stable")  # slowest first
    phases, pages = np.angle(turned), np.arange(len(turned))
    slowest = order[np.argmax(strong[:, order], axis=1)]  # each page's slowest strong pair
    first = phases[pages, slowest] / freqs[slowest]  # within half a turn of 0: a start near 0 may read negative
    best, missed = np.zeros(len(turned), np.int64), np.full(len(turned), np.inf)
    for estimate, valid in ((first, np.ones(len(turned), bool)), (first + 2 * math.pi / freqs[slowest], first < 0)):
        for i in order:
            narrowed = (phases[:, i] + 2 * math.pi * np.round((estimate * freqs[i] - phases[:, i]) / (2 * math.pi))) / freqs[i]
            estimate = np.where(strong[:, i] & (slowest != i), narrowed, estimate)
        start = np.maximum(np.round(estimate), 0).astype(np.int64)
        off = np.remainder(start[:, None] * freqs - phases + math.pi, 2 * math.pi) - math.pi  # each pair's miss, within half a turn
        miss = np.where(strong, strength * np.abs(off), 0.0).sum(axis=1)
        better = valid & (miss < missed)
        best, missed = np.where(better, start, best), np.where(better, miss, missed)
    return np.where(strong.any(axis=1), best, 0)
