"""Every layout of vLLM's that a model's listed value sizes allow, not just the first.

The last step of laying a model out (docs/layouts.md §11): the candidates of
``audit.layouts.candidates`` fitted to the sizes Mooncake listed, and the reading chosen.

The operator knows the model and, usually, its TP size; rarely the producer's platform and the
dtypes vLLM resolved (CPU forces float32 ssm states, a float32 checkpoint may run in bfloat16 or
float32, Nemotron-H and Qwen3.5 pick their own ssm dtype), the block size vLLM defaulted to, or the
vLLM release and GPU whose rules raised it (``audit.layouts.versions``).
Each of those gives a different value size, and one size often fits several of them: an attention
page of ``b`` tokens in float32 has the bytes of ``2b`` tokens in bfloat16, and a hybrid's Mamba
page is padded to the attention page. ``infer_layouts`` tries vLLM's candidates (the operator's
settings fixed, vLLM's defaults first) and keeps every one that fits the size dominating each
(model, group) of the listed keys. Candidates that read a group's bytes the same way (same
regions, offsets and dtypes) are one reading; a group with several readings is ``ambiguous``
until the producer's manifest, an operator flag or the bytes (`audit.judge.readings`) pick one.
A group that no candidate fits keeps the most likely layout (its keys are SIZE_MISMATCH), and so
does every key whose size differs from its group's dominant size (two producers, one name).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

from .candidates import LayoutRequest, candidates, reading_signature
from .model import LayoutError, Layout
from .versions import CUDA_PLATFORMS


@dataclass
class GroupSizes:
    keys: int = 0
    sizes: Counter = field(default_factory=Counter)
    max_tp_rank: int = 0  # a key of tp_rank r proves a TP size above r

    @property
    def dominant(self) -> int:
        return self.sizes.most_common(1)[0][0]


def observed_sizes(keys: Iterable) -> dict[tuple[str, int], GroupSizes]:
    """Per (model, group) of the listed vLLM keys: how many, and of which sizes."""
    groups: dict[tuple[str, int], GroupSizes] = defaultdict(GroupSizes)
    stems: dict[str, tuple | None] = {}  # keys of one stem differ only in their chunk hash: parsed once
    for key in keys:
        if key.size is None:
            continue
        stem = key.stem()
        if stem in stems:
            entry = stems[stem]
        else:
            fields = key.parsed_fields()
            entry = stems[stem] = (
                None if fields.get("scheme") != "vllm" or str(fields.get("store_format", "")).startswith("tp_shared_")
                else (fields["model"], fields.get("group", 0), fields.get("tp_rank")))
        if entry is None:
            continue
        model, group, rank = entry
        slot = groups[(model, group)]
        slot.keys += 1
        slot.sizes[key.size] += 1
        if isinstance(rank, int) and rank > slot.max_tp_rank:
            slot.max_tp_rank = rank
    return dict(groups)


def _attention_block_fit(request: LayoutRequest, changes: dict, sizes: dict[int, int],
                         memo: dict | None = None) -> dict | None:
    """Attention only, no --block-size: the block size is the value size over one token's."""
    try:
        unit = request.layouts(memo, **{**changes, "block_size": 1})
    except LayoutError:
        return None
    if any(layout.kind != "attention" for layout in unit):
        return None
    blocks = {sizes[layout.group] // layout.size for layout in unit
              if layout.group in sizes and sizes[layout.group] % layout.size == 0}
    return {**changes, "block_size": blocks.pop()} if len(blocks) == 1 else None


@dataclass(frozen=True, slots=True)
class Reading:
    """One way to read a group's values: a layout, and the settings of vLLM's that give it."""

    layout: Layout
    assumed: dict


# The vLLM flag that settles each setting a reading assumes, in the order an operator would look.
SETTLING_FLAGS = (("model_dtype", "--dtype"), ("kv_dtype", "--kv-cache-dtype"),
                  ("conv_dtype", "--mamba-cache-dtype"), ("ssm_dtype", "--mamba-ssm-cache-dtype"),
                  ("block_size", "--block-size"), ("kernel_block_size", "--kernel-block-size"),
                  ("tp_size", "--tensor-parallel-size"), ("platform", "--platform"),
                  ("vllm_version", "--vllm-version"))


MANIFEST_FLAG = "--block-tables DIR (the recorder's manifest of what vLLM registered)"


def settling_flags(readings: list[Reading]) -> list[str]:
    """The flags whose values tell the readings apart (any one that differs settles part of it)."""
    return [flag for setting, flag in SETTLING_FLAGS
            if len({str(reading.assumed.get(setting)) for reading in readings}) > 1]


def describe_reading(reading: Reading) -> dict:
    """A reading as the report lists it: the settings it assumes and the dtypes of its regions."""
    dtypes = sorted({region.dtype for _, region in reading.layout.regions() if region.kind != "padding"})
    padding = sum(region.length for _, region in reading.layout.regions() if region.kind == "padding")
    return {"assumed": reading.assumed, "dtypes": dtypes, "padding_bytes": padding,
            "segments": len(reading.layout.segments)}


@dataclass
class Inference:
    """What the listed sizes say about one model: the most likely layout of each group, every
    other reading of the groups that several fit, and one report row per group seen."""

    layouts: list[Layout]
    rows: list[dict]
    readings: dict[tuple[str, int | None], list[Reading]] = field(default_factory=dict)


def _merged(settings: list[dict]) -> dict:
    """Settings that give identical bytes: each setting's value, or every value that would
    (``"platform": ["cuda", "cpu"]`` when the bytes cannot say which platform wrote them; every
    CUDA GPU is ``cuda``)."""
    merged = {}
    for name in settings[0]:
        values = list(dict.fromkeys(setting[name] for setting in settings))
        if name == "platform" and set(CUDA_PLATFORMS) <= set(values):
            values = list(dict.fromkeys("cuda" if value in CUDA_PLATFORMS else value for value in values))
        merged[name] = values[0] if len(values) == 1 else values
    return merged


def _fitting_candidates(request: LayoutRequest, sizes: dict[int, int], least_tp: int, limit: int,
                        memo: dict | None = None):
    """[changes that give identical bytes, layouts, score] of every distinct candidate, most
    likely first; score: how many groups' dominant sizes the layouts fit. TP sizes below
    `least_tp` (a key of that rank exists) are not candidates unless the operator gave one.
    `memo` (`layouts_from_hf_config`): candidates that resolve to the same settings are built once."""
    by_signature: dict[tuple, list] = {}
    memo = {} if memo is None else memo
    signatures: dict[tuple, tuple] = {}  # ids of the memo's layouts (kept alive there) -> their signature
    blocks: dict[tuple, int | None] = {}  # the block an attention-only fit gives, per candidate but its block
    for count, alike in enumerate(candidates(request)):
        if count >= limit:
            break
        changes = alike[0]
        if not request.tp_given and changes["tp_size"] < least_tp:
            continue
        if request.block_size is None:
            unit = tuple(item for item in changes.items() if item[0] != "block_size")  # its block is 1
            if unit not in blocks:
                fitted = _attention_block_fit(request, changes, sizes, memo)
                blocks[unit] = None if fitted is None else fitted["block_size"]
            if blocks[unit] is not None:
                alike = [{**variant, "block_size": blocks[unit]} for variant in alike]
                changes = alike[0]
        try:
            layouts = request.layouts(memo, **changes)
        except LayoutError:
            continue
        built = tuple(map(id, layouts))
        signature = signatures.get(built)
        if signature is None:
            signature = signatures[built] = tuple((layout.group, reading_signature(layout)) for layout in layouts)
        if signature in by_signature:
            by_signature[signature][0].extend(alike)
            continue
        score = sum(1 for layout in layouts if sizes.get(layout.group) == layout.size)
        by_signature[signature] = [list(alike), layouts, score]
    return list(by_signature.values())


def infer_layouts(request: LayoutRequest, observed: dict[tuple[str, int], GroupSizes],
                  limit: int = 6000) -> Inference:
    """The layouts to judge ``request.model``'s keys with: every reading that fits, per group."""
    sizes = {group: seen.dominant for (model, group), seen in observed.items() if model == request.name}
    try:
        configured = request.layouts()
    except LayoutError:
        configured = None
    if not sizes:
        if configured is None:
            request.layouts()  # raise the operator's error: nothing to infer from
        return Inference(configured, [])
    least_tp = 1 + max(seen.max_tp_rank for (model, _), seen in observed.items() if model == request.name)
    memo: dict = {}  # what the candidates share (dtypes, builds), for `described` too
    fitted = _fitting_candidates(request, sizes, least_tp, limit, memo)
    if not fitted:
        raise LayoutError(f"{request.name}: no layout of vLLM's candidates can be built from its config")
    best_score = max(score for _, _, score in fitted)
    fitting = [(changes, layouts) for changes, layouts, score in fitted if score == best_score]
    best_changes, best = fitting[0]
    as_configured = configured is not None and (
        [reading_signature(layout) for layout in configured] == [reading_signature(layout) for layout in best])
    found: dict[int | None, dict[tuple, tuple[Layout, list[dict]]]] = defaultdict(dict)
    for changes, layouts in fitting:
        for layout in layouts:
            if sizes.get(layout.group) == layout.size:
                _, settings = found[layout.group].setdefault(reading_signature(layout), (layout, []))
                settings += [request.described(memo, **change) for change in changes]
    readings = {group: [Reading(layout, _merged(settings)) for layout, settings in by_signature.values()]
                for group, by_signature in found.items()}
    rows = []
    by_group = {layout.group: layout for layout in best}
    for (model, group), seen in sorted(observed.items()):
        if model != request.name:
            continue
        layout = by_group.get(group)
        fits = layout is not None and layout.size == seen.dominant
        choices = readings.get(group, [])
        status = ("no_fit" if not fits else "ambiguous" if len(choices) > 1
                  else "as_configured" if as_configured else "inferred")
        row = {"model": model, "group": group, "keys": seen.keys, "dominant_size": seen.dominant,
               "layout_size": None if layout is None else layout.size, "status": status,
               "from": f"{seen.sizes[seen.dominant]} of {seen.keys} keys of {seen.dominant:,} B",
               "assumed": choices[0].assumed if choices else _merged([request.described(memo, **change)
                                                                      for change in best_changes])}
        if status == "ambiguous":
            row["candidates"] = [describe_reading(reading) for reading in choices]
            row["settle_with"] = settling_flags(choices) + [MANIFEST_FLAG]
        others = {str(size): count for size, count in seen.sizes.items() if size != seen.dominant}
        if others:
            row["other_sizes"] = others  # SIZE_MISMATCH: another producer under the same name?
        rows.append(row)
    ambiguous = {(request.name, group): choices for group, choices in readings.items() if len(choices) > 1}
    return Inference(best, rows, ambiguous)
