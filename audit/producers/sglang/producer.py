"""SGLang HiCache as a producer: a page's K and V (and its Mamba states) are members of one chunk,
the store's warm-up key is a probe, and a page is sized by its model's config (`pages`)."""

from __future__ import annotations

from audit.producers.base import Member, Producer, ValueReading
from audit.producers.sglang.keys import EITHER, SCHEME, WARMUP_BYTES, parse_sglang_key
from audit.producers.sglang.pages import read_page


class SGLang(Producer):
    scheme = SCHEME
    sized_by_config = True  # its pages

    def parse(self, key: str) -> dict | None:
        return parse_sglang_key(key)

    def member(self, fields: dict) -> Member | None:
        if "page_hash" not in fields:
            return None
        family = (self.scheme, fields.get("prefix", ""))
        chunk = (*family, fields["page_hash"], fields.get("pp_rank", 0))
        rank = (fields.get("tp_rank", fields.get("shard", 0)), fields.get("dcp_rank", 0), fields.get("cp_rank", 0))
        return Member(family, chunk, fields["part"], rank)

    def member_fields(self, part, rank: tuple) -> dict:
        tp, dcp, cp = rank
        fields = {"part": part, ("shard" if part in EITHER else "tp_rank"): tp}
        if dcp or cp:
            fields.update(dcp_rank=dcp, cp_rank=cp)
        return fields

    def trailing_only(self, part) -> bool:
        """The Mamba pool's states and the SWA pool's pages: `PoolHitPolicy.TRAILING_PAGES`
        (`describe_l3_object_layout`), written for a prompt's last page(s) only."""
        return isinstance(part, str) and (part == "temporal" or part.startswith(("conv_", "swa", "draft_swa")))

    def probe(self, fields: dict, size: int | None, zero: bool | None) -> str | None:
        if fields.get("warmup") and size == WARMUP_BYTES and zero:
            return "SGLang's store warm-up key: 4 KiB of zeros written at every store start"
        return None

    def model_config(self, fields: dict, configs: dict[str, dict]) -> dict | None:
        """The config of the model the key's prefix names (`{tag}_{model with / as -}`): the one
        whose name the prefix ends with."""
        prefix = fields.get("prefix") or ""
        for name, config in configs.items():
            if prefix == name or prefix.endswith(("_" + name, "-" + name)):
                return config
        return None

    def read_by_config(self, fields: dict, value, config: dict) -> ValueReading | None:
        return read_page(fields, value, config)
