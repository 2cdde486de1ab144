"""Rows and a one-line summary of a layout, for the ``layout`` command and for reports."""

from __future__ import annotations

from .model import Layout


def describe(layout: Layout) -> list[dict]:
    """One row per region, in byte order: where it is, how long, how to read it."""
    return [
        {"segment": segment.name, "layer": segment.layer, "region": region.name,
         "kind": region.kind, "offset": region.offset, "length": region.length,
         "dtype": region.dtype, "shape": region.shape}
        for segment, region in layout.regions()
    ]


def summarize(layout: Layout) -> str:
    """E.g. ``mamba-130m-hf group 0 (mamba1, TP 1): 1,400,832 bytes per key = 24 segments x
    58,368 bytes; state 1,400,832, kv 0, padding 0`` (compare with vLLM's startup log)."""
    by_kind = {"state": 0, "kv": 0, "padding": 0}
    for _, region in layout.regions():
        by_kind[region.kind] += region.length
    lengths = {segment.length for segment in layout.segments}
    count = len(layout.segments)
    per_segment = (f"{count} segments x {lengths.pop():,} bytes" if len(lengths) == 1
                   else f"{count} segments of {min(lengths):,}-{max(lengths):,} bytes")
    group = "any group" if layout.group is None else f"group {layout.group}"
    return (f"{layout.model} {group} ({layout.kind}, TP {layout.tp_size}): "
            f"{layout.size:,} bytes per key = {per_segment}; "
            + ", ".join(f"{kind} {total:,}" for kind, total in by_kind.items()))
