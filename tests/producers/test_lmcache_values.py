"""LMCache's header and checksum frame, read from the bytes its own code makes (lmcache_0_5_6.json)."""

import numpy as np
import pytest

from audit.producers import parse_key, read_value
from audit.producers.lmcache.header import read_header
from tests.producers.writers import (GOLDEN, KV_T2D, checksum_frame, header_bytes, kv_chunk, lmcache_key,
                                     lmcache_value, object_key)

KEY = lmcache_key("Qwen/Qwen3-0.6B", 1, 0, 0x1234, "float")


def reading(key: str, value: bytes):
    found = read_value(key, np.frombuffer(value, dtype=np.uint8))
    return None if found is None else found[1]


@pytest.mark.parametrize("name, groups, fmt", [
    ("kv_2ltd_float32", [("float32", (2, 2, 256, 64))], 1),
    ("mla", [("bfloat16", (1, 3, 256, 576))], 6),
    ("t2d_layer", [("float16", (256, 2, 64))], 2),
    ("two_groups", [("bfloat16", (2, 2, 256, 64)), ("float32", (2, 1, 256, 128))], 1),
])
def test_lmcaches_own_headers_decode(name, groups, fmt):
    header = bytes.fromhex(GOLDEN["headers"][name]["hex"])
    length = int.from_bytes(header[:4], "little")
    decoded = read_header(header + bytes(64), len(header) + length)
    assert decoded.fmt == fmt and decoded.nbytes == len(header) == 8 + 20 * len(groups)
    assert [(group.dtype, group.shape) for group in decoded.groups] == groups


def test_a_clean_value_gets_one_region_per_layer_and_half():
    value = lmcache_value(kv_chunk(np.random.default_rng(0)))
    assert len(value) == 262_172  # measured on a real LMCache run: 28 + 262,144
    found = reading(KEY, value)
    assert found.disagreements == ()
    regions = [(segment.name, region.kind, region.offset, region.length) for segment, region in found.layout.regions()]
    assert regions == [("header", "header", 0, 28), ("k.layers.0", "kv", 28, 65536), ("k.layers.1", "kv", 65564, 65536),
                       ("v.layers.0", "kv", 131100, 65536), ("v.layers.1", "kv", 196636, 65536)]
    assert found.decoded["header"] == {"format": "KV_2LTD", "length": 262144, "header_bytes": 28,
                                       "groups": [{"dtype": "float32", "shape": [2, 2, 256, 64]}]}


def test_a_truncated_value_and_a_wrong_length_disagree_with_the_size():
    value = lmcache_value(kv_chunk(np.random.default_rng(1)))
    truncated = reading(KEY, value[:-4096])
    assert [d.kind for d in truncated.disagreements] == ["size"] and truncated.layout is None
    assert truncated.disagreements[0].evidence == {"value_size": 258076, "header_bytes": 28, "header_length": 262144,
                                                   "shape_bytes": 262144, "expected_size": 262172}
    wrong_length = reading(KEY, (262144 + 64).to_bytes(4, "little") + value[4:])
    assert [d.kind for d in wrong_length.disagreements] == ["size"]
    assert wrong_length.disagreements[0].evidence["header_length"] == 262208


def test_a_header_dtype_other_than_the_keys_is_an_identity_disagreement():
    value = lmcache_value(kv_chunk(np.random.default_rng(2)))
    found = reading(lmcache_key("m", 1, 0, 0x12, "bfloat16"), value)
    assert [(d.kind, d.evidence) for d in found.disagreements] == [
        ("identity", {"key_dtype": "bfloat16", "header_dtypes": ["float32"]})]
    assert found.layout is not None  # the KV is still checked, as the header (LMCache's reader) says


def test_a_layerwise_value_is_one_layer():
    kv = np.random.default_rng(3).normal(size=(256, 2, 64)).astype(np.float16)
    value = header_bytes(kv.nbytes, KV_T2D, [(2, kv.shape)]) + kv.tobytes()
    found = reading(lmcache_key("m", 1, 0, 0x12, "half", layer=5), value)
    assert [(s.name, s.layer, r.shape) for s, r in found.layout.regions()][1:] == [("kv.layers.5", 5, (256, 2, 64))]


def test_values_without_a_header_say_nothing():
    kv = kv_chunk(np.random.default_rng(4))
    assert reading(KEY, lmcache_value(kv, header=False)) is None
    assert reading(KEY, bytes(262_172)) is None  # all zeros: no format, no header


def test_hostile_headers_are_data():
    for head in (b"\xff" * 28, header_bytes(-5, 1, [(4, (2, 2, 256, 64))]), header_bytes(10, 1, [(4, (-1, 2, 3, 4))]),
                 header_bytes(2**31 - 1, 1, [(99, (1,))]), b"\x01\x00\x00\x00" * 7):
        found = reading(KEY, head + bytes(100))
        assert found is None or found.layout is None and found.disagreements


CHUNK = bytes.fromhex("0123456789abcdef0011")
OBJECT_KEY = object_key("Qwen/Qwen3-0.6B", CHUNK, world_size=2, worker_id=1, local_world_size=2, local_rank=1)


def test_object_keys_parse():
    assert OBJECT_KEY == "Qwen/Qwen3-0.6B@02010201@0@0123456789abcdef0011"  # LMCache 0.5.6's _object_key_to_string
    assert parse_key(OBJECT_KEY) == {
        "scheme": "lmcache", "model": "Qwen/Qwen3-0.6B", "kv_rank": "02010201", "object_group": 0,
        "chunk_hash": "0123456789abcdef0011", "world_size": 2, "worker_id": 1, "local_world_size": 2, "local_rank": 1}


def test_a_checksum_frame_is_verified():
    payload = kv_chunk(np.random.default_rng(5)).tobytes()
    frame = checksum_frame(payload, CHUNK)
    clean = reading(OBJECT_KEY, frame)
    assert clean.disagreements == () and clean.decoded["checksum_frame"]["fingerprint"] == "0123456789abcdef"
    assert [(r.name, r.kind, r.length) for _, r in clean.layout.regions()] == [("frame", "header", 17),
                                                                              ("payload", "kv", len(payload))]
    flipped = bytearray(frame)
    flipped[1000] ^= 1
    corrupt = reading(OBJECT_KEY, bytes(flipped))
    assert [d.kind for d in corrupt.disagreements] == ["checksum"]
    misplaced = reading(object_key("Qwen/Qwen3-0.6B", b"\xaa" * 10, world_size=2, worker_id=1,
                                   local_world_size=2, local_rank=1), frame)
    assert [(d.kind, d.evidence) for d in misplaced.disagreements] == [
        ("identity", {"frame_fingerprint": "0123456789abcdef", "key_fingerprint": "aaaaaaaaaaaaaaaa"})]


def test_raw_payloads_are_no_frames():
    payload = b"\x01" + kv_chunk(np.random.default_rng(6)).tobytes()  # starts with the version byte, by chance
    assert reading(OBJECT_KEY, payload) is None
