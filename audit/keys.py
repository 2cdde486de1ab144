"""Key schemes of the producers that publish into Mooncake Store, parsed into report fields.

A key that matches no scheme is `opaque`: it is still audited by its bytes.
"""

from __future__ import annotations

import re

# vLLM MooncakeStoreConnector (0.32.0 `store/data.py` PoolKey.build_prefix):
#   [{cache_prefix}@]{model}{store_namespace}@tp_rank:{t}@pcp{p}@dcp{d}@pp_rank:{r}[@group:{g}]@{chunk_hash_hex}
# store_namespace is empty (the historical rank-local format) or, for the opt-in Store TP formats
# (`worker.py` _select_store_tp_layout, TPShardedStoreLayout.shared_namespace):
#   @store_tp:{n}@store_pp:{p}@store_format:tp_shared_lbhnc | tp_shared_lbnhc
#   @store_pp:{p}@store_format:tp_shared_mqa
#   @store_pp:{p}@store_format:rank_local_tp{t}_layout_{KVCacheLayout name}
# Parsed from the right, because a cache_prefix may itself contain '@'; the model never starts
# with a store_* field, so a namespace is never swallowed into the prefix and model.
_VLLM = re.compile(
    r"^(?:(?P<cache_prefix>.*)@)?(?P<model>(?!store_(?:tp|pp|format):)[^@]+)"
    r"(?:(?:@store_tp:(?P<store_tp>\d+))?@store_pp:(?P<store_pp>\d+)"
    r"@store_format:(?P<store_format>tp_shared_lbhnc|tp_shared_lbnhc|tp_shared_mqa"
    r"|rank_local_tp\d+_layout_[A-Z]+))?"
    r"@tp_rank:(?P<tp_rank>\d+)"
    r"(?:@pcp(?P<pcp>\d+))?(?:@dcp(?P<dcp>\d+))?@pp_rank:(?P<pp_rank>\d+)"
    r"(?:@group:(?P<group>\d+))?@(?P<chunk_hash>[0-9a-fA-F]+)$",
    re.DOTALL,
)
# A key with any of these is vLLM's: if it does not match _VLLM exactly it is unparsed, never
# handed to another scheme's pattern (which could half-parse it).
_VLLM_MARKERS = ("@tp_rank:", "@pp_rank:", "@store_format:", "@store_pp:")
# LMCache CacheEngineKey: model@world_size@worker_id@chunk_hash_hex@dtype[@tag%val...]
_LMCACHE = re.compile(
    r"^(?P<model>[^@]+)@(?P<world_size>\d+)@(?P<worker_id>\d+)@(?P<chunk_hash>-?[0-9a-fA-F]+)"
    r"@(?P<dtype>[^@%]+)(?P<tags>(?:@[^@%]+%[^@]*)*)$",
    re.DOTALL,
)
# Older LMCache: fmt@model@world_size@worker_id@hash[@dtype]
_LMCACHE_OLD = re.compile(
    r"^(?P<fmt>[^@]+)@(?P<model>[^@]+)@(?P<world_size>\d+)@(?P<worker_id>\d+)"
    r"@(?P<chunk_hash>-?[0-9a-fA-F]+)(?:@(?P<dtype>[^@]+))?$",
    re.DOTALL,
)
# SGLang HiCache: [{tag}_{model}_]{page_hash}_{tp}[_{pp}]_{k|v|temporal|conv_i}
_SGLANG = re.compile(
    r"^(?:(?P<prefix>.*)_)?(?P<page_hash>[0-9a-fA-F]{16,})_(?P<tp_rank>\d+)(?:_(?P<pp_rank>\d+))?"
    r"_(?P<part>k|v|temporal|conv_\d+)$",
    re.DOTALL,
)

_INTEGER_FIELDS = {"tp_rank", "pcp", "dcp", "pp_rank", "group", "world_size", "worker_id", "store_tp",
                   "store_pp"}
_RANK_LOCAL_TP = re.compile(r"rank_local_tp(\d+)_layout_")


def _fields(match: re.Match, scheme: str) -> dict:
    fields: dict = {"scheme": scheme}
    for name, value in match.groupdict().items():
        if value is None or value == "":
            continue
        fields[name] = int(value) if name in _INTEGER_FIELDS else value
    return fields


def parse_key(key: str) -> dict:
    """The key's scheme and fields, e.g. ``{"scheme": "vllm", "model": ..., "tp_rank": 1, ...}``."""
    if match := _VLLM.match(key):
        fields = _fields(match, "vllm")
        if tp := _RANK_LOCAL_TP.match(fields.get("store_format", "")):
            fields["producer_tp"] = int(tp.group(1))  # the producer's TP size, said by the key
        return fields
    if any(marker in key for marker in _VLLM_MARKERS):
        return {"scheme": "opaque"}
    if match := _SGLANG.match(key):
        return _fields(match, "sglang")
    if match := _LMCACHE.match(key):
        fields = _fields(match, "lmcache")
        tags = fields.pop("tags", "")
        if tags:
            fields["tags"] = dict(tag.split("%", 1) for tag in tags[1:].split("@"))
        return fields
    if match := _LMCACHE_OLD.match(key):
        return _fields(match, "lmcache")
    return {"scheme": "opaque"}


def vllm_key(model: str, chunk_hash: str, *, tp_rank: int = 0, pcp: int = 0, dcp: int = 0,
             pp_rank: int = 0, group: int | None = 0, cache_prefix: str = "",
             store_namespace: str = "") -> str:
    """The key vLLM's MooncakeStoreConnector publishes (group=None: releases before `@group:`;
    `store_namespace`: e.g. ``@store_pp:1@store_format:tp_shared_mqa``)."""
    key = f"{model}{store_namespace}@tp_rank:{tp_rank}@pcp{pcp}@dcp{dcp}@pp_rank:{pp_rank}"
    if group is not None:
        key += f"@group:{group}"
    key = f"{key}@{chunk_hash}"
    return f"{cache_prefix}@{key}" if cache_prefix else key
