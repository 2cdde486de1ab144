"""Choosing among vLLM's possible layouts of a model from the value sizes Mooncake reports.

The operator knows the model and, usually, its TP size; rarely the producer's platform and the
dtypes vLLM resolved (CPU forces float32 ssm states, a float32 checkpoint may run in bfloat16 or
float32, Nemotron-H and Qwen3.5 pick their own ssm dtype) or the block size vLLM defaulted to.
Each of those gives a different value size. ``infer_layouts`` tries vLLM's candidates in a fixed
order (the operator's settings and vLLM's CUDA defaults first) and keeps, per model, the first
one whose layouts fit the size that dominates each (model, group) of the listed keys; a group
that no candidate fits keeps the configured layout (its keys are SIZE_MISMATCH), and so does
every key whose size differs from its group's dominant size (two producers, one name).
"""

from __future__ import annotations

import itertools
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from .dtypes import PLATFORMS, resolve_dtypes
from .hf_config import layouts_from_hf_config, model_type_of
from .hybrid import PLATFORM_BLOCKS
from .model import LayoutError, Layout

MODEL_DTYPES = ("bfloat16", "float16", "float32")
KERNEL_BLOCKS = (16, 32, 64)
TP_SIZES = (1, 2, 4, 8)


@dataclass(frozen=True, slots=True)
class LayoutRequest:
    """What the operator said about one model config: None means "not given, vLLM's default"."""

    config: dict
    model: str
    tp_size: int = 1
    state_dtype: str | None = None
    ssm_dtype: str | None = None
    block_size: int | None = None
    kernel_block_size: int | None = None
    kv_cache_dtype: str | None = None
    conv_layout: str = "SD"
    platform: str | None = None
    model_dtype: str | None = None
    tp_given: bool = False

    @property
    def name(self) -> str:
        return self.model.rstrip("/").split("/")[-1]

    def settings(self) -> dict:
        return {"tp_size": self.tp_size, "platform": self.platform or "cuda", "model_dtype": self.model_dtype,
                "state_dtype": self.state_dtype, "ssm_dtype": self.ssm_dtype, "block_size": self.block_size,
                "kernel_block_size": self.kernel_block_size, "kv_cache_dtype": self.kv_cache_dtype}

    def layouts(self, **changes) -> list[Layout]:
        settings = {**self.settings(), **changes}
        return layouts_from_hf_config(self.config, model=self.model, conv_layout=self.conv_layout, **settings)

    def described(self, **changes) -> dict:
        """The settings a candidate assumes, with the dtypes vLLM's rules then give."""
        settings = {**self.settings(), **changes}
        text, model_type = model_type_of(self.config)
        dtypes = resolve_dtypes(model_type=model_type or "", text=text, config=self.config,
                                model_dtype=settings["model_dtype"], conv_dtype=settings["state_dtype"],
                                ssm_dtype=settings["ssm_dtype"], kv_cache_dtype=settings["kv_cache_dtype"],
                                platform=settings["platform"])
        block, kernel = PLATFORM_BLOCKS[settings["platform"]]
        return {"platform": settings["platform"], "tp_size": settings["tp_size"], **dtypes.as_dict(),
                "block_size": settings["block_size"] or block,
                "kernel_block_size": settings["kernel_block_size"] or kernel}


def _candidates(request: LayoutRequest) -> Iterator[dict]:
    """Changes to the request, most likely first; the first is no change at all."""
    platforms = (request.platform,) if request.platform else PLATFORMS
    model_dtypes = (request.model_dtype,) if request.model_dtype else (None, *MODEL_DTYPES)
    ssm_dtypes = (request.ssm_dtype,) if request.ssm_dtype else (None, "float32", *MODEL_DTYPES[:2])
    kernels = (request.kernel_block_size,) if request.kernel_block_size else (None, *KERNEL_BLOCKS)
    blocks = (request.block_size,) if request.block_size else (None, 16, 32, 64, 128, 256)
    tps = (request.tp_size,) + (() if request.tp_given else tuple(tp for tp in TP_SIZES if tp != request.tp_size))
    # vLLM's defaults before any flag: the block and kernel defaults (they follow the platform),
    # then the dtype flags, each tried on every platform
    for tp, block, kernel, model_dtype, ssm, platform in itertools.product(
            tps, blocks, kernels, model_dtypes, ssm_dtypes, platforms):
        yield {"tp_size": tp, "platform": platform or "cuda", "model_dtype": model_dtype, "ssm_dtype": ssm,
               "kernel_block_size": kernel, "block_size": block}


@dataclass
class GroupSizes:
    keys: int = 0
    sizes: Counter = field(default_factory=Counter)

    @property
    def dominant(self) -> int:
        return self.sizes.most_common(1)[0][0]


def observed_sizes(keys: Iterable) -> dict[tuple[str, int], GroupSizes]:
    """Per (model, group) of the listed vLLM keys: how many, and of which sizes."""
    groups: dict[tuple[str, int], GroupSizes] = defaultdict(GroupSizes)
    for key in keys:
        if key.size is None:
            continue
        fields = key.parsed_fields()
        if fields.get("scheme") != "vllm" or str(fields.get("store_format", "")).startswith("tp_shared_"):
            continue
        slot = groups[(fields["model"], fields.get("group", 0))]
        slot.keys += 1
        slot.sizes[key.size] += 1
    return dict(groups)


def _attention_block_fit(request: LayoutRequest, changes: dict, sizes: dict[int, int]) -> dict | None:
    """Attention only, no --block-size: the block size is the value size over one token's."""
    try:
        unit = request.layouts(**{**changes, "block_size": 1})
    except LayoutError:
        return None
    if any(layout.kind != "attention" for layout in unit):
        return None
    blocks = {sizes[layout.group] // layout.size for layout in unit
              if layout.group in sizes and sizes[layout.group] % layout.size == 0}
    return {**changes, "block_size": blocks.pop()} if len(blocks) == 1 else None


def infer_layouts(request: LayoutRequest, observed: dict[tuple[str, int], GroupSizes],
                  limit: int = 4000) -> tuple[list[Layout], list[dict]]:
    """The layouts to judge ``request.model``'s keys with, and one inference row per group seen."""
    sizes = {group: seen.dominant for (model, group), seen in observed.items() if model == request.name}
    try:
        configured = request.layouts()
    except LayoutError:
        configured = None
    if not sizes:
        if configured is None:
            request.layouts()  # raise the operator's error: nothing to infer from
        return configured, []
    best, best_score, best_changes = configured, -1, {}
    if configured is not None:
        best_score = sum(1 for layout in configured if sizes.get(layout.group) == layout.size)
    seen_signatures = set()
    for count, changes in enumerate(_candidates(request)):
        if best_score == len(sizes) or count >= limit:
            break
        if request.block_size is None:
            changes = _attention_block_fit(request, changes, sizes) or changes
        try:
            layouts = request.layouts(**changes)
        except LayoutError:
            continue
        signature = tuple((layout.group, layout.size) for layout in layouts)
        if signature in seen_signatures:
            continue
        seen_signatures.add(signature)
        score = sum(1 for layout in layouts if sizes.get(layout.group) == layout.size)
        if score > best_score:
            best, best_score, best_changes = layouts, score, changes
    if best is None:
        raise LayoutError(f"{request.name}: no layout of vLLM's candidates can be built from its config")
    rows = []
    by_group = {layout.group: layout for layout in best}
    for (model, group), seen in sorted(observed.items()):
        if model != request.name:
            continue
        layout = by_group.get(group)
        fits = layout is not None and layout.size == seen.dominant
        status = ("as_configured" if fits and not best_changes else "inferred" if fits else "no_fit")
        row = {"model": model, "group": group, "keys": seen.keys, "dominant_size": seen.dominant,
               "layout_size": None if layout is None else layout.size, "status": status,
               "from": f"{seen.sizes[seen.dominant]} of {seen.keys} keys of {seen.dominant:,} B",
               "assumed": request.described(**best_changes)}
        others = {str(size): count for size, count in seen.sizes.items() if size != seen.dominant}
        if others:
            row["other_sizes"] = others  # SIZE_MISMATCH: another producer under the same name?
        rows.append(row)
    return best, rows
