"""Which layer-0 image rule a model directory gets: its config's family, fed its checkpoint."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from .checkpoint import Checkpoint
from .families import family_of
from .hf_config import encoder_inputs, load_hf_config, read_config
from .images import TokenImages
from .model import LayoutError


def token_images(directory: Path, model: str, tp_size: int, tp_rank: int) -> TokenImages:
    """The token images of a model directory's checkpoint for one TP rank, or a LayoutError saying
    why it is not bound (no weights, a family with no image rule yet, quantized weights); a model
    taking an encoder's embeddings says so (`TokenImages.encoder_inputs`)."""
    config = read_config(load_hf_config(directory))
    family = family_of(config)
    if family.token_images is None:
        why = family.no_token_rows or "no layer-0 image rule yet"
        raise LayoutError(f"model_type {config.model_type!r}: {why} (not bound)")
    if not Checkpoint.found(directory):
        raise LayoutError(f"{directory}: no safetensors weights (not bound)")
    images = family.token_images(config.text, Checkpoint(directory), model, tp_size, tp_rank)
    encoders = encoder_inputs(config.config)
    return replace(images, encoder_inputs=encoders) if encoders else images
