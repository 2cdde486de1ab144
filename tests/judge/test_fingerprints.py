"""WEIGHTS_MISMATCH from the producer's manifest (issue #40 §2): keys put by a producer whose
checkpoint fingerprint is not the given directory's are flagged even where layer 0 binds; the same
fingerprint, or none, claims nothing."""

from __future__ import annotations

import json
import socket
import time

import numpy as np
import pytest

from audit.blocktables import read_block_tables
from audit.judge.fingerprints import NO_FINGERPRINT, OTHER, SAME, ProducerWeights
from audit.layouts.fingerprint import fingerprint
from audit.layouts.manifest import read_manifest, read_manifests
from audit.layouts.weights import token_images
from audit.producers.vllm import vllm_key
from audit.recorder.blocks import KeyBlocks
from audit.recorder.manifest import (
    describe_worker,
    fingerprint_in_background,
    pending_fingerprint,
    write_manifest,
)
from audit.recorder.records import key_lines
from audit.records import KeyRecord, Verdict
from tests.helpers import (
    TINY_MAMBA2_CONFIG,
    run_cli,
    scan_json,
    tiny_mamba2_checkpoint,
    write_safetensors,
)
from tests.recorder import fake_vllm

MODEL = "m-tiny"
HOST = socket.gethostname()  # describe_worker's, as in every manifest's name


@pytest.fixture(autouse=True)
def producer_side(monkeypatch, tmp_path):
    fake_vllm.install_fake_vllm(monkeypatch)
    monkeypatch.setenv("MOONCAKE_AUDIT_CACHE", str(tmp_path / "cache"))


def _checkpoints(tmp_path):
    """Ours and another with the same layer 0 (so every state binds under both) and one byte of
    layer 1 changed: only the fingerprint tells them apart."""
    ours, other = tmp_path / "ours" / MODEL, tmp_path / "other" / MODEL
    tensors = tiny_mamba2_checkpoint(ours)
    tiny_mamba2_checkpoint(other)
    layer1 = np.random.default_rng(3).standard_normal((8, 16)).astype(np.float32)
    write_safetensors(ours / "model.safetensors", {**tensors, "backbone.layers.1.mixer.out_proj.weight": layer1})
    layer1[0, 0] = np.nextafter(layer1[0, 0], np.float32(1))
    write_safetensors(other / "model.safetensors", {**tensors, "backbone.layers.1.mixer.out_proj.weight": layer1})
    return ours, other


def _manifest(records, pid: int, model_dir, fingerprinted: str = "on"):
    """The manifest a recorder in process `pid` wrote after loading `model_dir`: its fingerprint
    computed by the recorder's own thread ("on"), turned off ("off"), or not there at all ("absent",
    an older recorder)."""
    conv, ssm = (3, 24), (4, 4, 4)  # the tiny Mamba2's states, float32
    spec = fake_vllm.MambaSpec(block_size=16, shapes=(conv, ssm), dtypes=(fake_vllm.FLOAT32, fake_vllm.FLOAT32))
    layers = ["backbone.layers.0.mixer", "backbone.layers.1.mixer"]
    document = describe_worker(*fake_vllm.build_worker(MODEL, [(layers, spec)], [[layer] for layer in layers]))
    document.update(pid=pid, model_path=str(model_dir))
    if fingerprinted == "absent":
        return write_manifest(records, document)
    document["fingerprint"] = pending_fingerprint(str(model_dir))
    if fingerprinted == "off":
        document["fingerprint"]["note"] = "MOONCAKE_AUDIT_FINGERPRINT=off"
        return write_manifest(records, document)
    write_manifest(records, document)
    fingerprint_in_background(records, document).join(timeout=60)
    return records / f"manifest-{HOST}-{pid}.json"


def _puts(records, pid: int, keys, at: float | None = None) -> None:
    """The recorder's put records of `keys` by process `pid` (stored, blocks 5 and 6)."""
    lines = key_lines(keys, [KeyBlocks(2, [5, 6])] * len(keys), [0] * len(keys), [[544, 544]] * len(keys), set(),
                      time.time() if at is None else at, pid)
    with open(records / f"blocks-{HOST}-{pid}-0000.jsonl", "a") as out:
        out.write("".join(line + "\n" for line in lines))


def _value(layout, conv_rows, rng) -> bytes:
    value = bytearray()
    for segment, region in layout.regions():
        numbers = conv_rows if (segment.layer, region.name) == (0, "conv") else rng.standard_normal(region.shape)
        value += np.asarray(numbers, dtype=np.float32).tobytes()
    assert len(value) == layout.size
    return bytes(value)


def test_keys_of_a_producer_with_other_weights_are_flagged_where_layer_0_binds(publisher, cli_args, namespace,
                                                                              tmp_path, monkeypatch):
    ours, other = _checkpoints(tmp_path)
    records = tmp_path / "records"
    manifests = {"other": _manifest(records, 101, other), "same": _manifest(records, 102, ours),
                 "off": _manifest(records, 103, ours, "off"), "older": _manifest(records, 104, other, "absent")}
    (layout,) = read_manifest(manifests["same"]).layouts
    images, rng = token_images(ours, MODEL, 1, 0), np.random.default_rng(11)
    keys = {}
    for index, (producer, pid) in enumerate([("other", 101), ("same", 102), ("off", 103), ("older", 104),
                                             ("unrecorded", None)]):
        keys[producer] = [vllm_key(MODEL, f"{10 * index + i:064x}", cache_prefix=namespace[:-1]) for i in range(2)]
        for key in keys[producer]:
            publisher.put(key, _value(layout, images.images(rng.integers(0, TINY_MAMBA2_CONFIG["vocab_size"], 3)),
                                      rng))
        if pid is not None:
            _puts(records, pid, keys[producer])
    mine, theirs = fingerprint(ours).digest, fingerprint(other).digest
    assert mine != theirs

    code, document = scan_json(cli_args, "--prefix", namespace[:-1] + "@", "--model-config", str(ours),
                               "--block-tables", str(records))
    flagged = {record["key"]: record for record in document["findings"]}
    assert code == 1 and set(flagged) == set(keys["other"])
    for record in flagged.values():
        assert record["verdicts"] == ["WEIGHTS_MISMATCH"] and "weights_mismatch" not in record["evidence"]
        assert record["evidence"]["weights_fingerprint"] == {
            "producer_fingerprint": theirs, "checkpoint_fingerprint": mine, "manifest": str(manifests["other"]),
            "producer": f"{HOST}-101", "same_architecture": True}
    binding = document["summary"]["binding"]
    assert binding["bound"] == [MODEL] and binding["not_bound"] == {}
    assert {row["producer"]: row["status"] for row in binding["fingerprints"]} == {
        f"{HOST}-101": OTHER, f"{HOST}-102": SAME,
        f"{HOST}-103": "fingerprint not complete (MOONCAKE_AUDIT_FINGERPRINT=off): nothing claimed",
        f"{HOST}-104": NO_FINGERPRINT}

    human = run_cli("scan", *cli_args, "--prefix", namespace[:-1] + "@", "--model-config", str(ours),
                    "--block-tables", str(records), "--no-progress")
    assert "; producers' checkpoints: 2 nothing claimed, 1 other weights, 1 same weights" in human.stdout, human.stdout

    # the other checkpoint given: the other producer's keys are its own, ours are not
    code, document = scan_json(cli_args, "--prefix", namespace[:-1] + "@", "--model-config", str(other),
                               "--block-tables", str(records))
    assert code == 1 and {record["key"] for record in document["findings"]} == set(keys["same"])

    monkeypatch.setenv("MOONCAKE_AUDIT_FINGERPRINT", "off")
    code, document = scan_json(cli_args, "--prefix", namespace[:-1] + "@", "--model-config", str(ours),
                               "--block-tables", str(records))
    assert code == 0 and document["findings"] == []
    assert [row["status"] for row in document["summary"]["binding"]["fingerprints"]][:2] == [
        "MOONCAKE_AUDIT_FINGERPRINT=off: not compared"] * 2


def test_only_the_put_whose_bytes_the_store_kept_names_the_producer(tmp_path):
    """Mooncake keeps a key's first copy: a later put by a producer with other weights changed
    nothing. A put older than its producer's manifest was another process under the same pid."""
    ours, other = _checkpoints(tmp_path)
    records = tmp_path / "records"
    _manifest(records, 101, other)
    _manifest(records, 102, ours)
    _puts(records, 102, ["first-ours"])
    _puts(records, 101, ["first-ours", "theirs"])
    _puts(records, 101, ["before-their-manifest"], at=1.0)
    weights = ProducerWeights.compare(read_manifests([records]), {MODEL: ours})
    tables = read_block_tables([records])
    keyed = [KeyRecord(key, 16, None) for key in ("first-ours", "theirs", "before-their-manifest", "unrecorded")]
    weights.flag(keyed, tables)
    assert [record.verdicts for record in keyed] == [[], [Verdict.WEIGHTS_MISMATCH], [], []]
    assert keyed[1].evidence["weights_fingerprint"]["producer"] == f"{HOST}-101"


def test_another_algorithm_or_an_unreadable_checkpoint_claims_nothing(tmp_path):
    ours, other = _checkpoints(tmp_path)
    records = tmp_path / "records"
    path = _manifest(records, 101, other)
    document = json.loads(path.read_text())
    document["fingerprint"]["algorithm"] = "sha256"
    path.write_text(json.dumps(document))
    weights = ProducerWeights.compare(read_manifests([records]), {MODEL: ours})
    assert weights.other == {} and weights.rows[0]["status"] == "fingerprint by 'sha256', not 'xxh3_128': not compared"

    document["fingerprint"]["algorithm"] = "xxh3_128"
    path.write_text(json.dumps(document))
    (ours / "model.safetensors").unlink()
    weights = ProducerWeights.compare(read_manifests([records]), {MODEL: ours})
    assert weights.other == {}
    assert weights.rows[0]["status"] == f"cannot fingerprint {ours}: {ours}: no weight files to fingerprint"
