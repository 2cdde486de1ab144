"""Byte layouts of the values vLLM's MooncakeStoreConnector publishes: which bytes of a key
are conv state, ssm state, attention K/V or padding. See docs/layouts.md."""

from .candidates import layouts_from_hf_config
from .describe import describe, summarize
from .families import SUPPORTED_MODEL_TYPES
from .hf_config import load_hf_config
from .layout_file import dump_layout_file, load_layout_file, parse_layout_document
from .model import DTYPE_SIZES, LayoutError, Layout, Region, Segment, canonical_dtype
from .select import select_layout

__all__ = [
    "DTYPE_SIZES",
    "SUPPORTED_MODEL_TYPES",
    "Layout",
    "LayoutError",
    "Region",
    "Segment",
    "canonical_dtype",
    "describe",
    "dump_layout_file",
    "layouts_from_hf_config",
    "load_hf_config",
    "load_layout_file",
    "parse_layout_document",
    "select_layout",
    "summarize",
]
