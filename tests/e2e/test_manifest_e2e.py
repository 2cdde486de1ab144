"""The producer's manifest from a real vLLM (issue #19 §1), served two ways: with ``--dtype float32``
(the settings that made `--model-config` inference read float32 words as bfloat16 NaNs) and as
test_vllm_e2e.py's clean runs serve them (``auto``; NemotronH there in multi-process mode, so its
manifest comes from the worker process).

Each engine runs once, with the recorder on. The manifest it writes must give vLLM's own layout
(``tests/e2e/vllm_layouts.py``: state shapes, dtypes, offsets, padding, attention page, block size)
and the sizes of the values it published; a scan given the record directory (``--block-tables
DIR``, beside ``--model-config``) uses it: exit 0, no finding, and every ``layout_inference`` row
"from the producer's manifest".
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from audit.layouts.fingerprint import fingerprint
from audit.layouts.manifest import FROM_MANIFEST, read_manifests
from tests.e2e import harness
from tests.e2e.conftest import long_prompts, writer_prompts
from tests.e2e.models import MODELS
from tests.e2e.test_vllm_e2e import RUNNABLE, Produced, _produce, clean

FLOAT32_MODELS = ["llama-tiny", "nemotron-h-tiny", "falcon-h1-tiny", "lfm2-tiny"]
RUNS = [(model, "float32") for model in FLOAT32_MODELS] + [(model, "auto") for model in RUNNABLE]
VLLM_LAYOUTS = harness.REPO / "tests" / "e2e" / "vllm_layouts.py"


def served_float32(session, models_dir, model: str) -> Produced:
    batches = [writer_prompts()] if MODELS[model].family == "llama" else [long_prompts()]
    return _produce(session, models_dir, f"manifest-{model}", model, batches, dtype="float32", max_tokens=4)


def served(session, models_dir, model: str, way: str) -> tuple[Produced, str]:
    """The engine run, and the dtype it was served with (vLLM's ``--dtype``)."""
    if way == "float32":
        return served_float32(session, models_dir, model), "float32"
    return clean(session, models_dir, model), MODELS[model].serve_dtype or "auto"


def manifests_of(produced: Produced) -> list[dict]:
    paths = sorted(produced.record_dir.glob("manifest-*.json"))
    assert paths, f"the recorder wrote no manifest into {produced.record_dir}"
    return [json.loads(path.read_text()) for path in paths]


def vllm_reference(session, produced: Produced, dtype: str) -> dict:
    """vLLM's own layout of the model as served (no engine: its config and spec code only)."""
    key = f"vllm-layouts-{produced.name}"
    if key not in session.runs:
        argv = [sys.executable, str(VLLM_LAYOUTS), str(produced.model_dir), "--dtype", dtype]
        if MODELS[produced.model_dir.name].block_size:
            argv += ["--block-size", str(MODELS[produced.model_dir.name].block_size)]
        result = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=harness._clean_env(),
                                cwd=harness.REPO, check=True)
        session.runs[key] = json.loads(result.stdout)
    return session.runs[key]


@pytest.mark.parametrize("model,way", RUNS)
def test_the_manifest_gives_vllms_own_layout(session, models_dir, model, way, tmp_path):
    produced, dtype = served(session, models_dir, model, way)
    (manifest,) = manifests_of(produced)  # one worker process, one rank
    reference = vllm_reference(session, produced, dtype)
    session.observed[produced.name]["manifest"] = manifest
    assert (manifest["model"], manifest["tp_size"], manifest["tp_rank"], manifest["platform"]) == (model, 1, 0, "cpu")
    assert manifest["vllm_version"] == "0.32.0" and manifest["tenant"] == "default"
    # the checkpoint vLLM loaded, fingerprinted off vLLM's path (a tiny model: done before the engine stops)
    assert manifest["model_path"] == str(produced.model_dir.resolve())
    carried = manifest["fingerprint"]
    assert (carried["complete"], carried["algorithm"]) == (True, "xxh3_128"), carried
    assert carried["digest"] == fingerprint(produced.model_dir, tmp_path / "cache").digest
    for group in manifest["groups"]:
        assert group["block_size"] == reference["cache"]["block_size"], group
        assert all(segment["block_len"] == group["page_size"] for segment in group["segments"]), group
        if group["kind"] == "attention":
            attention = reference["attention"]
            assert group["page_size"] == attention["page_size_bytes"]
            assert group["attention"] == {"num_kv_heads": attention["num_kv_heads_per_rank"],
                                          "head_size": attention["head_size"],
                                          "head_size_v": attention["head_size"], "dtype": attention["dtype"]}
        else:
            mamba = reference["mamba"]
            assert group["page_size"] == mamba["page_size_bytes"]
            states = [{"name": r["region"], "dtype": r["dtype"], "shape": r["shape"], "offset": r["offset"],
                       "length": r["length"]} for r in mamba["regions"] if r["region"] != "padding"]
            assert group["states"] == states
            assert group["padding"]["length"] == mamba["page_size_bytes"] - mamba["state_bytes"]
    # and the sizes vLLM published: each group's keys are exactly its manifest layout's size
    layouts = {layout.group: layout for layout in read_manifests([produced.record_dir]).layouts}
    published = {}
    for key, size in produced.sizes.items():
        published.setdefault(harness.key_fields(key)["group"], set()).add(size)
    assert published and {group: {layouts[group].size} for group in published} == published


@pytest.mark.parametrize("model,way", RUNS)
def test_a_scan_with_the_manifest_is_clean_and_says_so(session, models_dir, model, way):
    produced, _ = served(session, models_dir, model, way)
    result = harness.scan(produced.config, produced.cluster, "--model-config", str(produced.model_dir),
                          "--block-tables", str(produced.record_dir))
    summary = (result.report or {}).get("summary", {})
    session.observed[produced.name]["audit_scan_with_manifest"] = {
        "exit_code": result.rc, "verdicts": summary.get("verdicts"), "layout_inference": summary.get("layout_inference")}
    assert result.report is not None, result.stderr[-500:]
    assert result.rc == 0, (result.stderr[-500:], summary.get("verdicts"))
    assert not [r for r in result.records if r["verdicts"]], [(r["key"], r["verdicts"]) for r in result.records
                                                              if r["verdicts"]][:3]
    rows = summary["layout_inference"]
    assert rows and {(row["status"], row["from"]) for row in rows} == {("from_manifest", FROM_MANIFEST)}
    assert all(row["manifest"].startswith(str(produced.record_dir)) for row in rows)
