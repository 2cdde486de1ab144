"""Decoding layer-0 rows into tokens (issue #40): exact images, rounded ones, other weights."""

from __future__ import annotations

import numpy as np

import audit.checks.binding
from audit.checks.binding import ROW_TOLERANCE, nearest_tokens
from audit.layouts.images import sign_codes
from audit.layouts.weights import token_images
from tests.helpers import tiny_mamba2_checkpoint


def _bfloat16(rows: np.ndarray) -> np.ndarray:
    """Rounded to bfloat16 (to nearest even), as a state held in bfloat16 is."""
    bits = rows.astype(np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).view(np.float32)


def test_images_decode_to_their_tokens_at_distance_zero(tmp_path):
    tiny_mamba2_checkpoint(tmp_path / "m")
    images = token_images(tmp_path / "m", "m", 1, 0)
    tokens, distances = nearest_tokens(images.images([4, 4, 31, 0]), images)
    assert tokens.tolist() == [4, 4, 31, 0] and distances.max() < 1e-6  # the same sums, another order


def test_rows_held_in_bfloat16_decode_to_their_tokens_within_the_tolerance(tmp_path):
    tiny_mamba2_checkpoint(tmp_path / "m")
    images = token_images(tmp_path / "m", "m", 1, 0)
    tokens, distances = nearest_tokens(_bfloat16(images.images(list(range(32)))), images)
    assert tokens.tolist() == list(range(32))
    assert 0 < distances.max() < ROW_TOLERANCE / 5


def test_rows_of_other_weights_are_far_from_every_image(tmp_path):
    tiny_mamba2_checkpoint(tmp_path / "m", seed=0)
    tiny_mamba2_checkpoint(tmp_path / "other" / "m", seed=1)
    ours, theirs = token_images(tmp_path / "m", "m", 1, 0), token_images(tmp_path / "other" / "m", "m", 1, 0)
    _, distances = nearest_tokens(theirs.images(list(range(32))), ours)
    assert distances.min() > ROW_TOLERANCE


def test_a_row_rounded_across_a_probe_center_is_found_without_the_vocabulary_search(tmp_path, monkeypatch):
    """A healthy row whose probe column nearest its center crossed it (rounding) has another code
    than its image: the lookup tries that bit flipped before a search of the whole vocabulary (a
    matrix product that cost a scan of a million keys 2 us a key in the few such rows)."""
    tiny_mamba2_checkpoint(tmp_path / "m")
    images = token_images(tmp_path / "m", "m", 1, 0)
    centers, _, _ = images.probe_signs
    margins = np.abs(images.probe - centers)
    token = int(margins.min(axis=1).argmin())  # the token with a probe column nearest its center
    column = int(margins[token].argmin())
    row = images.images([token])
    row[0, images.probe_columns[column]] = 2 * centers[column] - row[0, images.probe_columns[column]]  # mirrored
    moved = row[:, images.check_columns][:, images.probe_index]
    assert sign_codes(moved, centers)[0] != sign_codes(images.probe[token:token + 1], centers)[0]

    def no_search(*args):
        raise AssertionError("searched the vocabulary")
    monkeypatch.setattr(audit.checks.binding, "_searched_vocabulary", no_search)
    tokens, distances = nearest_tokens(row, images)
    assert tokens.tolist() == [token] and distances[0] < ROW_TOLERANCE


def test_a_row_holding_nan_or_inf_is_far_from_every_image_and_its_neighbours_still_bind(tmp_path):
    """Bytes read in another dtype can hold NaN and Inf: such a row is never near an image (the
    first-token comparison leaves it to the search, which sees it finite), and the healthy rows
    beside it in the batch decode as they would alone."""
    tiny_mamba2_checkpoint(tmp_path / "m")
    images = token_images(tmp_path / "m", "m", 1, 0)
    rows = images.images([3, 5, 7, 9, 11])
    rows[1, images.check_columns[0]] = np.nan  # a check column
    rows[2, images.probe_columns[0]] = np.inf  # a probe column
    rows[3, :] = -np.inf
    tokens, distances = nearest_tokens(rows, images)
    assert tokens[[0, 4]].tolist() == [3, 11] and distances[[0, 4]].max() < 1e-6
    assert (distances[1:4] > ROW_TOLERANCE).all()
