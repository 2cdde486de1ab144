"""The byte layout of one Mooncake value: segments (registered memory regions, in registration
order) split into typed regions.

Construction validates: a Layout that exists tiles its value exactly, with every byte in one
region, so a checker can trust offsets without re-deriving them.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass


class LayoutError(ValueError):
    """A layout cannot be built or read; the message names what and where, on one line."""


DTYPE_SIZES: dict[str, int] = {
    "bfloat16": 2,
    "float16": 2,
    "float32": 4,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "raw": 1,
}

# vLLM's spellings (--kv-cache-dtype, --mamba-ssm-cache-dtype, torch names) -> ours.
_DTYPE_ALIASES = {
    "bf16": "bfloat16",
    "half": "float16",
    "fp16": "float16",
    "float": "float32",
    "fp32": "float32",
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
}

REGION_KINDS = ("state", "kv", "padding", "header")  # header: a producer's own description of the value
LAYOUT_KINDS = ("mamba1", "mamba2", "gdn", "short_conv", "linear_attention", "attention")


def canonical_dtype(name: str) -> str:
    """Our dtype name for ``name`` (also accepts vLLM and torch spellings such as ``fp8``)."""
    key = name.strip().lower().removeprefix("torch.")
    key = _DTYPE_ALIASES.get(key, key)
    if key not in DTYPE_SIZES or key == "raw":
        known = ", ".join(name for name in DTYPE_SIZES if name != "raw")
        raise LayoutError(f"unknown dtype {name!r} (known: {known})")
    return key


def layer_segment_name(layer: int) -> str:
    """How a segment holding one model layer is named (``layers.3``), in layouts and files."""
    return f"layers.{layer}"


@dataclass(frozen=True, slots=True)
class Region:
    """A typed run of bytes inside a segment (offset is within the VALUE)."""

    name: str
    kind: str
    offset: int
    length: int
    dtype: str
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.kind not in REGION_KINDS:
            raise LayoutError(f"region {self.name!r}: kind {self.kind!r} is not one of {REGION_KINDS}")
        if self.dtype not in DTYPE_SIZES:
            raise LayoutError(f"region {self.name!r}: unknown dtype {self.dtype!r}")
        if not isinstance(self.shape, tuple) or not all(
            isinstance(dim, int) and dim > 0 for dim in self.shape
        ):
            raise LayoutError(f"region {self.name!r}: shape must be a tuple of positive ints, "
                              f"got {self.shape!r}")
        expected = math.prod(self.shape) * DTYPE_SIZES[self.dtype]
        if self.length != expected:
            raise LayoutError(f"region {self.name!r}: length {self.length} != shape {self.shape} "
                              f"x {self.dtype} = {expected} bytes")
        if self.offset < 0:
            raise LayoutError(f"region {self.name!r}: negative offset {self.offset}")


@dataclass(frozen=True, slots=True)
class Segment:
    """One registered memory region's block (``block_len`` bytes) as it sits in the value."""

    index: int
    name: str
    layer: int
    offset: int
    length: int
    regions: tuple[Region, ...]

    def __post_init__(self) -> None:
        if self.length <= 0:
            raise LayoutError(f"segment {self.name!r}: length must be positive, got {self.length}")
        if not self.regions:
            raise LayoutError(f"segment {self.name!r}: has no regions")
        position = self.offset
        for region in self.regions:
            if region.offset != position:
                raise LayoutError(
                    f"segment {self.name!r}: region {region.name!r} starts at {region.offset}, "
                    f"expected {position} (regions must be contiguous, in order)")
            position += region.length
        end = self.offset + self.length
        if position != end:
            raise LayoutError(
                f"segment {self.name!r}: regions cover {position - self.offset} of {self.length} "
                f"bytes (add a padding region for the rest)")


@dataclass(frozen=True, slots=True)
class Layout:
    """How the bytes of every key of one (model, KV-cache group, TP size) are laid out."""

    model: str
    group: int | None
    kind: str
    tp_size: int
    segments: tuple[Segment, ...]

    def __post_init__(self) -> None:
        if self.kind not in LAYOUT_KINDS:
            raise LayoutError(f"layout kind {self.kind!r} is not one of {LAYOUT_KINDS}")
        if self.tp_size < 1:
            raise LayoutError(f"tp_size must be >= 1, got {self.tp_size}")
        if self.group is not None and self.group < 0:
            raise LayoutError(f"group must be >= 0 or null, got {self.group}")
        if not self.segments:
            raise LayoutError("layout has no segments")
        position = 0
        for index, segment in enumerate(self.segments):
            if segment.index != index or segment.offset != position:
                raise LayoutError(
                    f"segment {segment.name!r}: index {segment.index} at offset {segment.offset}, "
                    f"expected index {index} at offset {position} (segments are back to back)")
            position += segment.length

    @property
    def size(self) -> int:
        """Bytes per key."""
        last = self.segments[-1]
        return last.offset + last.length

    @property
    def number_dtype(self) -> str:
        """The dtype its numbers are read in: its first region's that is not padding."""
        return next(region.dtype for _, region in self.regions() if region.kind != "padding")

    def regions(self) -> Iterator[tuple[Segment, Region]]:
        """Every region of the value, in byte order, with the segment holding it."""
        for segment in self.segments:
            for region in segment.regions:
                yield segment, region
