"""vLLM's MooncakeStoreConnector: its key names and chunks (its value layouts are `audit.layouts`)."""

from __future__ import annotations

import re

from audit.producers.base import Member, Producer, match_fields

# vLLM MooncakeStoreConnector (0.32.0 `store/data.py` PoolKey.build_prefix):
#   [{cache_prefix}@]{model}{store_namespace}@tp_rank:{t}@pcp{p}@dcp{d}@pp_rank:{r}[@group:{g}]@{chunk_hash_hex}
# store_namespace is empty (the historical rank-local format) or, for the opt-in Store TP formats
# (`worker.py` _select_store_tp_layout, TPShardedStoreLayout.shared_namespace):
#   @store_tp:{n}@store_pp:{p}@store_format:tp_shared_lbhnc | tp_shared_lbnhc
#   @store_pp:{p}@store_format:tp_shared_mqa
#   @store_pp:{p}@store_format:rank_local_tp{t}_layout_{KVCacheLayout name}
# Parsed from the right, because a cache_prefix may itself contain '@'; the model never starts
# with a store_* field, so a namespace is never swallowed into the prefix and model.
_KEY = re.compile(
    r"^(?:(?P<cache_prefix>.*)@)?(?P<model>(?!store_(?:tp|pp|format):)[^@]+)"
    r"(?:(?:@store_tp:(?P<store_tp>\d+))?@store_pp:(?P<store_pp>\d+)"
    r"@store_format:(?P<store_format>tp_shared_lbhnc|tp_shared_lbnhc|tp_shared_mqa"
    r"|rank_local_tp\d+_layout_[A-Z]+))?"
    r"@tp_rank:(?P<tp_rank>\d+)"
    r"(?:@pcp(?P<pcp>\d+))?(?:@dcp(?P<dcp>\d+))?@pp_rank:(?P<pp_rank>\d+)"
    r"(?:@group:(?P<group>\d+))?@(?P<chunk_hash>[0-9a-fA-F]+)$",
    re.DOTALL,
)
# A key with any of these is vLLM's: if it does not match _KEY exactly it is unparsed, never
# handed to another scheme's pattern (which could half-parse it).
_MARKERS = ("@tp_rank:", "@pp_rank:", "@store_format:", "@store_pp:")
_INTEGERS = frozenset({"tp_rank", "pcp", "dcp", "pp_rank", "group", "store_tp", "store_pp"})
_RANK_LOCAL_TP = re.compile(r"rank_local_tp(\d+)_layout_")
_RANK_NAMES = ("tp_rank", "pcp", "dcp", "pp_rank")
OPAQUE = {"scheme": "opaque"}


HEX_DIGITS = "0123456789abcdefABCDEF"


def is_hex(text: str) -> bool:
    """Whether `text` is one or more hex digits (a third of a regex match's time: asked of every
    key read, for its stem; a chunk index asks the same of names as bytes)."""
    return text != "" and not text.lstrip(HEX_DIGITS)


def split_stem(key: str) -> tuple[str, str] | None:
    """(stem, chunk hash) when the key ends in `@{hex}`, as a vLLM key does: keys of one stem differ
    only in their chunk hash, so what the stem decides (model, group, ranks) is parsed once a stem."""
    stem, _, tail = key.rpartition("@")
    return (stem, tail) if stem and is_hex(tail) else None


def claims(key: str) -> bool:
    """Whether the key is vLLM's or nobody's (it has vLLM's markers): `VLLM.parse` answers for it,
    and no other producer is asked. A cheap look: no pattern is matched."""
    return any(marker in key for marker in _MARKERS)


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


class VLLM(Producer):
    """One key per (KV-cache group, shard, chunk); each put exactly once, so no legitimate duplicates."""

    scheme = "vllm"

    def parse(self, key: str) -> dict | None:
        if match := _KEY.match(key):
            fields = match_fields(match, self.scheme, _INTEGERS)
            if tp := _RANK_LOCAL_TP.match(fields.get("store_format", "")):
                fields["producer_tp"] = int(tp.group(1))  # the producer's TP size, said by the key
            return fields
        if claims(key):
            return dict(OPAQUE)  # claimed: vLLM's shape, not vLLM's key
        return None

    def member(self, fields: dict) -> Member:
        family = (self.scheme, fields.get("cache_prefix", ""), fields["model"], fields.get("store_tp"),
                  fields.get("store_pp"), fields.get("store_format"))
        rank = (fields["tp_rank"], fields.get("pcp", 0), fields.get("dcp", 0), fields["pp_rank"])
        return Member(family, (*family, fields["chunk_hash"]), fields.get("group", 0), rank)

    def member_fields(self, part, rank: tuple) -> dict:
        return {"group": part, **dict(zip(_RANK_NAMES, rank))}
