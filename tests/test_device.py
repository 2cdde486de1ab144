"""`--device` / `--checker`: the choice, and a whole scan written identically by both checkers.

No GPU here: the Triton checker runs its kernel under the Triton interpreter on host memory
(the only fake in the suite; the GPU path itself is checked by benchmarks/gpu_check.py).
"""

from __future__ import annotations

import numpy as np
import pytest

from audit.device import resolve_placement
from audit.errors import AuditError
from audit.keys import vllm_key
from tests.helpers import scan_json
from tests.test_verdicts import LAYOUT, TINY_MAMBA, _value

VOLATILE = {"started_at", "finished_at", "duration_s", "bytes_per_s", "checker"}


def test_placement_defaults_and_refusals():
    assert resolve_placement("cpu") .checker_name == "numpy"
    assert resolve_placement("auto").device == "cpu"  # no GPU on this host
    assert resolve_placement("cpu", "triton").checker_name == "triton"
    with pytest.raises(AuditError, match="no CUDA GPU"):
        resolve_placement("cuda")
    with pytest.raises(AuditError, match="--device must be"):
        resolve_placement("tpu")
    with pytest.raises(AuditError, match="--checker must be"):
        resolve_placement("cpu", "cupy")


def test_numpy_and_triton_checkers_write_identical_reports(publisher, cli_args, namespace, tmp_path):
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
            "float32", "--all", "--device", "cpu"]
    _, by_numpy = scan_json(args, "--checker", "numpy")
    _, by_triton = scan_json(args, "--checker", "triton")
    assert by_numpy["summary"]["checker"] == "numpy" and by_triton["summary"]["checker"] == "triton"
    for document in (by_numpy, by_triton):
        for name in VOLATILE:
            document["summary"].pop(name)
    assert by_numpy == by_triton
    verdicts = sorted(tuple(r["verdicts"]) for r in by_numpy["keys"])
    assert verdicts == sorted([(), ("PARTIAL_ZERO",), ("NONFINITE",), ("ZERO_STATE",), ("SIZE_MISMATCH",),
                               ("SIZE_MISMATCH",)])
