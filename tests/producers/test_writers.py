"""The tests' LMCache writers make the bytes LMCache 0.5.6's own code made."""

import pytest

from tests.producers.writers import GOLDEN, header_bytes, lmcache_key

KEYS = {
    "plain": ("Qwen/Qwen3-0.6B", 1, 0, 0x1a2b3c4d5e6f7788, "bfloat16", None, None),
    "negative_hash": ("/models/tiny-llama", 2, 1, -0x5db65aa1f24507d4, "float", None, None),
    "tags": ("Qwen/Qwen3-0.6B", 1, 0, 0x77, "half", None, {"user": "alice", "lora": "x%y"}),
    "layerwise": ("Qwen/Qwen3-0.6B", 2, 1, 0x99, "bfloat16", 3, None),
    "layerwise_tags": ("m", 1, 0, -0x99, "fp8_e4m3fn", 11, {"user": "bob"}),
}


@pytest.mark.parametrize("name", sorted(KEYS))
def test_keys_are_lmcaches(name):
    model, world, worker, chunk_hash, dtype, layer, tags = KEYS[name]
    assert lmcache_key(model, world, worker, chunk_hash, dtype, layer=layer, tags=tags) == GOLDEN["keys"][name]


# What the golden script passed to RemoteMetadata: (length, fmt, [(dtype code, shape)]).
HEADERS = {
    "kv_2ltd_float32": (262144, 1, [(4, (2, 2, 256, 64))]),
    "kv_2ltd_bf16_short": (204800, 1, [(3, (2, 4, 100, 128))]),
    "mla": (884736, 6, [(3, (1, 3, 256, 576))]),
    "t2d_layer": (65536, 2, [(2, (256, 2, 64))]),  # torch.half serializes as 2, as torch.float16 does
    "two_groups": (393216, 1, [(3, (2, 2, 256, 64)), (4, (2, 1, 256, 128))]),
}


@pytest.mark.parametrize("name", sorted(HEADERS))
def test_headers_are_lmcaches(name):
    assert header_bytes(*HEADERS[name]).hex() == GOLDEN["headers"][name]["hex"]
