"""The producers that write into a Mooncake Store, each behind `base.Producer`: vLLM's connector,
SGLang HiCache and LMCache. A key belongs to the first whose names it matches."""

from __future__ import annotations

import numpy as np

from audit.producers.base import SCREEN_BYTES as SCREEN_BYTES, Member, Producer, ValueReading
from audit.producers.lmcache.producer import LMCache
from audit.producers.sglang.producer import SGLang
from audit.producers.vllm import OPAQUE, VLLM, split_stem as split_stem  # re-exported: a key's stem and chunk hash

# vLLM first: a key with vLLM's markers is vLLM's or nobody's. SGLang before LMCache: an SGLang
# prefix (`{tag}_`) may hold '@', an LMCache key never ends in `_{k|v|...}`.
PRODUCERS: tuple[Producer, ...] = (VLLM(), SGLang(), LMCache())
_BY_SCHEME = {producer.scheme: producer for producer in PRODUCERS}
HEAD_BYTES = max(producer.head_bytes for producer in PRODUCERS)


def parse_key(key: str) -> dict:
    """The key's scheme and fields, e.g. ``{"scheme": "vllm", "model": ..., "tp_rank": 1, ...}``;
    ``{"scheme": "opaque"}`` for a key no producer names (still audited by its bytes)."""
    for producer in PRODUCERS:
        fields = producer.parse(key)
        if fields is not None:
            return fields
    return dict(OPAQUE)


def producer_of(scheme: str | None) -> Producer | None:
    return _BY_SCHEME.get(scheme)


def member_of(fields: dict) -> Member | None:
    """Where the key sits among its producer's chunks, or None (an opaque key, a probe)."""
    producer = producer_of(fields.get("scheme"))
    return None if producer is None else producer.member(fields)


def probe_of(name: str, size: int | None, zero: bool | None) -> str | None:
    """Why key `name` is a probe its producer writes on purpose (not cache), or None."""
    fields = parse_key(name)
    producer = producer_of(fields.get("scheme"))
    return None if producer is None else producer.probe(fields, size, zero)


def describes_itself(head: bytes) -> bool:
    """Whether a value starting with `head` (its first HEAD_BYTES) may describe itself."""
    return any(producer.may_describe(head) for producer in PRODUCERS)


def describe_themselves(first: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """`describes_itself` for a batch: `first` holds each value's first SCREEN_BYTES (a row per
    value, zero past its end); a bool per value that may describe itself."""
    found = np.zeros(len(sizes), dtype=bool)
    for producer in PRODUCERS:
        found |= producer.may_describe_many(first, sizes)
    return found


def read_value(name: str, value) -> tuple[dict, ValueReading] | None:
    """What the value (a host uint8 array) of key `name` says about itself, with the key's fields,
    where its producer's values describe themselves; None for every other value. Ask
    `describes_itself` first: it spares most values the parsing of their key."""
    fields = parse_key(name)
    producer = producer_of(fields.get("scheme"))
    reading = None if producer is None else producer.read_value(fields, value)
    return None if reading is None else (fields, reading)
