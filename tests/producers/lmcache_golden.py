"""Writes lmcache_0_5_6.json from LMCache 0.5.6's own code. Run it with a Python that has
lmcache==0.5.6 and torch (a scratch venv, never the project's):
`python tests/producers/lmcache_golden.py > tests/producers/lmcache_0_5_6.json`."""

import json

import torch
from lmcache.utils import CacheEngineKey, LayerCacheEngineKey, parse_cache_key
from lmcache.v1 import protocol
from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.protocol import RemoteMetadata, init_remote_metadata_info

KEYS = {
    "plain": CacheEngineKey("Qwen/Qwen3-0.6B", 1, 0, 0x1a2b3c4d5e6f7788, torch.bfloat16),
    "negative_hash": CacheEngineKey("/models/tiny-llama", 2, 1, -0x5db65aa1f24507d4, torch.float32),
    "tags": CacheEngineKey("Qwen/Qwen3-0.6B", 1, 0, 0x77, torch.half,
                           {"lmcache.tag.user": "alice", "lmcache.tag.lora": "x%y"}),
    "layerwise": LayerCacheEngineKey("Qwen/Qwen3-0.6B", 2, 1, 0x99, torch.bfloat16, None, layer_id=3),
    "layerwise_tags": LayerCacheEngineKey("m", 1, 0, -0x99, torch.float8_e4m3fn, {"lmcache.tag.user": "bob"},
                                          layer_id=11),
}
ONE_GROUP = {
    "kv_2ltd_float32": (262144, [torch.Size([2, 2, 256, 64])], [torch.float32], MemoryFormat.KV_2LTD),
    "kv_2ltd_bf16_short": (204800, [torch.Size([2, 4, 100, 128])], [torch.bfloat16], MemoryFormat.KV_2LTD),
    "mla": (884736, [torch.Size([1, 3, 256, 576])], [torch.bfloat16], MemoryFormat.KV_MLA_FMT),
    "t2d_layer": (65536, [torch.Size([256, 2, 64])], [torch.half], MemoryFormat.KV_T2D),
}
TWO_GROUPS = {
    "two_groups": (393216, [torch.Size([2, 2, 256, 64]), torch.Size([2, 1, 256, 128])],
                   [torch.bfloat16, torch.float32], MemoryFormat.KV_2LTD),
}


def main() -> None:
    keys = {name: key.to_string() for name, key in KEYS.items()}
    for name, key in keys.items():
        assert parse_cache_key(key).to_string() == key, name
    headers = {}
    for groups, table in ((1, ONE_GROUP), (2, TWO_GROUPS)):
        init_remote_metadata_info(groups)
        for name, arguments in table.items():
            headers[name] = {"groups": groups, "hex": RemoteMetadata(*arguments).serialize().hex()}
    print(json.dumps({"lmcache": "0.5.6", "dtype_to_int": {str(k): v for k, v in protocol.DTYPE_TO_INT.items()},
                      "formats": {f.name: f.value for f in MemoryFormat}, "keys": keys, "headers": headers},
                     indent=1))


if __name__ == "__main__":
    main()
