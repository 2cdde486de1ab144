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


# Why a production key has no twin (summary ``unverified_keys``/``unverified_reasons``).
PROMPT_NOT_GIVEN = "no reference key: its prompt was not given"
NOT_CUT = ("no reference key: its prompt was not given, or the reference did not end a request at this chunk "
           "(--no-cut-at-boundaries: each prompt publishes its last boundary only)")
NOT_PUBLISHED = ("no reference key: the reference producer did not publish this chunk (its prompt was not run, "
                 "or not cut at this chunk)")
NOTHING_PAIRS = ("no reference key: none of the reference's {n} key(s) pairs with a production key (the reference "
                 "under another block size, model name or TP size?)")
NO_REFERENCE = "no reference key: the reference published nothing under its prefix"
OTHER_MEMBER = "the reference published this chunk, but not this key's {fields}"
UNVERIFIED_LISTED = 100  # unverified keys named in the summary (all are counted)


@dataclass
class Pairing:
    pairs: list[tuple[KeyInfo, KeyInfo]] = field(default_factory=list)   # (production, reference)
    unverified: list[KeyInfo] = field(default_factory=list)               # production keys with no twin
    uncovered: list[KeyInfo] = field(default_factory=list)                # reference keys with no production twin
    not_vllm: list[KeyInfo] = field(default_factory=list)                 # production-side keys vLLM did not name
    reference_keys: int = 0
    reference_chunks: dict[str, tuple] = field(default_factory=dict)      # chunk hash -> a reference key's identity

    def reason(self, key: KeyInfo, absent: str = PROMPT_NOT_GIVEN) -> str:
        """Why `key` (unverified) has no twin: the reference holds its chunk for other members only
        (another group, rank or model field), or no reference key has its chunk hash (`absent`)."""
        ident = identity(key.parsed_fields())
        other = None if ident is None else self.reference_chunks.get(ident[-1])
        if other is not None:
            differ = [f"{name} {mine!r} (the reference's: {theirs!r})"
                      for name, mine, theirs in zip(_IDENTITY_FIELDS, ident, other) if mine != theirs]
            return OTHER_MEMBER.format(fields=", ".join(differ) or "identity")
        if not self.reference_keys:
            return NO_REFERENCE
        if not self.pairs:
            return NOTHING_PAIRS.format(n=self.reference_keys)
        return absent

    def unverified_summary(self, absent: str = PROMPT_NOT_GIVEN, limit: int = UNVERIFIED_LISTED) -> dict:
        """The production keys without a twin: the first `limit` named with their reason, and every
        one counted by reason."""
        listed, counts = [], {}
        for key in self.unverified:
            reason = self.reason(key, absent)
            counts[reason] = counts.get(reason, 0) + 1
            if len(listed) < limit:
                listed.append({"key": key.name, "reason": reason})
        return {"unverified_keys": listed, "unverified_listed": len(listed),
                "unverified_reasons": dict(sorted(counts.items(), key=lambda item: -item[1]))}

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
            ident = identity(fields)
            references.setdefault(ident, key)
            pairing.reference_chunks.setdefault(ident[-1], ident)
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
