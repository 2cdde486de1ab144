"""Shared test helpers: run the CLI in-process and read its JSON report."""

from __future__ import annotations

import json
from functools import lru_cache
from importlib import resources

import jsonschema
from typer.testing import CliRunner

from cli import app


@lru_cache
def gpu_host() -> bool:
    """A GPU this process can use, and the CUDA build of Mooncake (values read into GPU memory)."""
    from audit.run.device import _gpu_visible, _mooncake_has_cuda

    return _mooncake_has_cuda() and _gpu_visible()


def interpreted() -> bool:
    """Triton's kernels run under the interpreter, on host memory (tests/conftest.py: no GPU here)."""
    import os

    return os.environ.get("TRITON_INTERPRET") == "1"


@lru_cache
def report_schema() -> dict:
    return json.loads(resources.files("audit").joinpath("schemas/report.schema.json").read_text())


def run_cli(*args: str):
    return CliRunner().invoke(app, list(args), catch_exceptions=False)


def scan_json(cli_args: list[str], *extra: str) -> tuple[int, dict]:
    """Exit code and the validated JSON report of `mooncake-audit scan --format json`."""
    result = run_cli("scan", *cli_args, "--format", "json", "--no-progress", *extra)
    assert result.exit_code in (0, 1, 3), result.output
    document = json.loads(result.stdout)
    jsonschema.validate(document, report_schema())
    return result.exit_code, document


def by_key(document: dict) -> dict[str, dict]:
    return {record["key"]: record for record in document.get("keys", document["findings"])}


def check_in_buffer(values: dict[str, bytes], plan) -> dict:
    """`check_batch` over `values` laid out in one host buffer (64-byte aligned), as a scan with
    `plan` would check them once read: key -> its record."""
    from types import SimpleNamespace

    import numpy as np

    from audit.checks.host import HostChecker
    from audit.readers.buffers import FetchedBatch, Slot
    from audit.records import KeyInfo
    from audit.run.scan import check_batch

    offsets, blobs, offset = [], [], 0
    for value in values.values():
        offsets.append(offset)
        blobs.append(value + bytes(-len(value) % 64))
        offset += len(blobs[-1])
    buffer = SimpleNamespace(array=np.frombuffer(b"".join(blobs), dtype=np.uint8).copy())
    slots = [Slot(KeyInfo(name, len(value)), at) for (name, value), at in zip(values.items(), offsets)]
    batch = FetchedBatch(slots, [len(value) for value in values.values()], buffer)
    return {record.key: record for record in check_batch(batch, HostChecker(), plan)}


def write_safetensors(path, tensors: dict, bfloat16: bool = False) -> None:
    """A safetensors file of float32 numpy `tensors` (as BF16, their upper halves, with `bfloat16`)."""
    import struct

    import numpy as np

    header, chunks, offset = {}, [], 0
    for name, array in tensors.items():
        array = np.ascontiguousarray(array, dtype=np.float32)
        data = (array.view(np.uint32) >> 16).astype(np.uint16).tobytes() if bfloat16 else array.tobytes()
        header[name] = {"dtype": "BF16" if bfloat16 else "F32", "shape": list(array.shape),
                        "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    encoded = json.dumps(header).encode()
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(encoded)) + encoded + b"".join(chunks))


# A Mamba2 small enough to compute by hand: d_inner 16, conv_dim 16 + 2 * n_groups * 4, 4 heads.
TINY_MAMBA2_CONFIG = {"model_type": "mamba2", "architectures": ["Mamba2ForCausalLM"], "hidden_size": 8, "expand": 2,
                      "n_groups": 1, "state_size": 4, "num_heads": 4, "head_dim": 4, "conv_kernel": 4,
                      "num_hidden_layers": 2, "vocab_size": 32, "layer_norm_epsilon": 1e-5, "torch_dtype": "float32"}


def tiny_mamba2_checkpoint(directory, seed: int = 0, bfloat16: bool = False, **config) -> dict:
    """A Mamba2 model directory (config.json and model.safetensors with layer 0's tensors) of random
    weights; returns its tensors."""
    import numpy as np

    config = {**TINY_MAMBA2_CONFIG, **config}
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(seed)
    hidden, inner = config["hidden_size"], config["expand"] * config["hidden_size"]
    rows = 2 * inner + 2 * config["n_groups"] * config["state_size"] + config["num_heads"]
    tensors = {"backbone.embeddings.weight": rng.standard_normal((config["vocab_size"], hidden)).astype(np.float32),
               "backbone.layers.0.norm.weight": (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32),
               "backbone.layers.0.mixer.in_proj.weight": rng.standard_normal((rows, hidden)).astype(np.float32)}
    write_safetensors(directory / "model.safetensors", tensors, bfloat16=bfloat16)
    return tensors
