"""Pairing production keys with their reference twins.

A reference producer publishes under its own ``cache_prefix``; vLLM's chunk hashes do not depend on
the engine (FACTS §8), so a reference key and its production twin differ only in that prefix: same
model, store namespace, ranks, group and chunk hash.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from audit.records import KeyInfo

_IDENTITY_FIELDS = ("model", "store_tp", "store_pp", "store_format", "tp_rank", "pcp", "dcp", "pp_rank", "group")


def normalize_prefix(prefix: str) -> str:
    """A cache prefix as vLLM's config spells it (``ref``), also accepted as it shows in keys (``ref@``)."""
    return prefix[:-1] if prefix.endswith("@") else prefix


def identity(fields: dict) -> tuple | None:
    """What a key and its twin share: every vLLM key field but the cache prefix."""
    if fields.get("scheme") != "vllm":
        return None
    return tuple(fields.get(name) for name in _IDENTITY_FIELDS) + (str(fields.get("chunk_hash", "")).lower(),)


@dataclass
class Pairing:
    pairs: list[tuple[KeyInfo, KeyInfo]] = field(default_factory=list)   # (production, reference)
    unverified: list[KeyInfo] = field(default_factory=list)               # production keys with no twin
    uncovered: list[KeyInfo] = field(default_factory=list)                # reference keys with no production twin
    not_vllm: list[KeyInfo] = field(default_factory=list)                 # production-side keys vLLM did not name
    reference_keys: int = 0

    def summary(self) -> dict:
        production = len(self.pairs) + len(self.unverified)
        return {
            "reference_keys": self.reference_keys,
            "production_keys": production,
            "pairs": len(self.pairs),
            "unverified": len(self.unverified),
            "reference_without_twin": len(self.uncovered),
            "not_vllm": len(self.not_vllm),
            "coverage": round(len(self.pairs) / production, 4) if production else None,
        }


def pair_keys(keys: list[KeyInfo], reference_prefix: str, keep=lambda name: True) -> Pairing:
    """Split listed keys into reference keys (cache prefix == `reference_prefix`) and production keys
    (the rest, kept by `keep`: the --prefix/--match filter) and pair them by identity."""
    reference_prefix = normalize_prefix(reference_prefix)
    pairing = Pairing()
    references: dict[tuple, KeyInfo] = {}
    production: list[tuple[tuple | None, KeyInfo]] = []
    for key in keys:
        fields = key.parsed_fields()
        if fields.get("scheme") == "vllm" and fields.get("cache_prefix", "") == reference_prefix:
            references.setdefault(identity(fields), key)
            pairing.reference_keys += 1
        elif keep(key.name):
            production.append((identity(fields), key))
    matched: set[tuple] = set()
    for ident, key in production:
        if ident is None:
            pairing.not_vllm.append(key)
        elif ident in references:
            pairing.pairs.append((key, references[ident]))
            matched.add(ident)
        else:
            pairing.unverified.append(key)
    pairing.uncovered = [key for ident, key in references.items() if ident not in matched]
    return pairing
