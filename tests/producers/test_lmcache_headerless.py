"""LMCache values without a header (`save_chunk_meta: false`): the KV alone, `[2, layers, tokens,
kv_heads_per_rank * head_dim]` in the key's dtype, read by the key's model config and checked per
layer and K/V half as a header-described value is."""

import numpy as np
import pytest

from audit.judge.plan import CheckPlan
from audit.judge.values import value_reading
from audit.layouts.infer import LayoutRequest
from audit.producers.lmcache.values import kv_shape
from tests.helpers import check_in_buffer
from tests.producers.writers import kv_chunk, lmcache_key, lmcache_value

MODEL = "/models/tiny-llama"


def llama(kv_heads: int = 1, **extra) -> dict:
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 128, "num_attention_heads": 2,
            "num_key_value_heads": kv_heads, "head_dim": 64, "num_hidden_layers": 2, "intermediate_size": 256,
            "vocab_size": 1000, "torch_dtype": "float32", **extra}


CONFIGS = {"tiny-llama": llama()}


def key(chunk_hash: int = 0x5DB65AA1F24507D4, *, world: int = 1, worker: int = 0, dtype: str = "float", **kw) -> str:
    return lmcache_key(MODEL, world, worker, chunk_hash, dtype, **kw)


def reading(name: str, value: bytes, configs=CONFIGS):
    found = value_reading(name, np.frombuffer(value, dtype=np.uint8), configs)
    return None if found is None else found[1]


def scan(values: dict[str, bytes], config: dict | None = None) -> dict:
    """check_batch over the values laid out in one host buffer, as a scan with --model-config."""
    requests = [LayoutRequest(config or llama(), MODEL, block_size=16)]
    return check_in_buffer(values, CheckPlan(requests=requests, keep_regions=True))


def test_a_full_chunk_decodes_to_one_region_per_layer_and_half():
    value = lmcache_value(kv_chunk(np.random.default_rng(0)), header=False)
    assert len(value) == 262_144  # 256 tokens x 2 x 2 layers x 64 x float32
    found = reading(key(), value)
    assert found.disagreements == ()
    assert [(s.name, r.kind, r.offset, r.length, r.dtype, r.shape) for s, r in found.layout.regions()] == [
        ("k.layers.0", "kv", 0, 65536, "float32", (256, 64)), ("k.layers.1", "kv", 65536, 65536, "float32", (256, 64)),
        ("v.layers.0", "kv", 131072, 65536, "float32", (256, 64)),
        ("v.layers.1", "kv", 196608, 65536, "float32", (256, 64))]
    assert found.decoded == {"headerless": {"format": "KV_2LTD", "dtype": "float32", "layers": 2,
                                            "kv_heads_per_rank": 1, "head_dim": 64, "bytes_per_token": 1024,
                                            "shape": [2, 2, 256, 64]}}
    record = scan({key(): value})[key()]
    assert record.verdicts == [] and record.layout.startswith("lmcache KV_2LTD headerless")
    assert [row["segment"] for row in record.regions] == ["k.layers.0", "k.layers.1", "v.layers.0", "v.layers.1"]


def test_a_short_last_chunk_is_legitimate():
    value = lmcache_value(kv_chunk(np.random.default_rng(1), tokens=100), header=False)
    found = reading(key(), value)
    assert found.disagreements == () and found.decoded["headerless"]["shape"] == [2, 2, 100, 64]
    assert scan({key(): value})[key()].verdicts == []


def test_all_zero_kv_is_a_zero_value():
    value = lmcache_value(np.zeros((2, 2, 256, 64), np.float32), header=False)
    record = scan({key(): value})[key()]
    assert record.verdicts == ["ZERO_VALUE"] and record.evidence["decoded"]["headerless"]["shape"] == [2, 2, 256, 64]


def test_nan_in_one_layers_v_is_nonfinite_naming_the_region():
    kv = kv_chunk(np.random.default_rng(2))
    kv[1, 1, 7, 3] = np.nan  # layer 1's V
    record = scan({key(): lmcache_value(kv, header=False)})[key()]
    assert record.verdicts == ["NONFINITE"]
    assert [(r["segment"], r["nan"]) for r in record.evidence["nonfinite"]["regions"]] == [("v.layers.1", True)]


def test_a_chunk_size_above_lmcache_default_is_legitimate():
    # `chunk_size: 512` is not in the key: 512 tokens are a whole chunk, not too many.
    value = lmcache_value(kv_chunk(np.random.default_rng(4), tokens=512), header=False)
    found = reading(key(), value)
    assert found.disagreements == () and found.decoded["headerless"]["shape"] == [2, 2, 512, 64]
    assert scan({key(): value})[key()].verdicts == []


@pytest.mark.parametrize("size", [262_144 - 4096 + 3, 262_144 + 1000, 0])
def test_a_size_not_a_whole_number_of_tokens_is_a_size_mismatch(size):
    value = lmcache_value(kv_chunk(np.random.default_rng(3), tokens=257), header=False)[:size]
    found = reading(key(), value)
    assert found.layout is None and [d.kind for d in found.disagreements] == ["size"]
    evidence = found.disagreements[0].evidence
    assert evidence["value_size"] == size and evidence["bytes_per_token"] == 1024
    assert evidence["expected_size"] == "a positive multiple of 1024"
    if size:
        record = scan({key(): value})[key()]
        assert record.verdicts == ["SIZE_MISMATCH"]
        assert record.evidence["size_mismatch"]["value_size"] == size
        assert record.evidence["decoded"]["headerless"]["bytes_per_token"] == 1024


def test_tp2_with_one_kv_head_holds_the_replicated_head_on_each_worker():
    config = llama(kv_heads=1)
    assert kv_shape(config, 2) == (2, 1, 64) and kv_shape(llama(kv_heads=2), 2) == (2, 1, 64)
    assert kv_shape(llama(kv_heads=4), 2) == (2, 2, 64)
    head = lmcache_value(kv_chunk(np.random.default_rng(4)), header=False)
    values = {key(world=2, worker=worker): head for worker in (0, 1)}
    records = scan(values, config)
    assert all(record.verdicts == [] and record.layout.startswith("lmcache KV_2LTD headerless")
               for record in records.values())
    assert reading(key(world=2), head[:-1024 * 2]).decoded["headerless"]["shape"] == [2, 2, 254, 64]


def test_head_dim_from_the_hidden_size_and_the_keys_dtype():
    config = llama(kv_heads=2)
    del config["head_dim"]  # hidden_size // num_attention_heads = 64
    kv = kv_chunk(np.random.default_rng(5), hidden=128, dtype=np.float16)
    found = reading(key(dtype="half"), lmcache_value(kv, header=False), {"tiny-llama": config})
    assert found.disagreements == () and found.decoded["headerless"]["dtype"] == "float16"
    assert found.decoded["headerless"]["shape"] == [2, 2, 256, 128]


def test_a_layerwise_key_is_one_layer():
    kv = np.random.default_rng(6).normal(size=(256, 2, 64)).astype(np.float16)
    found = reading(key(dtype="half", layer=1), kv.tobytes())
    assert [(s.name, s.layer, r.shape) for s, r in found.layout.regions()] == [("kv.layers.1", 1, (256, 2, 64))]


def test_a_valid_header_keeps_the_header_and_no_config_keeps_the_bytes_opaque():
    kv = kv_chunk(np.random.default_rng(7))
    assert "header" in reading(key(), lmcache_value(kv)).decoded
    assert reading(key(), lmcache_value(kv, header=False), {}) is None
    assert reading(key(), lmcache_value(kv, header=False), {"other-model": llama()}) is None
    truncated = reading(key(), lmcache_value(kv)[:-4096])  # a header, the size wrong: the header's mismatch
    assert "header" in truncated.decoded and [d.kind for d in truncated.disagreements] == ["size"]


@pytest.mark.parametrize("config", [
    {"model_type": "deepseek_v3", "num_hidden_layers": 2, "num_attention_heads": 2, "hidden_size": 128,
     "kv_lora_rank": 512, "qk_rope_head_dim": 64},                                        # MLA
    {"model_type": "granitemoehybrid", "num_hidden_layers": 2, "num_attention_heads": 2, "hidden_size": 128,
     "layer_types": ["mamba", "attention"], "mamba_n_heads": 4},                          # hybrid
    {"model_type": "mamba", "num_hidden_layers": 2, "hidden_size": 128, "state_size": 16},
])
def test_models_that_are_not_plain_attention_stay_opaque(config):
    value = lmcache_value(kv_chunk(np.random.default_rng(8)), header=False)
    assert kv_shape(config, 1) is None and reading(key(), value, {"tiny-llama": config}) is None
