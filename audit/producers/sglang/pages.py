"""An SGLang page as its host KV pool holds it, sized by the model's config.

A key holds one page of one rank's pool: an MHA pool's `k` or `v` half is ``page tokens x layers
x KV heads per rank x head dim`` numbers (V's head dim is ``v_head_dim`` where a config has one), an MLA pool's `k` ``page tokens x layers x
(kv_lora_rank + qk_rope_head_dim)`` (`MHATokenToKVPoolHost` / `MLATokenToKVPoolHost`,
`get_page_buffer_meta`). `--hicache-mem-layout` orders them token-major (`page_first`, the
Mooncake default), layer-major (`page_first_direct`) or head-major (`page_head`); the audit reads
a page as one run of numbers, so its checks (zero, NaN/Inf, digests) hold whatever the order.

The key says neither the TP size, the PP split, the page size nor the dtype (`--dtype`,
`--kv-cache-dtype`), so a page is read by every geometry the config leaves open: KV heads per
rank a divisor of the config's that a rank of the key's number can hold (a replicated head: 1);
the config's layers, or up to `PACKED_DRAFT_LAYERS` more (a speculative draft's layers packed
into the pool), or at a PP stage any count up to what the stage can hold (SGLang's split can be
set by `SGLANG_PP_LAYER_PARTITION`); a whole number of tokens; 1, 2 or 4 bytes a number. A size
no geometry gives is a SIZE_MISMATCH. Otherwise each dtype the fitting geometries allow is a
reading, the config's dtype first, and the bytes choose between them (`audit.judge.readings`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from audit.layouts.hf_config import attention_kv_shape, mixes_sliding_layers, mla_latent_shape, model_type_of
from audit.layouts.model import Layout, LayoutError, Region, Segment, canonical_dtype
from audit.producers.base import Disagreement, ValueReading

PACKED_DRAFT_LAYERS = 4
DTYPES_BY_WIDTH = {4: ("float32",), 2: ("bfloat16", "float16"), 1: ("float8_e4m3fn", "float8_e5m2")}
_SHOWN_FITS = 6  # geometries named in a page's decoded evidence


@dataclass(frozen=True, slots=True)
class PageGeometry:
    """What a config leaves open about one key's page: its pool, the layer counts its rank's
    stage may hold, and the numbers a token and layer may take (heads per rank x head dim)."""

    pool: str
    layers: tuple[int, ...]
    rows: tuple[int, ...]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def page_geometry(fields: dict, config: dict) -> PageGeometry | None:
    """The geometries `config` allows the key's page, or None for pages it does not size: side
    pools (draft, SWA, Mamba, indexers), DCP shards, hybrids and models mixing sliding layers
    (SGLang pools those layers apart), and keys whose ranks contradict the config's pool."""
    if fields.get("part") not in ("k", "v") or "dcp_rank" in fields or mixes_sliding_layers(config):
        return None
    latent = mla_latent_shape(config)
    if latent is not None:  # MLA: `__k`, or `_{pp}_k` (a key's lone number is its PP stage)
        if fields["part"] != "k" or "tp_rank" in fields:
            return None
        layers, row = latent
        stage = fields.get("pp_rank", fields.get("shard"))
        return PageGeometry("MLA", _stage_layers(layers, stage), (row,))
    shape = attention_kv_shape(config)
    tp = fields.get("tp_rank", fields.get("shard"))
    if shape is None or tp is None:  # an MHA pool's keys always carry its TP rank
        return None
    layers, heads, head_dim = shape
    head_dim = _v_head_dim(config, head_dim) if fields["part"] == "v" else head_dim
    rows = tuple(per_rank * head_dim for per_rank in _divisors(heads) if per_rank == 1 or heads // per_rank > tp)
    return PageGeometry("MHA", _stage_layers(layers, fields.get("pp_rank")), rows)


def _v_head_dim(config: dict, head_dim: int) -> int:
    """V's head dim: the config's ``v_head_dim`` where it differs from K's (MiMo-V2: SGLang's
    `AsymmetricMHATokenToKVPoolHost` sizes a V page by it)."""
    text, _ = model_type_of(config)
    value = text.get("v_head_dim")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else head_dim


def _stage_layers(layers: int, stage: int | None) -> tuple[int, ...]:
    if stage is None:
        return tuple(range(layers, layers + PACKED_DRAFT_LAYERS + 1))
    return tuple(range(1, max(layers - stage, 0) + 1))  # every stage before it holds a layer


def _config_dtype(config: dict) -> str | None:
    text, _ = model_type_of(config)
    for name in ("torch_dtype", "dtype"):
        value = text.get(name) or config.get(name)
        if isinstance(value, str):
            try:
                return canonical_dtype(value)
            except LayoutError:
                return None
    return None


def read_page(fields: dict, value, config: dict) -> ValueReading | None:
    """The page in `value` (uint8) read by `config`: None where the config does not size it (see
    `page_geometry`); a size disagreement where no geometry fits; else the readings it fits."""
    geometry = page_geometry(fields, config)
    if geometry is None:
        return None
    size = len(value)
    fits = [(width, layers, row, size // (width * layers * row)) for width in DTYPES_BY_WIDTH
            for layers in geometry.layers for row in geometry.rows if size and size % (width * layers * row) == 0]
    described = {"pool": geometry.pool, "layers": [min(geometry.layers), max(geometry.layers)],
                 "numbers_per_token_and_layer": list(geometry.rows), "geometries": len(fits),
                 "fits": [{"bytes_per_number": width, "page_tokens": tokens, "layers": layers,
                           "numbers_per_token_and_layer": row} for width, layers, row, tokens in fits[:_SHOWN_FITS]]}
    if not fits:
        evidence = {"value_size": size, "pool": geometry.pool, "layers": described["layers"],
                    "numbers_per_token_and_layer": list(geometry.rows), "bytes_per_number": list(DTYPES_BY_WIDTH),
                    "expected_size": "page tokens x layers x numbers per token and layer x bytes per number"}
        return ValueReading(None, {"sglang_page": described}, (Disagreement("size", evidence),))
    stated = _config_dtype(config)
    dtypes = [dtype for width in DTYPES_BY_WIDTH if any(fit[0] == width for fit in fits)
              for dtype in DTYPES_BY_WIDTH[width]]
    dtypes.sort(key=lambda dtype: dtype != stated)  # the config's dtype first: the likeliest reading
    described["dtypes"] = dtypes
    layouts = [_page_layout(size, dtype, fields["part"], geometry.pool) for dtype in dtypes]
    return ValueReading(layouts[0], {"sglang_page": described}, alternatives=tuple(layouts[1:]))


@lru_cache(maxsize=256)
def _page_layout(size: int, dtype: str, part: str, pool: str) -> Layout:
    width = next(width for width, names in DTYPES_BY_WIDTH.items() if dtype in names)
    region = Region(part, "kv", 0, size, dtype, (size // width,))
    return Layout(f"sglang {pool} page", None, "attention", 1, (Segment(0, part, 0, 0, size, (region,)),))
