"""LMCache's key names (0.5.6 `lmcache/utils.py`, `v1/distributed`), parsed into report fields.

- ``CacheEngineKey`` (the vLLM connector's remote backends):
  ``{model}@{world_size}@{worker_id}@{chunk_hash:x}@{dtype}[@{tag}%{value}...]``; `model` is vLLM's
  model argument as given (slashes included), the hash may be negative, a tag's value may hold `%`.
- ``LayerCacheEngineKey`` (layerwise): ``@{layer_id}`` after the dtype, before the tags.
- ``ObjectKey`` (multiprocess mode's L2 adapters):
  ``{model}@{kv_rank:08x}@{object_group_id:x}@{chunk_hash_bytes_hex}[@{cache_salt}]``, where `kv_rank`
  packs ``world_size << 24 | global_rank << 16 | local_world_size << 8 | local_rank``.
- Older releases: ``{fmt}@{model}@{world_size}@{worker_id}@{hash}[@{dtype}]``.
"""

from __future__ import annotations

import re

from audit.producers.base import match_fields

# TORCH_DTYPE_TO_STR_DTYPE: LMCache refuses a key with any other dtype.
DTYPE_NAMES = ("half", "bfloat16", "float", "double", "int8", "uint8", "int16", "int32", "int64", "bool",
              "fp8_e4m3fn", "fp8_e4m3fnuz", "fp8_e5m2", "fp8_e5m2fnuz")
_DTYPE = "|".join(DTYPE_NAMES)
_ENGINE_KEY = re.compile(
    r"^(?P<model>[^@]+)@(?P<world_size>\d+)@(?P<worker_id>\d+)@(?P<chunk_hash>-?[0-9a-fA-F]+)"
    rf"@(?P<dtype>{_DTYPE})(?:@(?P<layer>\d+))?(?P<tags>(?:@[^@%]+%[^@]*)*)$",
    re.DOTALL,
)
_OBJECT_KEY = re.compile(
    r"^(?P<model>[^@]+)@(?P<kv_rank>[0-9a-f]{8})@(?P<object_group>[0-9a-f]+)"
    r"@(?P<chunk_hash>(?:[0-9a-f]{2})+)(?:@(?P<cache_salt>[^@/\\\x00]+))?$",
    re.DOTALL,
)
_LEGACY_KEY = re.compile(
    r"^(?P<fmt>[^@]+)@(?P<model>[^@]+)@(?P<world_size>\d+)@(?P<worker_id>\d+)"
    r"@(?P<chunk_hash>-?[0-9a-fA-F]+)(?:@(?P<dtype>[^@]+))?$",
    re.DOTALL,
)
_INTEGERS = frozenset({"world_size", "worker_id", "layer"})
SCHEME = "lmcache"


def parse_lmcache_key(key: str) -> dict | None:
    if match := _ENGINE_KEY.match(key):
        fields = match_fields(match, SCHEME, _INTEGERS)
        tags = fields.pop("tags", "")
        if tags:
            fields["tags"] = dict(tag.split("%", 1) for tag in tags[1:].split("@"))
        return fields
    if match := _OBJECT_KEY.match(key):
        fields = match_fields(match, SCHEME, _INTEGERS)
        kv_rank = int(fields["kv_rank"], 16)
        fields.update(world_size=kv_rank >> 24, worker_id=(kv_rank >> 16) & 0xFF,
                      local_world_size=(kv_rank >> 8) & 0xFF, local_rank=kv_rank & 0xFF,
                      object_group=int(fields["object_group"], 16))
        return fields
    if match := _LEGACY_KEY.match(key):
        return match_fields(match, SCHEME, _INTEGERS)
    return None

