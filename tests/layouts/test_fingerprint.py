"""A checkpoint's fingerprint (issue #40 §2): every byte of the weights, resharding and file times
aside; each file hashed once and then read from the cache."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import xxhash

from audit.layouts import fingerprint as fingerprint_module
from audit.layouts.fingerprint import (
    ALGORITHM,
    fingerprint,
    fingerprint_enabled,
    weight_files,
)
from audit.layouts.model import LayoutError
from tests.helpers import write_safetensors


def _tensors(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {"embed.weight": rng.standard_normal((32, 8)), "layers.0.norm.weight": rng.standard_normal(8),
            "layers.1.proj.weight": rng.standard_normal((16, 8))}


@pytest.fixture
def model(tmp_path):
    directory = tmp_path / "model"
    directory.mkdir()
    write_safetensors(directory / "model.safetensors", _tensors())
    return directory


def test_one_changed_tensor_byte_changes_the_digest_not_the_header(model, tmp_path):
    before = fingerprint(model, tmp_path / "cache")
    path = model / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 1  # the last byte of the last tensor
    path.write_bytes(bytes(data))

    after = fingerprint(model, tmp_path / "cache")
    assert before.algorithm == after.algorithm == ALGORITHM
    assert len(before.digest) == 32 and after.digest != before.digest
    assert after.header == before.header  # same names, dtypes and shapes: same architecture, other weights
    assert (after.files, after.bytes) == (1, path.stat().st_size)


def test_the_digest_covers_each_tensor_by_name_dtype_shape_and_bytes(model, tmp_path):
    """Recomputed by hand: one line per tensor, sorted by name, then xxh3_128 of the lines."""
    tensors = {name: np.ascontiguousarray(array, dtype=np.float32) for name, array in _tensors().items()}
    lines = sorted(f"tensor {name} F32 {'x'.join(map(str, array.shape))} {xxhash.xxh3_128(array.tobytes()).hexdigest()}"
                   for name, array in tensors.items())
    expected = xxhash.xxh3_128("\n".join(lines).encode()).hexdigest()
    assert fingerprint(model, tmp_path / "cache").digest == expected


def test_resharded_tensors_give_the_same_digest_other_architectures_another_header(model, tmp_path):
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    tensors = _tensors()
    names = list(tensors)
    write_safetensors(sharded / "a.safetensors", {name: tensors[name] for name in names[:2]})
    write_safetensors(sharded / "b.safetensors", {name: tensors[name] for name in names[2:]})
    (sharded / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {**dict.fromkeys(names[:2], "a.safetensors"), names[2]: "b.safetensors"}}))
    (sharded / "stray.safetensors").write_bytes(b"not in the index")

    assert [path.name for path in weight_files(sharded)] == ["a.safetensors", "b.safetensors"]
    one, two = fingerprint(model, tmp_path / "cache"), fingerprint(sharded, tmp_path / "cache")
    assert (two.digest, two.header, two.files) == (one.digest, one.header, 2)

    wider = tmp_path / "wider"
    wider.mkdir()
    write_safetensors(wider / "model.safetensors", {**tensors, "embed.weight": np.zeros((33, 8))})
    assert fingerprint(wider, tmp_path / "cache").header != one.header


def test_other_weight_files_are_hashed_whole(tmp_path):
    directory = tmp_path / "bin"
    directory.mkdir()
    content = b"\x01" * 1000
    (directory / "pytorch_model.bin").write_bytes(content)
    (directory / "training_args.bin").write_bytes(b"not weights: vLLM leaves it out")
    found = fingerprint(directory, tmp_path / "cache")
    line = f"file pytorch_model.bin 1000 {xxhash.xxh3_128(content).hexdigest()}"
    assert found.digest == xxhash.xxh3_128(line.encode()).hexdigest() and found.header is None

    with pytest.raises(LayoutError, match="no weight files"):
        fingerprint(tmp_path / "cache", tmp_path / "cache")


def test_the_cache_answers_until_a_file_changes_and_a_new_mtime_rehashes_to_the_same_digest(model, tmp_path,
                                                                                            monkeypatch):
    opened = []
    real_open = open

    def counting_open(path, *args, **kwargs):  # the real open, counted for the weight file
        if str(path).endswith("model.safetensors"):
            opened.append(path)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(fingerprint_module, "open", counting_open, raising=False)
    cache = tmp_path / "cache"
    first = fingerprint(model, cache)
    assert (first.hashed_files, first.hashed_bytes, len(opened)) == (1, first.bytes, 1)

    second = fingerprint(model, cache)
    assert (second.digest, second.hashed_files, second.hashed_bytes, len(opened)) == (first.digest, 0, 0, 1)

    path = model / "model.safetensors"
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # touched, not changed
    third = fingerprint(model, cache)
    assert (third.digest, third.hashed_files, len(opened)) == (first.digest, 1, 2)


def test_a_cache_that_cannot_be_written_only_costs_a_rehash(model, tmp_path):
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the cache directory would be")
    assert fingerprint(model, blocked).digest == fingerprint(model, tmp_path / "cache").digest
    assert fingerprint(model, blocked).hashed_files == 1


def test_the_operator_turns_it_off_and_a_typo_is_an_error():
    assert fingerprint_enabled({}) and fingerprint_enabled({"MOONCAKE_AUDIT_FINGERPRINT": "on"})
    assert not fingerprint_enabled({"MOONCAKE_AUDIT_FINGERPRINT": "off"})
    with pytest.raises(ValueError, match="expected on or off"):
        fingerprint_enabled({"MOONCAKE_AUDIT_FINGERPRINT": "maybe"})


def test_a_truncated_file_is_an_error_not_a_digest(model, tmp_path):
    path = model / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-4])
    with pytest.raises(LayoutError, match="ends at data byte"):
        fingerprint(model, tmp_path / "cache")
