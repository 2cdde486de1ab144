"""Rotary embeddings as vLLM 0.32 computes them (`audit.layouts.rotary`), held to torch's arithmetic
of ``RotaryEmbedding``, ``Llama3RotaryEmbedding``, ``YaRNScalingRotaryEmbedding`` and the dynamic
NTK ones written out here, and the start decoded back."""

import math

import numpy as np
import pytest

from audit.layouts import LayoutError
from audit.layouts.rotary import decode_start, rope_parameters, rotary_of, rotate, rotations_of


def _torch_inv_freq(base: float, rotary_dim: int) -> np.ndarray:
    torch = pytest.importorskip("torch")
    return (1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))).numpy()


ULPS = 4e-7  # torch's float32 pow is vectorized for the host's CPU: on AVX-512 it differs from numpy's (and AVX2's) by an ulp


def test_default_frequencies_are_vllms_and_partial_rotary_halves_the_pairs():
    rotary = rotary_of({"rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"}}, 128)
    assert rotary.rotary_dim == 128 and rotary.neox
    np.testing.assert_allclose(rotary.inv_freq, _torch_inv_freq(500000.0, 128), rtol=ULPS, atol=0)
    partial = rotary_of({"rope_theta": 10000.0, "partial_rotary_factor": 0.5}, 64)
    assert partial.rotary_dim == 32 and len(partial.inv_freq) == 16
    first, second = partial.columns(np.array([0, 15]))
    assert first.tolist() == [0, 15] and second.tolist() == [16, 31]


def test_llama3_scaling_divides_the_slow_pairs_only():
    params = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    scaled = rotary_of({"rope_parameters": params, "max_position_embeddings": 131072}, 128).inv_freq
    plain = _torch_inv_freq(500000.0, 128)
    wave = 2 * math.pi / plain
    np.testing.assert_allclose(scaled[wave < 8192 / 4], plain[wave < 8192 / 4], rtol=ULPS, atol=0)
    np.testing.assert_allclose(scaled[wave > 8192], plain[wave > 8192] / 8, rtol=1e-6)
    between = (wave >= 8192 / 4) & (wave <= 8192)
    assert between.any() and ((scaled[between] < plain[between]) & (scaled[between] > plain[between] / 8)).all()


def test_each_layer_kind_reads_its_own_parameters_and_others_are_refused():
    gemma = {"rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                 "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}}
    assert rope_parameters(gemma, "sliding_attention")["rope_theta"] == 10000.0
    assert rope_parameters(gemma)["rope_theta"] == 1000000.0
    old = {"rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}, "max_position_embeddings": 100}
    linear = rotary_of(old, 64)
    np.testing.assert_allclose(linear.inv_freq, _torch_inv_freq(5e5, 64) / 2, rtol=1e-6)
    assert linear.max_position == 200
    with pytest.raises(LayoutError, match="M-RoPE"):
        rotary_of({"rope_parameters": {"rope_type": "default", "mrope_section": [16, 24, 24]}}, 128)
    with pytest.raises(LayoutError, match="long_factor of 3, not 64"):
        rotations_of({"rope_parameters": {"rope_type": "longrope", "short_factor": [1.0] * 64,
                                          "long_factor": [1.0] * 3, "original_max_position_embeddings": 4096}}, 128)


def _torch_yarn(base: float, rotary_dim: int, factor: float, original: int, beta_fast=32, beta_slow=1):
    """``YaRNScalingRotaryEmbedding._compute_inv_freq`` (vLLM 0.32), with ``yarn_find_correction_range``
    and ``yarn_linear_ramp_mask`` written out."""
    torch = pytest.importorskip("torch")

    def dim(rotations):
        return (rotary_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = max(math.floor(dim(beta_fast)), 0), min(math.ceil(dim(beta_slow)), rotary_dim - 1)
    high = high + 0.001 if low == high else high
    pos_freqs = base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim)
    mask = 1 - torch.clamp((torch.arange(rotary_dim // 2, dtype=torch.float) - low) / (high - low), 0, 1)
    return ((1.0 / (factor * pos_freqs)) * (1 - mask) + (1.0 / pos_freqs) * mask).numpy()


def test_yarn_blends_interpolated_and_own_frequencies_and_scales_the_turn():
    params = {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0, "original_max_position_embeddings": 32768}
    rotary = rotary_of({"rope_parameters": params, "max_position_embeddings": 131072}, 128)
    expected = _torch_yarn(1000000.0, 128, 4.0, 32768)
    np.testing.assert_allclose(rotary.inv_freq, expected, rtol=2e-7)
    plain = _torch_inv_freq(1000000.0, 128)
    assert rotary.inv_freq[0] == pytest.approx(plain[0]) and rotary.inv_freq[-1] == pytest.approx(plain[-1] / 4)
    assert rotary.magnitude == pytest.approx(0.1 * math.log(4.0) + 1) and rotary.max_position == 131072
    assert rotary.describe()["magnitude"] == rotary.magnitude
    given = rotary_of({"rope_parameters": {**params, "attention_factor": 0.5}}, 128)
    assert given.magnitude == 0.5
    ratio = rotary_of({"rope_parameters": {**params, "mscale": 1.0, "mscale_all_dim": 0.5}}, 128)
    assert ratio.magnitude == pytest.approx((0.1 * math.log(4) + 1) / (0.05 * math.log(4) + 1))
    assert rotary_of({"rope_theta": 1e4}, 64).magnitude == 1.0 and "magnitude" not in rotary_of({}, 64).describe()


def test_dynamic_ntk_fixes_one_base():
    """vLLM computes a dynamic NTK cache once: the base itself where the trained positions are the
    model's maximum (the default), else ``base * (factor * max / trained - (factor - 1)) ** (d / (d - 2))``;
    Hunyuan's ``alpha``: ``base * alpha ** (d / (d - 2))``."""
    plain = rotary_of({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
                       "max_position_embeddings": 4096}, 64)
    np.testing.assert_allclose(plain.inv_freq, _torch_inv_freq(10000.0, 64), rtol=1e-6)
    trained = rotary_of({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0,
                                             "max_trained_positions": 2048}, "max_position_embeddings": 4096}, 64)
    np.testing.assert_allclose(trained.inv_freq, _torch_inv_freq(10000.0 * 3.0 ** (64 / 62), 64), rtol=1e-6)
    alpha = rotary_of({"rope_parameters": {"rope_type": "dynamic", "alpha": 1000.0, "rope_theta": 10000.0}}, 128)
    np.testing.assert_allclose(alpha.inv_freq, _torch_inv_freq(10000.0 * 1000.0 ** (128 / 126), 128), rtol=1e-6)


@pytest.mark.parametrize("head, start", [(64, 0), (64, 4096), (128, 123456), (128, 7)])
def test_a_pages_start_is_decoded_from_its_rows(head, start):
    """Rows turned to consecutive positions (rounded to bfloat16's 8 bits, as a page holds them)
    decode to their first position exactly; the start is evidence, the distance the verdict."""
    rng = np.random.default_rng(head + start)
    rotary = rotary_of({"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 8192},
                        "max_position_embeddings": 131072}, head)
    pairs = rotary.probed_pairs
    pre_first, pre_second = rng.standard_normal((2, 16, len(pairs))).astype(np.float32)
    first, second = rotate(pre_first, pre_second, rotary.angles(start + np.arange(16), pairs))
    noisy = [x * (1 + rng.uniform(-4e-3, 4e-3, x.shape)) for x in (first, second)]
    assert decode_start(noisy[0] + 1j * noisy[1], pre_first + 1j * pre_second, rotary, pairs) == start


def test_turns_read_from_the_kept_table_are_the_bits_of_turns_computed_directly():
    from audit.layouts.rotary import TURNS_KEPT

    rotary = rotary_of({"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                            "original_max_position_embeddings": 2048},
                        "max_position_embeddings": 8192}, 64)
    assert rotary.magnitude != 1.0  # (the magnitude is kept in the table too)
    pairs = rotary.probed_pairs

    def direct(positions):
        angles = rotary.angles(positions, pairs)
        return (np.cos(angles) + 1j * np.sin(angles)) * np.float32(rotary.magnitude)

    for positions in (np.arange(16) + 48, np.array([5000, 3, 70000]), np.array([2, -1]), np.array([TURNS_KEPT - 1])):
        turned = rotary.turns(positions, pairs)
        assert turned.dtype == np.complex64 and turned.shape == (len(positions), len(pairs))
        np.testing.assert_array_equal(turned, direct(positions).astype(np.complex64))
        assert np.array_equal(turned.view(np.uint32), rotary.turns(positions, pairs).view(np.uint32))
    kept = rotary._turn_tables[pairs.tobytes()]
    assert len(kept) == TURNS_KEPT  # grown to the largest position under the limit; 70000 and -1 turned directly


def test_pages_decoded_at_once_start_where_each_decoded_alone_does():
    """`decode_starts` of a batch: each page's start as `decode_start` gives it alone, whatever the
    others hold (a start near 0, far out, a page whose slow pairs carry nothing, an all-zero page)."""
    from audit.layouts.rotary import decode_starts

    rng = np.random.default_rng(9)
    rotary = rotary_of({"rope_parameters": {"rope_theta": 10000.0}}, 64)
    pairs = rotary.probed_pairs
    pages = []
    for start in (0, 1, 48, 4096, 30000, 32):  # (within the slowest pair's turn: 47,000 positions)
        pre = (rng.standard_normal((16, len(pairs))) + 1j * rng.standard_normal((16, len(pairs)))).astype(np.complex64)
        first, second = rotate(pre.real, pre.imag, rotary.angles(start + np.arange(16), pairs))
        pages.append(((first + 1j * second).astype(np.complex64), pre))
    pages[5][0][:, :8] = 0  # (its slowest pairs silent: unwrapped from the fastest of those left)
    pages.append((np.zeros((16, len(pairs)), np.complex64), pages[0][1]))
    alone = [decode_start(observed, pre, rotary, pairs) for observed, pre in pages]
    assert alone[:5] == [0, 1, 48, 4096, 30000] and alone[6] == 0
    together = decode_starts(np.stack([o for o, _ in pages]), np.stack([p for _, p in pages]), rotary, pairs)
    assert together.tolist() == alone
