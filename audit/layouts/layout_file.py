"""The JSON layout file: an explicit description of values for models the tool cannot derive
(or to pin a derived layout next to an audit). Schema in docs/layouts.md.

Offsets are never written: regions follow each other inside a segment and segments follow each
other inside the value, so order and sizes determine every offset and a file cannot contradict
itself.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .model import (
    DTYPE_SIZES,
    LayoutError,
    Layout,
    Region,
    Segment,
    canonical_dtype,
    layer_segment_name,
)

SCHEMA = "mooncake-audit/layout"
VERSION = 1

_DOCUMENT_FIELDS = {"schema", "version", "layouts"}
_LAYOUT_FIELDS = {"model", "group", "kind", "tp_size", "segments"}
_SEGMENT_FIELDS = {"name", "layer", "length", "regions"}
_REPEATED_SEGMENT_FIELDS = {"count", "layers", "regions"}
_REGION_FIELDS = {"name", "kind", "dtype", "shape", "length"}

# A region before its offset is known: (name, kind, dtype, shape).
_RegionSpec = tuple[str, str, str, tuple[int, ...]]


@contextmanager
def _at(where: str) -> Iterator[None]:
    try:
        yield
    except LayoutError as error:
        raise LayoutError(f"{where}: {error}") from None


def _object(value, where: str, allowed: set[str]) -> dict:
    if not isinstance(value, dict):
        raise LayoutError(f"{where}: expected an object, got {type(value).__name__}")
    unknown = sorted(set(value) - allowed)
    if unknown:
        raise LayoutError(f"{where}: unknown field(s) {unknown} (allowed: {sorted(allowed)})")
    return value


def _int(value, where: str, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise LayoutError(f"{where}: expected an integer >= {minimum}, got {value!r}")
    return value


def _str(value, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise LayoutError(f"{where}: expected a non-empty string, got {value!r}")
    return value


def _list(value, where: str) -> list:
    if not isinstance(value, list) or not value:
        raise LayoutError(f"{where}: expected a non-empty list, got {value!r}")
    return value


def _region_spec(entry, where: str) -> _RegionSpec:
    entry = _object(entry, where, _REGION_FIELDS)
    name = _str(entry.get("name", "padding" if entry.get("kind") == "padding" else None),
                f"{where}.name")
    kind = _str(entry.get("kind"), f"{where}.kind")
    dtype = entry.get("dtype", "raw")
    if dtype != "raw":
        with _at(f"{where}.dtype"):
            dtype = canonical_dtype(_str(dtype, f"{where}.dtype"))
    if "shape" in entry:
        shape = tuple(_int(dim, f"{where}.shape", 1) for dim in _list(entry["shape"], f"{where}.shape"))
    elif dtype == "raw" and "length" in entry:
        shape = (_int(entry["length"], f"{where}.length", 1),)
    else:
        raise LayoutError(f"{where}: needs \"shape\" (or \"length\" for a raw region)")
    if "length" in entry:
        length = _int(entry["length"], f"{where}.length", 1)
        expected = DTYPE_SIZES[dtype] * math.prod(shape)
        if length != expected:
            raise LayoutError(f"{where}: length {length} != shape {list(shape)} x {dtype} "
                              f"= {expected} bytes")
    return name, kind, dtype, shape


def _segment(index: int, name: str, layer: int, offset: int, specs: list[_RegionSpec],
             declared_length: int | None, where: str) -> Segment:
    regions = []
    position = offset
    with _at(where):
        for region_name, kind, dtype, shape in specs:
            length = DTYPE_SIZES[dtype] * math.prod(shape)
            regions.append(Region(region_name, kind, position, length, dtype, shape))
            position += length
        length = position - offset
        if declared_length is not None and declared_length != length:
            raise LayoutError(f"length {declared_length} != {length} bytes of its regions "
                              f"(add a padding region for the rest)")
        return Segment(index, name, layer, offset, length, tuple(regions))


def _segments(value, where: str) -> tuple[Segment, ...]:
    if isinstance(value, dict):  # repeated form: one region list for every segment
        entry = _object(value, where, _REPEATED_SEGMENT_FIELDS)
        count = _int(entry.get("count"), f"{where}.count", 1)
        layers = entry.get("layers", list(range(count)))
        layers = [_int(layer, f"{where}.layers", 0) for layer in _list(layers, f"{where}.layers")]
        if len(layers) != count:
            raise LayoutError(f"{where}.layers: {len(layers)} layers for count {count}")
        specs = [_region_spec(region, f"{where}.regions[{i}]")
                 for i, region in enumerate(_list(entry.get("regions"), f"{where}.regions"))]
        segments, offset = [], 0
        for index, layer in enumerate(layers):
            segment = _segment(index, layer_segment_name(layer), layer, offset, specs, None,
                               f"{where}[{index}]")
            segments.append(segment)
            offset += segment.length
        return tuple(segments)
    segments, offset = [], 0
    for index, entry in enumerate(_list(value, where)):
        at = f"{where}[{index}]"
        entry = _object(entry, at, _SEGMENT_FIELDS)
        layer = _int(entry.get("layer", index), f"{at}.layer", -1)
        name = _str(entry.get("name", layer_segment_name(layer)), f"{at}.name")
        declared = _int(entry["length"], f"{at}.length", 1) if "length" in entry else None
        specs = [_region_spec(region, f"{at}.regions[{i}]")
                 for i, region in enumerate(_list(entry.get("regions"), f"{at}.regions"))]
        segment = _segment(index, name, layer, offset, specs, declared, at)
        segments.append(segment)
        offset += segment.length
    return tuple(segments)


def _layout(entry, where: str) -> Layout:
    entry = _object(entry, where, _LAYOUT_FIELDS)
    group = entry.get("group")
    if group is not None:
        group = _int(group, f"{where}.group", 0)
    model = _str(entry.get("model"), f"{where}.model")
    kind = _str(entry.get("kind"), f"{where}.kind")
    tp_size = _int(entry.get("tp_size", 1), f"{where}.tp_size", 1)
    segments = _segments(entry.get("segments"), f"{where}.segments")
    with _at(where):
        return Layout(model=model, group=group, kind=kind, tp_size=tp_size, segments=segments)


def parse_layout_document(document) -> list[Layout]:
    """Layouts from an already-parsed layout document (errors name the JSON path)."""
    document = _object(document, "document", _DOCUMENT_FIELDS)
    if document.get("schema") != SCHEMA:
        raise LayoutError(f"\"schema\" must be {SCHEMA!r}, got {document.get('schema')!r}")
    if document.get("version") != VERSION:
        raise LayoutError(f"\"version\" {document.get('version')!r} is not supported "
                          f"(this tool reads version {VERSION})")
    entries = _list(document.get("layouts"), "layouts")
    return [_layout(entry, f"layouts[{index}]") for index, entry in enumerate(entries)]


def load_layout_file(path: str | Path) -> list[Layout]:
    """Layouts from a layout file; any problem is a LayoutError naming the file."""
    path = Path(path)
    try:
        document = json.loads(path.read_text())
    except OSError as error:
        raise LayoutError(f"{path}: cannot read: {error.strerror}") from None
    except json.JSONDecodeError as error:
        raise LayoutError(f"{path}: not JSON: {error.msg} at line {error.lineno} "
                          f"column {error.colno}") from None
    with _at(str(path)):
        return parse_layout_document(document)


def _region_entry(region: Region) -> dict:
    return {"name": region.name, "kind": region.kind, "dtype": region.dtype,
            "shape": list(region.shape)}


def _dump_segments(segments: tuple[Segment, ...]) -> dict | list:
    first = [_region_entry(region) for region in segments[0].regions]
    repeated = all(
        segment.name == layer_segment_name(segment.layer)
        and [_region_entry(region) for region in segment.regions] == first
        for segment in segments)
    if repeated:
        entry: dict = {"count": len(segments)}
        layers = [segment.layer for segment in segments]
        if layers != list(range(len(segments))):
            entry["layers"] = layers
        entry["regions"] = first
        return entry
    return [{"name": segment.name, "layer": segment.layer, "length": segment.length,
             "regions": [_region_entry(region) for region in segment.regions]}
            for segment in segments]


def dump_layout_file(layouts: list[Layout]) -> dict:
    """The layout document for ``layouts`` (repeated segments written once); json.dump it."""
    return {
        "schema": SCHEMA,
        "version": VERSION,
        "layouts": [{"model": layout.model, "group": layout.group, "kind": layout.kind,
                     "tp_size": layout.tp_size, "segments": _dump_segments(layout.segments)}
                    for layout in layouts],
    }
