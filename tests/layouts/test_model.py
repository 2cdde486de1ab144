"""Invariants every Layout keeps, whatever built it."""

from __future__ import annotations

import pytest

from audit.layouts import Layout, LayoutError, Region, Segment, canonical_dtype, layouts_from_hf_config

from .configs import CODESTRAL, LFM2_1_2B, MAMBA_130M, QWEN3_5_9B, QWEN3_NEXT


def _all_layouts():
    for config in (MAMBA_130M, CODESTRAL, QWEN3_NEXT, QWEN3_5_9B, LFM2_1_2B):
        for tp_size in (1, 2):
            yield from layouts_from_hf_config(config, model="m", tp_size=tp_size)


@pytest.mark.parametrize("layout", list(_all_layouts()), ids=lambda layout: f"{layout.kind}")
def test_regions_tile_each_segment_and_the_value(layout):
    position = 0
    for segment, region in layout.regions():
        assert region.offset == position
        assert segment.offset <= region.offset
        assert region.offset + region.length <= segment.offset + segment.length
        position += region.length
    assert position == layout.size == sum(segment.length for segment in layout.segments)
    # hybrid pages are all one size: vLLM's uniform page across groups
    assert len({segment.length for segment in layout.segments}) == 1


def _region(offset=0, length=8, dtype="bfloat16", shape=(4,), kind="state", name="conv"):
    return Region(name, kind, offset, length, dtype, shape)


def test_region_length_must_match_shape_and_dtype():
    # 4 bf16 elements are 8 bytes
    assert _region().length == 8
    with pytest.raises(LayoutError, match="length 6 != shape"):
        _region(length=6)
    with pytest.raises(LayoutError, match="kind 'weird'"):
        _region(kind="weird")
    with pytest.raises(LayoutError, match="unknown dtype"):
        _region(dtype="int8")
    with pytest.raises(LayoutError, match="tuple of positive ints"):
        _region(shape=[4])


def test_segment_regions_must_be_contiguous_and_cover_it():
    with pytest.raises(LayoutError, match="starts at 10, expected 8"):
        Segment(0, "layers.0", 0, 0, 18, (_region(), _region(offset=10, name="ssm")))
    with pytest.raises(LayoutError, match="cover 8 of 16 bytes"):
        Segment(0, "layers.0", 0, 0, 16, (_region(),))


def test_layout_segments_must_be_back_to_back():
    first = Segment(0, "layers.0", 0, 0, 8, (_region(),))
    gap = Segment(1, "layers.1", 1, 16, 8, (_region(offset=16),))
    with pytest.raises(LayoutError, match="expected index 1 at offset 8"):
        Layout("m", 0, "mamba1", 1, (first, gap))
    with pytest.raises(LayoutError, match="layout kind"):
        Layout("m", 0, "mamba3", 1, (first,))
    assert Layout("m", None, "mamba1", 1, (first,)).size == 8


def test_canonical_dtype_accepts_vllm_spellings():
    assert canonical_dtype("fp8") == "float8_e4m3fn"
    assert canonical_dtype("torch.bfloat16") == "bfloat16"
    assert canonical_dtype("half") == "float16"
    assert canonical_dtype("float") == "float32"
    with pytest.raises(LayoutError):
        canonical_dtype("raw")
