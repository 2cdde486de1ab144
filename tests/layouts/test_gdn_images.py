"""Token images of the GDN families (issue #40): layer 0's conv rows as vLLM computes them, per TP rank.

The reference below does what vLLM does with the checkpoint (each rank's shard of the projection as
its weight loader cuts it, then the forward's split and concatenation), not the index arithmetic of
`audit.layouts.families.gdn`, so the two are compared."""

from __future__ import annotations

import json

import numpy as np
import pytest

from audit.layouts import LayoutError
from audit.layouts.weights import token_images
from tests.helpers import write_safetensors

HIDDEN, VOCAB, EPS = 8, 16, 1e-6
# 2 key heads of 3, 4 value heads of 2: two value heads per key-head group, so the interleaving shows
HEADS = {"linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 3,
         "linear_value_head_dim": 2, "linear_conv_kernel_dim": 4}
KEY, VALUE = 2 * 3, 4 * 2
LAYERS = ["linear_attention", "linear_attention", "full_attention"]


def _model(directory, model_type: str, tensors: dict, layer_types=LAYERS) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    config = {"model_type": model_type, "hidden_size": HIDDEN, "vocab_size": VOCAB, "rms_norm_eps": EPS,
              "num_hidden_layers": len(layer_types), "layer_types": layer_types, "num_attention_heads": 2,
              "num_key_value_heads": 1, "head_dim": 4, **HEADS}
    (directory / "config.json").write_text(json.dumps(config))
    write_safetensors(directory / "model.safetensors", tensors)


def _random(rng, *shape) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def _rmsnorm(tensors: dict, tokens: list[int], weight: np.ndarray) -> np.ndarray:
    h = tensors["model.embed_tokens.weight"][tokens].astype(np.float64)
    return h / np.sqrt((h * h).mean(axis=1, keepdims=True) + EPS) * weight


def _qwen3_next_by_vllm(tensors: dict, tokens: list[int], tp: int, rank: int) -> np.ndarray:
    """GemmaRMSNorm (1 + weight); ``in_proj_qkvz`` loaded as one shard (the rank's contiguous rows);
    ``fix_query_key_value_ordering``: view per local key-head group, split [q, k, v, z], then
    ``cat(q, k, v)`` each flattened over the rank's heads."""
    h = _rmsnorm(tensors, tokens, 1 + tensors["model.layers.0.input_layernorm.weight"])
    weight = tensors["model.layers.0.linear_attn.in_proj_qkvz.weight"]
    share = len(weight) // tp
    out = h @ weight[rank * share:(rank + 1) * share].T
    per_group = out.reshape(len(tokens), 2 // tp, -1)
    q, k, v, _z = np.split(per_group, [3, 6, 6 + 4], axis=2)
    return np.concatenate([part.reshape(len(tokens), -1) for part in (q, k, v)], axis=1)


def _olmo_hybrid_by_vllm(tensors: dict, tokens: list[int], tp: int, rank: int) -> np.ndarray:
    """RMSNorm (weight); ``in_proj_qkvg`` = the rank's share of q, k, v and g stacked; the conv input
    is its first ``(2 * key_dim + value_dim) / tp`` columns."""
    h = _rmsnorm(tensors, tokens, tensors["model.layers.0.input_layernorm.weight"])
    shards = []
    for name in ("q_proj", "k_proj", "v_proj", "g_proj"):
        weight = tensors[f"model.layers.0.linear_attn.{name}.weight"]
        share = len(weight) // tp
        shards.append(weight[rank * share:(rank + 1) * share])
    return (h @ np.concatenate(shards).T)[:, :(2 * KEY + VALUE) // tp]


def _qwen3_5_by_vllm(tensors: dict, tokens: list[int], tp: int, rank: int, prefix: str = "model.") -> np.ndarray:
    """GemmaRMSNorm (1 + weight); ``in_proj_qkv`` loaded as shards 0, 1, 2 of ``in_proj_qkvz``
    (``gqa_interleaved_layout=False``: output sizes [key, key, value, value], the rank's share of
    each); the conv input is the rank's q, k, v, in that order."""
    embedded = {"model.embed_tokens.weight": tensors[prefix + "embed_tokens.weight"]}
    h = _rmsnorm(embedded, tokens, 1 + tensors[prefix + "layers.0.input_layernorm.weight"])
    q, k, v = np.split(tensors[prefix + "layers.0.linear_attn.in_proj_qkv.weight"], [KEY, 2 * KEY])
    shards = [part[rank * len(part) // tp:(rank + 1) * len(part) // tp] for part in (q, k, v)]
    return h @ np.concatenate(shards).T


def qwen3_next_checkpoint(directory, seed: int = 0, **config) -> dict:
    rng = np.random.default_rng(seed)
    tensors = {"model.embed_tokens.weight": _random(rng, VOCAB, HIDDEN),
               "model.layers.0.input_layernorm.weight": 0.1 * _random(rng, HIDDEN),
               "model.layers.0.linear_attn.in_proj_qkvz.weight": _random(rng, 2 * KEY + 2 * VALUE, HIDDEN)}
    _model(directory, "qwen3_next", tensors, **config)
    return tensors


def olmo_hybrid_checkpoint(directory, seed: int = 0, **config) -> dict:
    rng = np.random.default_rng(seed)
    tensors = {"model.embed_tokens.weight": _random(rng, VOCAB, HIDDEN),
               "model.layers.0.input_layernorm.weight": 1 + 0.1 * _random(rng, HIDDEN),
               **{f"model.layers.0.linear_attn.{name}.weight": _random(rng, rows, HIDDEN)
                  for name, rows in (("q_proj", KEY), ("k_proj", KEY), ("v_proj", VALUE), ("g_proj", VALUE))}}
    _model(directory, "olmo_hybrid", tensors, **config)
    return tensors


def qwen3_5_checkpoint(directory, seed: int = 0, prefix: str = "model.", **config) -> dict:
    """Qwen3.5's text model: flat ``in_proj_qkv`` (q, k, v rows) beside ``in_proj_z``; a released
    (vision-language) checkpoint holds it under ``model.language_model.``."""
    rng = np.random.default_rng(seed)
    tensors = {prefix + "embed_tokens.weight": _random(rng, VOCAB, HIDDEN),
               prefix + "layers.0.input_layernorm.weight": 0.1 * _random(rng, HIDDEN),
               prefix + "layers.0.linear_attn.in_proj_qkv.weight": _random(rng, 2 * KEY + VALUE, HIDDEN),
               prefix + "layers.0.linear_attn.in_proj_z.weight": _random(rng, VALUE, HIDDEN)}
    _model(directory, "qwen3_5_text", tensors, **config)
    return tensors


@pytest.mark.parametrize("prefix", ["model.", "model.language_model."])
@pytest.mark.parametrize("tp", [1, 2])
def test_qwen3_5_images_are_vllms_conv_inputs_per_rank(tmp_path, tp, prefix):
    tensors = qwen3_5_checkpoint(tmp_path / "q", prefix=prefix)
    tokens = [0, 5, 15, 5]
    for rank in range(tp):
        images = token_images(tmp_path / "q", "q", tp, rank)
        assert images.columns == (2 * KEY + VALUE) // tp
        np.testing.assert_allclose(images.images(tokens), _qwen3_5_by_vllm(tensors, tokens, tp, rank, prefix),
                                   rtol=1e-5, atol=1e-5)
    assert images.source["projection"].startswith(prefix + "layers.0.linear_attn.in_proj_qkv")


@pytest.mark.parametrize("tp", [1, 2])
def test_qwen3_next_images_are_vllms_conv_inputs_per_rank(tmp_path, tp):
    tensors = qwen3_next_checkpoint(tmp_path / "q")
    tokens = [0, 5, 15, 5]
    for rank in range(tp):
        images = token_images(tmp_path / "q", "q", tp, rank)
        assert (images.vocab_size, images.columns) == (VOCAB, (2 * KEY + VALUE) // tp)
        np.testing.assert_allclose(images.images(tokens), _qwen3_next_by_vllm(tensors, tokens, tp, rank),
                                   rtol=1e-5, atol=1e-5)
    assert images.source["norm"].endswith("(1 + weight)")


@pytest.mark.parametrize("tp", [1, 2])
def test_olmo_hybrid_images_are_vllms_conv_inputs_per_rank(tmp_path, tp):
    tensors = olmo_hybrid_checkpoint(tmp_path / "o")
    tokens = [1, 2, 14]
    for rank in range(tp):
        images = token_images(tmp_path / "o", "o", tp, rank)
        assert images.columns == (2 * KEY + VALUE) // tp
        np.testing.assert_allclose(images.images(tokens), _olmo_hybrid_by_vllm(tensors, tokens, tp, rank),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("make", [qwen3_next_checkpoint, qwen3_5_checkpoint, olmo_hybrid_checkpoint])
def test_the_table_holds_the_images_on_the_check_columns(tmp_path, monkeypatch, make):
    monkeypatch.setenv("MOONCAKE_AUDIT_CACHE", str(tmp_path / "cache"))
    make(tmp_path / "m")
    images = token_images(tmp_path / "m", "m", 2, 1)
    np.testing.assert_allclose(images.table, images.images(np.arange(VOCAB))[:, images.check_columns],
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("make", [qwen3_next_checkpoint, qwen3_5_checkpoint, olmo_hybrid_checkpoint])
def test_attention_at_layer_0_is_not_bound(tmp_path, make):
    make(tmp_path / "m", layer_types=["full_attention", "linear_attention"])
    with pytest.raises(LayoutError, match="layer 0 is attention"):
        token_images(tmp_path / "m", "m", 1, 0)


@pytest.mark.parametrize("make", [qwen3_next_checkpoint, qwen3_5_checkpoint])
def test_heads_that_do_not_shard_are_not_bound(tmp_path, make):
    make(tmp_path / "q")
    with pytest.raises(LayoutError, match="shard"):
        token_images(tmp_path / "q", "q", 4, 0)
