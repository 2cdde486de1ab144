"""WEIGHTS_MISMATCH: a state whose layer-0 conv rows are not the images of any token under the
weights the operator gave (`--model-config DIR` holding the checkpoint).

Such a state is finite, non-zero and well formed, and still not what these weights compute for any
prefix: another checkpoint published under the same model name, bytes read in the wrong dtype,
garbage. The rows are decoded in `audit.checks.binding`; this module finds them in a value (the conv
region of layer 0) and says what they show."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from audit.checks.binding import ROW_TOLERANCE, nearest_tokens
from audit.checks.floats import decode_floats
from audit.judge.fingerprints import ProducerWeights
from audit.judge.prefixes import check_prefix
from audit.layouts import LayoutError
from audit.layouts.checkpoint import Checkpoint
from audit.layouts.weights import token_images
from audit.prefixrecords import PrefixRecords
from audit.records import KeyRecord, Verdict

# A value already flagged for its state (zero, NaN/Inf, or a reading not decided) is not decoded.
_ALREADY_FLAGGED = frozenset({Verdict.ZERO_STATE, Verdict.ZERO_VALUE, Verdict.NONFINITE, Verdict.PARTIAL_ZERO,
                              Verdict.SIZE_MISMATCH, Verdict.AMBIGUOUS_LAYOUT})


NO_LAYER0_STATE = "no key read holds layer 0's conv state (layer 0 is attention, or no key of it was read)"


@dataclass
class Bindings:
    """The token images of every model directory given with its weights, by (model, TP size, TP
    rank), built when a key of theirs is first judged; `unbound` says why a model is not bound."""

    directories: dict[str, Path] = field(default_factory=dict)  # model name (as in keys) -> directory
    unbound: dict[str, str] = field(default_factory=dict)
    producers: ProducerWeights | None = None  # the manifests' fingerprints against these directories'
    prefixes: PrefixRecords | None = None     # the producers' prefix records (--block-tables DIR)
    _images: dict = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, model_configs, model_name: str | None = None) -> Bindings:
        directories = {}
        for path in map(Path, model_configs):
            if path.is_dir() and Checkpoint.found(path):
                directories[model_name or path.name] = path
        return cls(directories)

    def images(self, model: str, tp_size: int, tp_rank: int):
        if model not in self.directories or model in self.unbound:
            return None
        ident = (model, tp_size, tp_rank)
        if ident not in self._images:
            try:
                self._images[ident] = token_images(self.directories[model], model, tp_size, tp_rank)
            except (LayoutError, OSError, ValueError) as error:
                self.unbound[model] = str(error)
                return None
        return self._images[ident]

    def summary(self, in_tasks: bool = False) -> dict:
        """For the report: which models' keys were bound, and why the others' were not. `in_tasks`
        (--ray): each task bound its own keys (their verdicts are in the records); what they bound
        is not brought back, so the models given are listed as such."""
        extra = {} if self.producers is None else {"fingerprints": self.producers.summary()}
        if self.prefixes is not None:  # PREFIX_MISMATCH: what the records could say
            extra["prefix_records"] = {"hashes": len(self.prefixes), "conflicting": len(self.prefixes.conflicts),
                                       "skipped_lines": self.prefixes.skipped}
        if in_tasks:
            return {"bound": [], "not_bound": {}, "row_tolerance": ROW_TOLERANCE,
                    "bound_in_tasks": sorted(self.directories), **extra}
        bound = {model for model, _, _ in self._images} - set(self.unbound)
        not_bound = {model: self.unbound.get(model, NO_LAYER0_STATE) for model in self.directories
                     if model not in bound}
        return {"bound": sorted(bound), "not_bound": not_bound, "row_tolerance": ROW_TOLERANCE, **extra}


def layer0_conv(layout):
    """The conv region of layer 0 in `layout`, or None: only there is a row a function of one token."""
    for segment, region in layout.regions():
        if segment.layer == 0 and region.kind == "state" and region.name == "conv":
            return region
    return None


def bind_values(records: list[KeyRecord], values: list, readings: list, bindings: Bindings) -> None:
    """WEIGHTS_MISMATCH on each record whose value's (``values[i]``: its bytes, or None when unread)
    layer-0 conv rows are not all images of tokens under its model's weights, under any of its
    readings (``readings[i]``: the layouts it may be read with, the one it is judged by first): a
    size that fits bfloat16 and float16 alike is bound under the reading that decodes to tokens,
    and flagged only when none does. All the batch's rows are decoded at once, per (model, TP
    size, rank)."""
    groups: dict[int, list] = {}
    tried: dict[int, list] = {}  # record index -> (images, tokens, distances), one per distinct layer-0 region
    for i, (record, value, layouts) in enumerate(zip(records, values, readings)):
        if value is None or not layouts or _ALREADY_FLAGGED.intersection(record.verdicts):
            continue
        for region, layout in {layer0_conv(layout): layout for layout in layouts if layout.size == record.size}.items():
            if region is None:
                continue
            rank = record.parsed_fields().get("tp_rank", 0) if layout.tp_size > 1 else 0
            images = bindings.images(layout.model, layout.tp_size, rank)
            rows = None if images is None else _rows(value, region)
            if rows is None:
                continue
            if rows.shape[1] != images.columns:
                bindings.unbound[layout.model] = (f"layer 0's conv rows have {rows.shape[1]} columns at TP "
                                                  f"{layout.tp_size}, the image rule {images.columns}")
                continue
            groups.setdefault(id(images), [images, []])[1].append((i, rows))
    for images, members in groups.values():
        tokens, distances = nearest_tokens(np.concatenate([rows for _, rows in members]), images)
        start = 0
        for i, rows in members:
            end = start + len(rows)
            tried.setdefault(i, []).append((images, tokens[start:end], distances[start:end]))
            start = end
    for i, outcomes in tried.items():
        bound = [(images, tokens) for images, tokens, distances in outcomes if (distances <= ROW_TOLERANCE).all()]
        if not bound:
            images, tokens, distances = outcomes[0]
            _flag(records[i], tokens, distances, images)
        elif bindings.prefixes is not None:  # these weights' state: of the prefix its hash names?
            images, tokens = bound[0]
            check_prefix(records[i], tokens, images, bindings.prefixes)


def _rows(value, region) -> np.ndarray | None:
    """The region's rows as float32, oldest token first (vLLM's "SD" layout is (state_len, dim);
    a "DS" layout is its transpose); None for a dtype that is not a float. A value in device memory
    brings only these bytes to the host."""
    data = value[region.offset:region.offset + region.length]
    if not isinstance(data, np.ndarray):  # a torch tensor on the GPU
        data = data.cpu().numpy()
    numbers = decode_floats(data, region.dtype)
    if numbers is None:
        return None
    rows = numbers.reshape(region.shape).astype(np.float32)
    return rows if rows.shape[0] <= rows.shape[1] else rows.T


def _flag(record: KeyRecord, tokens, distances, images) -> None:
    record.verdicts.append(Verdict.WEIGHTS_MISMATCH)
    record.evidence["weights_mismatch"] = {
        "layer": 0, "region": "conv", "row_tolerance": ROW_TOLERANCE,
        "rows": [{"row": row, "nearest_token": int(token), "distance": round(float(distance), 6)}
                 for row, (token, distance) in enumerate(zip(tokens, distances))],
        "weights": images.source}
