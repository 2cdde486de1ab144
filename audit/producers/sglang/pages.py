"""An SGLang page as its host pools hold it, sized by the model's config.

A key holds one page of one rank's pool: an MHA pool's `k` or `v` half is ``page tokens x layers
x KV heads per rank x head dim`` numbers (V's head dim is ``v_head_dim`` where a config has one),
an MLA pool's `k` ``page tokens x layers x (kv_lora_rank + qk_rope_head_dim)``
(`MHATokenToKVPoolHost` / `MLATokenToKVPoolHost`, `get_page_buffer_meta`). `--hicache-mem-layout`
orders them token-major (`page_first`, the Mooncake default), layer-major (`page_first_direct`) or
head-major (`page_head`); the audit reads a KV page as one run of numbers, so its checks (zero,
NaN/Inf, digests) hold whatever the order. A hybrid's KV pool holds its attention layers only; its
Mamba pool (`MambaPoolHost`, one state slot a page) puts a page's `temporal` (ssm) and `conv_0`
states layer after layer (an MTP draft's after the model's), one segment each here, so a zero
layer is PARTIAL_ZERO; where several layer counts fit, each is a reading.

The key says neither the TP size, the PP split, the page size nor the dtype (`--dtype`,
`--kv-cache-dtype`), so a page is read by every geometry the config leaves open: KV heads per
rank a divisor of the config's that a rank of the key's number can hold (a replicated head: 1),
a state's numbers at every TP size above the key's rank; the config's layers, or up to
`PACKED_DRAFT_LAYERS` more (a speculative draft's layers packed into the pool), or at a PP
stage any count up to what the stage can hold (SGLang's split can be set by
`SGLANG_PP_LAYER_PARTITION`); a whole number of tokens; 1, 2 or 4 bytes a number (states: 2 or
4). A size no geometry gives is a SIZE_MISMATCH. Otherwise each dtype the fitting geometries allow
is a reading, the config's dtype first, and the bytes choose between them (`audit.judge.readings`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from audit.layouts.config_shapes import (attention_heads, attention_kv_shape, hybrid_pools, mixes_sliding_layers,
                                         mla_latent_shape)
from audit.layouts.dtypes import config_dtype
from audit.layouts.hf_config import model_type_of
from audit.layouts.model import Layout, LayoutError, Region, Segment
from audit.producers.base import Disagreement, ValueReading

PACKED_DRAFT_LAYERS = 4
TP_SIZES = (1, 2, 4, 8, 16)  # a hybrid's state per rank depends on the TP size, which keys do not say
MAX_READINGS = 8  # layouts a page is judged under at most
_STATE_DTYPES = {"temporal": "float32", "conv_0": "bfloat16"}  # SGLang's defaults (`mamba2_state_dtype`)
DTYPES_BY_WIDTH = {4: ("float32",), 2: ("bfloat16", "float16"), 1: ("float8_e4m3fn", "float8_e5m2")}
STATE_WIDTHS = (4, 2)  # Mamba states: float32 (SGLang's default ssm dtype) or the model's 16-bit dtype
_SHOWN_FITS = 6  # geometries named in a page's decoded evidence


@dataclass(frozen=True, slots=True)
class PageGeometry:
    """What a config leaves open about one key's page: its pool, the layer counts its rank's
    stage may hold, the numbers a token (a state slot) and layer may take (heads per rank x head
    dim, or one layer's state), the state's family (``attention``: a KV page), and the tokens a
    page holds where they are fixed."""

    pool: str
    layers: tuple[int, ...]
    rows: tuple[int, ...]
    family: str = "attention"  # a state page's: mamba1, mamba2, gdn or short_conv
    slots: int | None = None     # tokens (state slots) a page holds, where fixed


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def page_geometry(fields: dict, config: dict) -> PageGeometry | None:
    """The geometries `config` allows the key's page, or None for pages it does not size: side
    pools (draft, SWA, indexers), DCP shards, models mixing sliding layers (SGLang pools those
    layers apart), and keys whose ranks contradict the config's pool."""
    part = fields.get("part")
    if "dcp_rank" in fields or mixes_sliding_layers(config):
        return None
    if _pools(config, 1) is not None:
        return _hybrid_geometry(fields, config)
    if part not in ("k", "v"):
        return None
    latent = mla_latent_shape(config)
    if latent is not None:  # MLA: `__k`, or `_{pp}_k` (a key's lone number is its PP stage)
        if part != "k" or "tp_rank" in fields:
            return None
        layers, row = latent
        stage = fields.get("pp_rank", fields.get("shard"))
        return PageGeometry("MLA", _stage_layers(layers, stage), (row,))
    shape = attention_kv_shape(config)
    tp = fields.get("tp_rank", fields.get("shard"))
    if shape is None or tp is None:  # an MHA pool's keys always carry its TP rank
        return None
    layers, heads, head_dim = shape
    return PageGeometry("MHA", _stage_layers(layers, fields.get("pp_rank")),
                        _kv_rows(heads, _head_dim_of(config, part, head_dim), tp))


def _kv_rows(heads: int, head_dim: int, tp: int) -> tuple[int, ...]:
    """Numbers per token and layer: KV heads per rank (a divisor a rank `tp` can hold) x head dim."""
    return tuple(per_rank * head_dim for per_rank in _divisors(heads) if per_rank == 1 or heads // per_rank > tp)


def _hybrid_geometry(fields: dict, config: dict) -> PageGeometry | None:
    """A hybrid's pages: its KV pool's `k`/`v` hold the attention layers only; its Mamba pool's
    `temporal` one ssm state and `conv_0` one conv state per state layer, per state slot."""
    part, tp, stage = fields.get("part"), fields.get("tp_rank", fields.get("shard")), fields.get("pp_rank")
    if tp is None:
        return None
    pools = [found for size in TP_SIZES if size > tp and (found := _pools(config, size)) is not None]
    if not pools:
        return None
    if part in ("k", "v"):
        heads = attention_heads(config)
        if heads is None or not pools[0].attention_layers:
            return None
        rows = _kv_rows(heads[0], _head_dim_of(config, part, heads[1]), tp)
        return PageGeometry("MHA", _stage_layers(pools[0].attention_layers, stage), rows)
    state = {"temporal": "ssm", "conv_0": "conv"}.get(part)
    rows = tuple(sorted({pool.state_numbers[state] for pool in pools if state in pool.state_numbers}))
    if not rows:
        return None
    # `MambaPoolHost.page_size` is 1: a page holds one state slot; an MTP draft's state layers
    # follow the model's.
    return PageGeometry("Mamba", _stage_layers(pools[0].state_layers, stage), rows, pools[0].family, slots=1)


_POOLS: dict[tuple[int, int], tuple] = {}  # (id(config), tp) -> (config, its HybridPools): one build a scan


def _pools(config: dict, tp_size: int):
    """`hybrid_pools`, built once per config (a scan's configs live as long as it does)."""
    cached = _POOLS.get((id(config), tp_size))
    if cached is None or cached[0] is not config:
        cached = _POOLS[(id(config), tp_size)] = (config, hybrid_pools(config, tp_size))
    return cached[1]


def _head_dim_of(config: dict, part: str, head_dim: int) -> int:
    """A page's head dim: V's is the config's ``v_head_dim`` where it has one (MiMo-V2: SGLang's
    `AsymmetricMHATokenToKVPoolHost` sizes a V page by it)."""
    value = model_type_of(config)[0].get("v_head_dim") if part == "v" else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else head_dim


def _stage_layers(layers: int, stage: int | None) -> tuple[int, ...]:
    if stage is None:
        return tuple(range(layers, layers + PACKED_DRAFT_LAYERS + 1))
    return tuple(range(1, max(layers - stage, 0) + 1))  # every stage before it holds a layer


def _config_dtype(config: dict) -> str | None:
    """The checkpoint's dtype (the likeliest reading, not a verdict's ground), None where unknown."""
    try:
        return config_dtype(config, model_type_of(config)[0])
    except LayoutError:
        return None


def read_page(fields: dict, value, config: dict) -> ValueReading | None:
    """The page in `value` (uint8) read by `config`: None where the config does not size it (see
    `page_geometry`); a size disagreement where no geometry fits; else the readings it fits."""
    geometry = page_geometry(fields, config)
    if geometry is None:
        return None
    size = len(value)
    widths = STATE_WIDTHS if geometry.family != "attention" else tuple(DTYPES_BY_WIDTH)
    fits = [(width, layers, row, size // (width * layers * row)) for width in widths
            for layers in geometry.layers for row in geometry.rows if size and size % (width * layers * row) == 0
            and geometry.slots in (None, size // (width * layers * row))]
    stated = _STATE_DTYPES.get(fields["part"]) or _config_dtype(config)
    fits.sort(key=lambda fit: stated not in DTYPES_BY_WIDTH[fit[0]])  # the likeliest width's first
    described = {"pool": geometry.pool, "layers": [min(geometry.layers), max(geometry.layers)],
                 "numbers_per_token_and_layer": list(geometry.rows), "geometries": len(fits),
                 "fits": [{"bytes_per_number": width, "page_tokens": tokens, "layers": layers,
                           "numbers_per_token_and_layer": row} for width, layers, row, tokens in fits[:_SHOWN_FITS]]}
    if not fits:
        evidence = {"value_size": size, "pool": geometry.pool, "layers": described["layers"],
                    "numbers_per_token_and_layer": list(geometry.rows), "bytes_per_number": list(widths),
                    "expected_size": "page tokens x layers x numbers per token and layer x bytes per number"}
        return ValueReading(None, {"sglang_page": described}, (Disagreement("size", evidence),))
    layouts = []
    for width, layers, row, _ in fits:
        # A state page is split per state layer, one reading per geometry that fits (where they
        # split it apart, only the verdicts every reading gives stand); a KV page is one run of
        # numbers, one reading per dtype.
        split = (layers, row) if geometry.family != "attention" else None
        for dtype in DTYPES_BY_WIDTH[width]:
            layout = _page_layout(size, dtype, fields["part"], geometry.pool, geometry.family, split)
            if layout not in layouts and len(layouts) < MAX_READINGS:
                layouts.append(layout)
    layouts.sort(key=lambda layout: layout.number_dtype != stated)  # the likeliest dtype first
    described["dtypes"] = list(dict.fromkeys(layout.number_dtype for layout in layouts))
    return ValueReading(layouts[0], {"sglang_page": described}, alternatives=tuple(layouts[1:]))


@lru_cache(maxsize=256)
def _page_layout(size: int, dtype: str, part: str, pool: str, family: str, split: tuple[int, int] | None) -> Layout:
    """One region of numbers, or (`split`: state layers, numbers per layer) one segment per
    state layer of a one-slot state page, `layers.{j}` for the j-th state layer."""
    width = next(width for width, names in DTYPES_BY_WIDTH.items() if dtype in names)
    kind = "kv" if family == "attention" else "state"
    if split is None:
        region = Region(part, kind, 0, size, dtype, (size // width,))
        return Layout(f"sglang {pool} page", None, family, 1, (Segment(0, part, 0, 0, size, (region,)),))
    layers, numbers = split
    length = numbers * width
    return Layout(f"sglang {pool} page", None, family, 1, tuple(
        Segment(layer, f"layers.{layer}", layer, layer * length, length,
                (Region(part, kind, layer * length, length, dtype, (numbers,)),)) for layer in range(layers)))
