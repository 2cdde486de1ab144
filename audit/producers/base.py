"""The one interface every producer (a writer into Mooncake Store) offers the audit: how its key
names parse, which keys make one chunk, which identical bytes it writes by design, which keys
are probes rather than cache, and what its values say about themselves. `audit.judge` asks these
questions and never names a producer."""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

from audit.layouts.model import Layout


SCREEN_BYTES = 12  # the leading bytes `may_describe_many` looks at


@dataclass(frozen=True, slots=True)
class Member:
    """Where one key sits: its chunk, the family of chunks it belongs to, its part and rank."""

    family: tuple
    chunk: tuple
    part: object
    rank: tuple
    world: int | None = None  # ranks the key itself says exist (LMCache's world size)


@dataclass(frozen=True, slots=True)
class Disagreement:
    """Something a value's own description contradicts: `kind` is "size" (its size), "identity"
    (its key) or "checksum" (its own digest)."""

    kind: str
    evidence: dict


@dataclass(frozen=True, slots=True)
class ValueReading:
    """What a value says about itself (LMCache's header, a checksum frame), or what its model's
    config says it holds: the layout to check its bytes with (None: they contradict it), what was
    decoded, what it contradicts, and the other layouts its size fits as well (another dtype: the
    bytes choose, `audit.judge.readings`)."""

    layout: Layout | None
    decoded: dict
    disagreements: tuple[Disagreement, ...] = ()
    alternatives: tuple[Layout, ...] = ()


class Producer(ABC):
    """Defaults for a producer that writes fixed-size pages, no legitimate duplicates, no probes
    and no self-describing values; each producer overrides what it does otherwise."""

    scheme = ""
    fixed_size = True     # every key of one (family, part, rank) has the same size
    every_part = False    # each chunk holds every part its family shows (one key per layer)
    head_bytes = 0        # the leading bytes `may_describe` looks at
    sized_by_config = False  # `read_by_config` may read a value by its model's config

    @abstractmethod
    def parse(self, key: str) -> dict | None:
        """The key's fields, or None when the key is not this producer's."""

    def member(self, fields: dict) -> Member | None:
        return None

    def member_fields(self, part, rank: tuple) -> dict:
        """A member named in evidence (e.g. a missing one): its part and rank as key fields."""
        return {}

    def trailing_only(self, part) -> bool:
        """Whether the producer writes `part` at some of a prompt's pages only (the last ones),
        so a chunk without it is whole: never expected where another part is."""
        return False

    def content(self, fields: dict) -> tuple | None:
        """What the key's bytes are a function of, leaving out what by design does not change them
        (LMCache's tags, the worker holding a replicated head): keys of equal content may hold
        identical bytes. None: no key of this one's legitimately shares its bytes."""
        return None

    def replica(self, fields: dict) -> tuple[int, int] | None:
        """(worker, world size) where workers of one chunk may hold copies of one head."""
        return None

    def probe(self, fields: dict, size: int | None, zero: bool | None) -> str | None:
        """Why the key is a probe the producer writes on purpose (not cache), or None."""
        return None

    def may_describe(self, head: bytes) -> bool:
        """Whether a value starting with `head` could describe itself (a cheap look, no parsing)."""
        return False

    def may_describe_many(self, first: np.ndarray, sizes: np.ndarray) -> np.ndarray:
        """`may_describe` for a batch at once: `first` holds each value's first SCREEN_BYTES (a
        row per value, zero past its end), `sizes` their sizes; a bool per value."""
        return np.zeros(len(sizes), dtype=bool)

    def read_value(self, fields: dict, value) -> ValueReading | None:
        """What the value (a uint8 array) says about itself, or None when it says nothing."""
        return None

    def model_config(self, fields: dict, configs: dict[str, dict]) -> dict | None:
        """The config in `configs` (by model name) of the model the key names: by default the
        one named as the last path component of its ``model`` field."""
        return configs.get(str(fields.get("model") or "").rstrip("/").split("/")[-1])

    def read_by_config(self, fields: dict, value, config: dict) -> ValueReading | None:
        """What a value that does not describe itself holds, read by `config` (the HuggingFace
        config of the key's model), or None when the producer cannot tell from it."""
        return None


def match_fields(match: re.Match, scheme: str, integers: frozenset) -> dict:
    """A key pattern's non-empty groups as the key's fields, `integers` as ints."""
    fields: dict = {"scheme": scheme}
    for name, value in match.groupdict().items():
        if value is not None and value != "":
            fields[name] = int(value) if name in integers else value
    return fields
