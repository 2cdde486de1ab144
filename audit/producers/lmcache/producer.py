"""LMCache as a producer: one key per (chunk, worker[, layer]), the worker count named in the key,
and two habits that write identical bytes under distinct keys on purpose: the same chunk under
other tags (`@user%alice`, `@user%bob`: per-user copies) and, at a TP size above the model's KV-head
count, every worker's copy of a replicated head (vLLM's own connector puts such a head once)."""

from __future__ import annotations

import numpy as np

from audit.producers.base import Member, Producer, ValueReading
from audit.producers.lmcache.checksum_frame import FRAME_BYTES, VERSION, looks_like_frame
from audit.producers.lmcache.header import DTYPES, FIXED_BYTES, FORMATS, GROUP_BYTES, looks_like_header
from audit.producers.lmcache.keys import SCHEME, parse_lmcache_key
from audit.producers.lmcache.values import HEAD_BYTES, read_headerless_value, read_lmcache_value


class LMCache(Producer):
    scheme = SCHEME
    fixed_size = False   # with `save_unfull_chunk`, the last chunk of a prompt is shorter
    every_part = True    # a layerwise chunk has every layer; an ObjectKey's, every object group
    head_bytes = HEAD_BYTES
    sized_by_config = True  # values without a header

    def parse(self, key: str) -> dict | None:
        return parse_lmcache_key(key)

    def member(self, fields: dict) -> Member:
        tags = tuple(sorted((fields.get("tags") or {}).items()))
        if "kv_rank" in fields:
            family = (self.scheme, fields["model"], fields["world_size"], "object", fields.get("cache_salt", ""))
            part = fields["object_group"]
        else:
            family = (self.scheme, fields["model"], fields["world_size"], fields.get("dtype"), fields.get("fmt"),
                      "layer" in fields, tags)
            part = fields.get("layer")
        return Member(family, (*family, fields["chunk_hash"]), part, (fields["worker_id"],), fields["world_size"])

    def member_fields(self, part, rank: tuple) -> dict:
        return {**({} if part is None else {"part": part}), "worker_id": rank[0]}

    def content(self, fields: dict) -> tuple:
        if "kv_rank" in fields:
            return (self.scheme, fields["model"], fields["world_size"], fields["object_group"], fields["chunk_hash"])
        return (self.scheme, fields["model"], fields["world_size"], fields.get("dtype"), fields.get("fmt"),
                fields.get("layer"), fields["chunk_hash"])

    def replica(self, fields: dict) -> tuple[int, int]:
        return fields["worker_id"], fields["world_size"]

    def may_describe(self, head: bytes) -> bool:
        return looks_like_header(head) or looks_like_frame(head)

    def may_describe_many(self, first: np.ndarray, sizes: np.ndarray) -> np.ndarray:
        words = first[:, :12].copy().view("<i4")
        header = (sizes >= FIXED_BYTES + GROUP_BYTES) & np.isin(words[:, 1], list(FORMATS)) & np.isin(
            words[:, 2], list(DTYPES))
        frame = (sizes >= FRAME_BYTES) & (first[:, 0] == VERSION)
        return header | frame

    def read_value(self, fields: dict, value) -> ValueReading | None:
        return read_lmcache_value(fields, value)

    def read_by_config(self, fields: dict, value, config: dict) -> ValueReading | None:
        return read_headerless_value(fields, value, config)
