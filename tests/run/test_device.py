"""`--device` / `--checker`: the choice, and a whole scan written identically by both checkers.

Each test pins the device it tests. On a host without a GPU the Triton checker runs its kernel
under the Triton interpreter on host memory (the only fake in the suite); on a GPU host the same
comparison also runs with values read into GPU memory.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from audit.run.device import _mooncake_has_cuda, resolve_placement
from audit.errors import AuditError
from audit.keys import vllm_key
from tests.helpers import gpu_host, interpreted, scan_json
from tests.judge.test_verdicts import LAYOUT, TINY_MAMBA, _value

VOLATILE = {"started_at", "finished_at", "duration_s", "bytes_per_s", "checker"}


GPU_HOST = gpu_host()
INTERPRETED = interpreted()


def test_placement_defaults_and_refusals():
    assert resolve_placement("cpu").checker_name == "numpy"
    assert resolve_placement("cpu", "triton").checker_name == "triton"
    assert resolve_placement("auto") == (resolve_placement("cuda") if GPU_HOST else resolve_placement("cpu"))
    # peek reads land in host memory: auto follows them there, on every host; cuda is a contradiction
    assert resolve_placement("auto", read_mode="peek") == resolve_placement("cpu")
    with pytest.raises(AuditError, match="--read-mode peek reads into host memory"):
        resolve_placement("cuda", read_mode="peek")
    with pytest.raises(AuditError, match="--device must be"):
        resolve_placement("tpu")
    with pytest.raises(AuditError, match="--checker must be"):
        resolve_placement("cpu", "cupy")


@pytest.mark.skipif(GPU_HOST, reason="pins a host without a GPU")
def test_cuda_is_refused_where_there_is_none():
    with pytest.raises(AuditError, match="no CUDA GPU|CUDA build of the Mooncake client"):
        resolve_placement("cuda")


@pytest.mark.skipif(_mooncake_has_cuda(), reason="pins a host with the non-CUDA Mooncake client")
def test_auto_placement_never_imports_torch_where_the_client_cannot_use_a_gpu():
    code = "import sys; from audit.run.device import resolve_placement; resolve_placement('auto'); print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          cwd=os.path.dirname(os.path.dirname(__file__)))
    assert done.stdout.strip() == "False"


@pytest.mark.parametrize("device", [
    pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRETED, reason="Triton on host memory needs TRITON_INTERPRET=1")),
    pytest.param("cuda", marks=pytest.mark.skipif(not GPU_HOST or INTERPRETED, reason="pins a GPU host, compiled kernels")),
])
def test_numpy_and_triton_checkers_write_identical_reports(publisher, cli_args, namespace, tmp_path, device):
    import json

    rng = np.random.default_rng(9)
    good, partial = _value(rng), _value(rng)
    partial[: LAYOUT.segments[0].length] = 0
    nan = _value(rng)
    nan[LAYOUT.segments[1].offset + 384: LAYOUT.segments[1].offset + 388] = np.array([0x7FC00000], np.uint32).view(np.uint8)
    values = {"good": good, "partial": partial, "nan": nan, "zero": np.zeros(LAYOUT.size, np.uint8),
              "odd-size": rng.integers(0, 255, 1001, dtype=np.uint8), "short": np.full(100, 3, np.uint8)}
    for name, value in values.items():
        publisher.put(vllm_key("tiny-mamba", name.encode().hex(), cache_prefix=namespace.rstrip("/")), value)
    model_dir = tmp_path / "tiny-mamba"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(TINY_MAMBA))
    args = [*cli_args, "--prefix", namespace.rstrip("/"), "--model-config", str(model_dir), "--ssm-dtype",
            "float32", "--all"]
    _, by_numpy = scan_json(args, "--device", "cpu", "--checker", "numpy")
    _, by_triton = scan_json(args, "--device", device, "--checker", "triton")
    assert by_numpy["summary"]["checker"] == "numpy" and by_triton["summary"]["checker"] == "triton"
    for document in (by_numpy, by_triton):
        for name in VOLATILE | {"device"}:
            document["summary"].pop(name)
    assert by_numpy == by_triton
    verdicts = sorted(tuple(r["verdicts"]) for r in by_numpy["keys"])
    assert verdicts == sorted([(), ("PARTIAL_ZERO",), ("NONFINITE",), ("ZERO_STATE",), ("SIZE_MISMATCH",),
                               ("SIZE_MISMATCH",)])


@pytest.mark.skipif(not GPU_HOST or INTERPRETED, reason="pins a GPU host: values read into GPU memory")
def test_binding_of_values_in_gpu_memory_writes_the_host_reports(publisher, cli_args, namespace, tmp_path):
    """Layer-0 binding (`--model-config` with the checkpoint) of a scan into GPU memory, whose conv
    rows are gathered on the GPU and copied to the host once a batch: the report of a scan into host
    memory, a key of other weights and garbage flagged as WEIGHTS_MISMATCH alike."""
    from audit.judge.plan import load_layouts
    from audit.layouts.weights import token_images
    from tests.helpers import tiny_mamba2_checkpoint
    from tests.judge.test_binding import MODEL, _value as state_value

    ours, theirs = tmp_path / MODEL, tmp_path / "other" / MODEL
    tiny_mamba2_checkpoint(ours, seed=0)
    tiny_mamba2_checkpoint(theirs, seed=1)
    (layout,) = load_layouts(model_configs=[ours], state_dtype="float32", ssm_dtype="float32")
    mine = token_images(ours, MODEL, 1, 0)
    rng = np.random.default_rng(3)
    rows = [mine.images(rng.integers(0, 32, 3)) for _ in range(40)]
    rows += [token_images(theirs, MODEL, 1, 0).images([1, 2, 3]), rng.standard_normal((3, 24))]
    for i, conv in enumerate(rows):
        publisher.put(vllm_key(MODEL, f"{i:064x}", cache_prefix=namespace.rstrip("/")), state_value(layout, conv, rng))
    args = [*cli_args, "--prefix", namespace.rstrip("/") + "@", "--model-config", str(ours), "--state-dtype",
            "float32", "--ssm-dtype", "float32", "--all"]
    _, on_host = scan_json(args, "--device", "cpu")
    _, on_gpu = scan_json(args, "--device", "cuda")
    assert on_gpu["summary"]["device"] == "cuda"
    for document in (on_host, on_gpu):
        for name in VOLATILE | {"device"}:
            document["summary"].pop(name)
    assert on_host == on_gpu
    assert sorted(r["key"][-2:] for r in on_gpu["findings"]) == [f"{40:02x}", f"{41:02x}"]
    assert on_gpu["summary"]["binding"]["keys_decoded"] == {MODEL: 42}
