"""Layouts from the producer's manifest: what vLLM itself registered, so nothing is inferred.

The recorder plugin (`audit.recorder.manifest`) writes ``manifest-{host}-{pid}.json`` beside its
block records, once per engine process: per KV-cache group, its kind, block and page size, each
registered segment in registration order with its per-block length and the owning layer's tensor
(and decoder layer: `segment_layer`), and a Mamba page's states. Read here into one exact `Layout`
per (model, group): attention pages as one ``kv`` region of the tensor's per-block shape and dtype,
Mamba pages as their ``state`` regions then ``padding``, and a segment no layer of the group owns
(another group's layer: hybrid models share each buffer between groups) as ``unused`` padding.
Every rank writes one; ranks of one deployment give the same layouts, and two that differ are an
error, never a guess.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from .describe import summarize
from .model import DTYPE_SIZES, LayoutError, Layout, Region, Segment, canonical_dtype, layer_segment_name
from .pages import unused_regions
from .versions import CUDA_PLATFORMS

MANIFEST_SCHEMA = "mooncake-audit/manifest"
MANIFEST_VERSION = 1
FROM_MANIFEST = "the producer's manifest"


def manifest_name(host: str, pid: int) -> str:
    return f"manifest-{host}-{pid}.json"


def is_manifest_path(path: Path) -> bool:
    """A manifest by its name: a record directory holds manifests and block-table JSONL files."""
    return path.name.startswith("manifest-") and path.name.endswith(".json")


def manifest_files(paths: Iterable[Path]) -> list[Path]:
    """The manifests among `paths` (files) and inside them (directories, recursively)."""
    found = []
    for path in map(Path, paths):
        if path.is_dir():
            found += sorted(p for p in path.rglob("manifest-*.json") if p.is_file())
        elif is_manifest_path(path):
            found.append(path)
    return found


# a CUDA GPU's compute capability major -> the audit's platform (``versions.PLATFORMS``) of its rules
CAPABILITY_PLATFORMS = {9: "sm90", 10: "sm100", 12: "sm120"}
CUDA = CUDA_PLATFORMS[0]  # vLLM's device name; the audit's platform of a CUDA GPU none of the rules names


def manifest_platform(document: dict) -> str | None:
    """The platform whose rules the manifest's producer ran under: vLLM's device name (``cpu``),
    and on CUDA the GPU its ``device_capability`` names (9.x ``sm90``, 10.x ``sm100``, 12.x
    ``sm120``, another GPU ``cuda``). A manifest without one (written before the recorder kept it)
    says ``cuda``, any CUDA GPU, as it always did."""
    platform = document.get("platform")
    capability = document.get("device_capability")
    if platform != CUDA or not isinstance(capability, list) or not capability:
        return platform
    return CAPABILITY_PLATFORMS.get(capability[0], CUDA)


@dataclass(frozen=True)
class Manifest:
    """One engine process's manifest and the layouts it gives."""

    path: Path
    document: dict
    layouts: tuple[Layout, ...]

    def summary(self) -> dict:
        """For the report: whose manifest, and what it settles."""
        document = self.document
        return {"path": str(self.path), **{name: document.get(name) for name in (
            "model", "host", "pid", "vllm_version", "tenant", "cache_prefix", "store_namespace",
            "tp_size", "tp_rank", "pp_rank", "device_capability")},
            "platform": manifest_platform(document),
            "groups": [{name: group.get(name) for name in ("group", "kind", "spec", "block_size", "page_size")}
                       for group in document["groups"]],
            "layouts": [summarize(layout) for layout in self.layouts]}


@dataclass
class ProducerManifests:
    """Every manifest read, and one layout per (model, group) with the manifest it came from."""

    manifests: list[Manifest]
    layouts: list[Layout]
    sources: dict[tuple[str, int], Manifest]

    @property
    def models(self) -> set[str]:
        return {manifest.document["model"] for manifest in self.manifests}

    def source_of(self, layout: Layout | None) -> Path | None:
        """The manifest a layout came from, or None when it did not come from one."""
        manifest = None if layout is None else self.sources.get((layout.model, layout.group))
        return None if manifest is None or layout not in manifest.layouts else manifest.path

    def rows(self, observed: dict) -> list[dict]:
        """``layout_inference`` rows for the listed groups (`observed`: (model, group) -> GroupSizes,
        as `audit.layouts.infer.observed_sizes` counts them) of the models the manifests cover."""
        rows = []
        for (model, group), seen in sorted(observed.items()):
            if model not in self.models:
                continue
            manifest = self.sources.get((model, group))
            layout = None if manifest is None else next(
                layout for layout in manifest.layouts if layout.group == group)
            row = {"model": model, "group": group, "keys": seen.keys, "dominant_size": seen.dominant,
                   "layout_size": None if layout is None else layout.size,
                   "status": "from_manifest" if layout is not None else "not_in_manifest",
                   "from": FROM_MANIFEST if layout is not None else f"{FROM_MANIFEST} has no layout for this group",
                   "manifest": None if manifest is None else str(manifest.path),
                   "assumed": {} if manifest is None else _settled(manifest.document, group)}
            others = {str(size): count for size, count in seen.sizes.items() if size != seen.dominant}
            if others:
                row["other_sizes"] = others
            rows.append(row)
        return rows


def read_manifests(paths: Iterable[Path]) -> ProducerManifests | None:
    """Every manifest found in `paths` (the ``--block-tables`` paths); None when there is none."""
    manifests = [read_manifest(path) for path in manifest_files(paths)]
    if not manifests:
        return None
    sources: dict[tuple[str, int], Manifest] = {}
    for manifest in manifests:
        for layout in manifest.layouts:
            slot = (layout.model, layout.group)
            first = sources.setdefault(slot, manifest)
            if first is not manifest and _layout_of(first, layout.group) != layout:
                raise LayoutError(
                    f"manifests {first.path} and {manifest.path} give model {layout.model!r} group {layout.group} "
                    f"different layouts ({summarize(_layout_of(first, layout.group))}; {summarize(layout)}): "
                    f"two producers under one model name, or pipeline stages (one layout per model and group)")
    layouts = [_layout_of(manifest, group) for (_, group), manifest in sources.items()]
    return ProducerManifests(manifests, layouts, sources)


def read_manifest(path: Path) -> Manifest:
    try:
        document = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as error:
        raise LayoutError(f"cannot read manifest {path}: {error.strerror}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise LayoutError(f"manifest {path} is not JSON: {error}") from None
    if not isinstance(document, dict) or document.get("schema") != MANIFEST_SCHEMA:
        raise LayoutError(f"{path} is not a mooncake-audit manifest (schema {MANIFEST_SCHEMA!r})")
    if document.get("version") != MANIFEST_VERSION:
        raise LayoutError(f"manifest {path}: version {document.get('version')!r}; this audit reads version "
                          f"{MANIFEST_VERSION} (upgrade the audit, or re-record with its recorder)")
    try:
        return Manifest(Path(path), document, tuple(
            layout for group in document["groups"] if (layout := group_layout(document, group)) is not None))
    except (KeyError, TypeError, ValueError) as error:
        detail = f"missing field {error}" if isinstance(error, KeyError) else str(error)
        raise LayoutError(f"manifest {path}: {detail}") from None


def group_layout(document: dict, group: dict) -> Layout | None:
    """The exact layout of one group's values; None for a group whose segments the manifest
    does not give (a Store-TP layout) or of a kind the audit has no layout for."""
    kind, segments = group["kind"], group["segments"]
    if kind is None or not segments:
        return None
    built, offset = [], 0
    for segment in segments:
        block_len = segment["block_len"]
        if segment["layer"] is None:
            built.append(Segment(segment["index"], f"unused.{segment['index']}", -1, offset, block_len,
                                 unused_regions(offset, block_len)))
        else:
            layer = segment_layer(document, segment)
            name = segment["layer"] if layer is None else layer_segment_name(layer)
            regions = (_state_regions(group, segment, offset) if kind != "attention"
                       else _kv_regions(document, segment, offset))
            built.append(Segment(segment["index"], name, -1 if layer is None else layer, offset, block_len, regions))
        offset += block_len
    return Layout(document["model"], group["group"], kind, document["tp_size"], tuple(built))


def segment_layer(document: dict, segment: dict) -> int | None:
    """The decoder layer of the layer owning a segment of `document`: the manifest's
    ``decoder_layer``, or, in a manifest written before the recorder kept it, the one its name says."""
    if "decoder_layer" in segment:
        return segment["decoder_layer"]
    name = segment.get("layer")
    return None if name is None else decoder_layer(name, layer_name_offset(document))


def decoder_layer(name: str, offset_of_names: int | None) -> int | None:
    """The decoder layer vLLM's layer `name` belongs to: the one integer of the name (vLLM's
    ``extract_layer_index``; None when it has not exactly one), less `offset_of_names` where vLLM
    offset it. vLLM wants each cache layer's name to hold an index of its own, so Falcon-H1
    (``FalconH1ParallelHybrid``) names decoder layer ``i``'s SSM mixer ``model.{L + i}.mixer``
    (``L``: ``num_hidden_layers``) beside its attention ``model.layers.{i}.attn``: an index right
    under the root, and at least the offset, is such a name's."""
    found = _layer_number(name)
    if found is None:
        return None
    index, offset_named = found
    if offset_named and offset_of_names is not None and index >= offset_of_names:
        return index - offset_of_names
    return index


def layer_name_offset(document: dict) -> int | None:
    """``num_hidden_layers`` as vLLM offsets Falcon-H1's mixer names by it (`decoder_layer`), read off
    a manifest's layer names: a rank's decoder layers each have both an attention layer
    (``model.layers.{i}.attn``) and a mixer (``model.{L + i}.mixer``), so the first mixer's index less
    the first attention layer's; None when its names are not both kinds."""
    offset_named, layer_named = [], []
    for group in document["groups"]:
        for found in filter(None, map(_layer_number, group.get("layers") or ())):
            (offset_named if found[1] else layer_named).append(found[0])
    if not offset_named or not layer_named or min(offset_named) <= min(layer_named):
        return None
    return min(offset_named) - min(layer_named)


def _layer_number(name: str) -> tuple[int, bool] | None:
    """The one integer of a layer name, and whether it stands right under the root (``model.2.mixer``,
    not ``model.layers.2.attn``); None when the name has not exactly one."""
    parts = name.split(".")
    at = [position for position, part in enumerate(parts) if part.isdigit()]
    if len(at) != 1:
        return None
    return int(parts[at[0]]), at[0] == 1 and parts[0] != "layers"


def _kv_regions(document: dict, segment: dict, offset: int) -> tuple[Region, ...]:
    """One ``kv`` region: the layer tensor's block, in its dtype and shape (``[H, N, C]``, or with a
    leading kernel-block count when vLLM splits a block), then padding to the segment's length."""
    shape = segment["tensor_shape"]
    per_block = shape[0] // document["num_blocks"]
    block_shape = tuple(shape[1:]) if per_block <= 1 else (per_block, *shape[1:])
    dtype = stored_dtype(segment["dtype"], document.get("cache_dtype"))
    length = math.prod(block_shape) * DTYPE_SIZES[dtype]
    if segment["offset_in_page"] or length > segment["block_len"]:  # a slice of the layer's page (one head)
        length = segment["block_len"]
        block_shape = (length // DTYPE_SIZES[dtype],)
    regions = [_region("kv", "kv", offset, length, dtype, block_shape)]
    return _padded(regions, offset + length, offset + segment["block_len"])


def _state_regions(group: dict, segment: dict, offset: int) -> tuple[Region, ...]:
    """The Mamba page's states where vLLM packs them, then padding to the segment's length."""
    if segment["offset_in_page"]:
        raise ValueError(f"group {group['group']} segment {segment['index']} starts inside its layer's page")
    regions, position = [], offset
    for state in group["states"]:
        start = offset + state["offset"]
        regions += _padded([], position, start)
        regions.append(_region(state["name"], "state", start, state["length"], stored_dtype(state["dtype"], None),
                               tuple(state["shape"])))
        position = start + state["length"]
    return _padded(regions, position, offset + segment["block_len"])


def _padded(regions: list[Region], position: int, end: int) -> tuple[Region, ...]:
    if end < position:
        raise ValueError(f"regions run to byte {position}, past their segment's end at {end}")
    if end > position:
        regions.append(Region("padding", "padding", position, end - position, "raw", (end - position,)))
    return tuple(regions)


def _region(name: str, kind: str, offset: int, length: int, dtype: str, shape: tuple) -> Region:
    """A typed region; one the audit cannot decode (dtype or shape not its own) stays raw bytes."""
    if dtype != "raw" and math.prod(shape) * DTYPE_SIZES[dtype] == length:
        return Region(name, kind, offset, length, dtype, shape)
    return Region(name, kind, offset, length, "raw", (length,))


def stored_dtype(name: str, cache_dtype: str | None) -> str:
    """Our name for a torch dtype; vLLM keeps an fp8 KV cache as uint8 (``--kv-cache-dtype`` says which)."""
    if name == "uint8" and cache_dtype and cache_dtype.startswith("fp8"):
        name = cache_dtype
    try:
        return canonical_dtype(name)
    except LayoutError:
        return "raw"


def _layout_of(manifest: Manifest, group: int) -> Layout:
    return next(layout for layout in manifest.layouts if layout.group == group)


def _settled(document: dict, group: int) -> dict:
    """What the manifest says about the group's values, in the terms a reading assumes."""
    entry = next((g for g in document["groups"] if g["group"] == group), {})
    settled = {"platform": manifest_platform(document), "vllm_version": document.get("vllm_version"),
               "tp_size": document.get("tp_size"), "block_size": entry.get("block_size"),
               "page_size": entry.get("page_size")}
    if entry.get("attention"):
        settled["kv_dtype"] = entry["attention"]["dtype"]
    for state in entry.get("states") or ():
        settled[f"{state['name']}_dtype"] = state["dtype"]
    return settled
