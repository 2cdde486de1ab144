"""Layer-0 binding: which token each row of a state is the image of, and how far it is from it.

A healthy row is its token's image bit for bit in float32 and within 0.4% in bfloat16, while the
nearest other token's image is about 100% away (FACTS §11); a row made under other weights is
20% or more from every image. So one tolerance, far from both, tells a row of these weights from
one that is not. Rows are matched on a few columns first (`images.probe`, one matrix product for a
whole batch), then on every column."""

from __future__ import annotations

import numpy as np

# A row further than this (relative L2) from its nearest token's image is not an image under
# these weights. Measured: healthy rows <= 0.0038 (bfloat16), other weights >= 0.22.
ROW_TOLERANCE = 0.05
CANDIDATES = 8  # tokens a row far from its probe-nearest token is compared with on every column


def nearest_tokens(rows: np.ndarray, images) -> tuple[np.ndarray, np.ndarray]:
    """For each row of `rows` (n, columns) float32, the token whose image (`images`: a
    `TokenImages`) is nearest, and the relative L2 distance to it: ``|row - image| / |image|``.
    Each row's nearest token on the probe columns is checked on every column; only a row that is
    then beyond the tolerance is compared with its next nearest candidates too."""
    rows = np.asarray(rows, dtype=np.float32)
    if rows.ndim != 2 or rows.shape[1] != images.columns:
        raise ValueError(f"rows of shape {rows.shape}: the images have {images.columns} columns")
    # |row - image|^2 on the probe columns, up to the row's own constant
    scores = images.probe_squares[None, :] - 2.0 * (rows[:, images.probe_columns] @ images.probe.T)
    tokens = scores.argmin(axis=1)
    distances = _distances(rows, tokens[:, None], images)[:, 0]
    far = np.flatnonzero(distances > ROW_TOLERANCE)
    if len(far):
        count = min(CANDIDATES, scores.shape[1])
        candidates = np.argpartition(scores[far], count - 1, axis=1)[:, :count]
        others = _distances(rows[far], candidates, images)
        best = others.argmin(axis=1)
        tokens[far] = candidates[np.arange(len(far)), best]
        distances[far] = others[np.arange(len(far)), best]
    return tokens, distances


def _distances(rows: np.ndarray, candidates: np.ndarray, images) -> np.ndarray:
    """(n, k) relative L2 distances of each row from its k candidates' images, on every column."""
    full = images.images(candidates.reshape(-1)).reshape(*candidates.shape, -1)
    return np.linalg.norm(full - rows[:, None, :], axis=2) / np.maximum(np.linalg.norm(full, axis=2), 1e-30)
