"""SGLang HiCache's MooncakeStore (0.5.23 `mem_cache/storage/mooncake_store/mooncake_store.py`):
its key names and its warm-up key.

A key is ``[{tag}_{model with / as -}_]{page_hash}_{ranks}_{object}``. The ranks are an MHA pool's
``{tp}`` or ``{tp}_{pp}`` (its K/V, Mamba and SWA pools' keys), or an MLA pool's ``""``, ``{pp}``,
``dcp{d}_cp{c}`` or ``dcp{d}_cp{c}_{pp}``. So ``{hash}__k`` is MLA without PP, and ``{hash}_{n}_k`` is
either an MHA pool's TP rank ``n`` or an MLA pool's PP rank ``n``: the key alone cannot say which
(an MHA pool always writes ``_v`` beside ``_k``), and its ``n`` is parsed as ``shard``.
"""

from __future__ import annotations

import re

from audit.producers.base import match_fields

SCHEME = "sglang"
WARMUP_BYTES = 4096  # `MooncakeStore.warmup`: bytes(4 * 1024)
_WARMUP = re.compile(r"^sglang_mooncake_store_warmup_key[0-9a-f]{32}$")
# Objects: an MHA pool's halves (`k`, `v`; draft, SWA and other side pools' `{pool}_k`/`_v`), the
# Mamba pool's `temporal` and `conv_{i}`, and single-object pools (MLA side pools, DSA indexers,
# DeepSeek V4's compressed pools).
_POOLS = (r"draft_swa|draft_indexer|draft|auxiliary_swa|swa|indexer|mamba|kv|deepseek_v4_[a-z0-9]+(?:_[a-z0-9]+)*")
_KEY = re.compile(
    r"^(?:(?P<prefix>.*)_)?(?P<page_hash>[0-9a-fA-F]{16,})_"
    r"(?:dcp(?P<dcp_rank>\d+)_cp(?P<cp_rank>\d+)(?:_(?P<pp_of_dcp>\d+))?"
    r"|(?P<first>\d+)(?:_(?P<second>\d+))?)?"
    rf"_(?P<part>(?:(?:{_POOLS})_)?[kv]|temporal|conv_\d+|{_POOLS})$",
    re.DOTALL,
)
_INTEGERS = frozenset({"dcp_rank", "cp_rank", "pp_of_dcp", "first", "second"})
# Objects only an MHA pool writes (its rank suffix is `{tp}[_{pp}]`), and objects either pool writes.
_MHA_ONLY = re.compile(r"^(?:.*_)?v$|^(?:swa|draft_swa|auxiliary_swa)_k$|^temporal$|^conv_\d+$")
EITHER = frozenset({"k", "draft_k"})  # `{hash}_{n}_{part}`: n is a TP rank or a PP stage


def _ranks(fields: dict) -> None:
    """Name the key's numbers by what its object says they are (see the module's docstring)."""
    first, second = fields.pop("first", None), fields.pop("second", None)
    if "pp_of_dcp" in fields:
        fields["pp_rank"] = fields.pop("pp_of_dcp")
    if second is not None:
        fields["tp_rank"], fields["pp_rank"] = first, second
    elif first is not None:
        part = fields["part"]
        name = "tp_rank" if _MHA_ONLY.match(part) else "shard" if part in EITHER else "pp_rank"
        fields[name] = first


def parse_sglang_key(key: str) -> dict | None:
    """The key's fields (``page_hash``, ``part``, ranks, ``prefix``), ``{"warmup": True}`` for the
    store's warm-up key, or None when the key is not SGLang's."""
    if _WARMUP.match(key):
        return {"scheme": SCHEME, "warmup": True}
    if match := _KEY.match(key):
        fields = match_fields(match, SCHEME, _INTEGERS)
        _ranks(fields)
        return fields
    return None
