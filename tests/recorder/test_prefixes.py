"""The prefix recorder (issue #40 §3): per chunk hash, the digest of its boundary's last `window`
tokens, each hash once, a request's later hashes as its output adds them. (vLLM's scheduler hook
itself is exercised by the real-vLLM e2e, tests/e2e/test_binding_e2e.py.)"""

from __future__ import annotations

from types import SimpleNamespace

from audit.prefixrecords import PrefixDigest, prefix_digest, read_prefix_records
from audit.recorder.prefixes import PrefixRecorder, conv_window
from audit.recorder.records import RecordWriter


def _hash(i: int) -> bytes:
    return bytes([i]) * 32


def test_each_hash_names_its_boundarys_last_tokens_once(tmp_path):
    recorder = PrefixRecorder(RecordWriter(tmp_path, stem="prefixes"), window=3, hash_block_size=4)
    tokens = list(range(100, 111))  # 11 tokens: boundaries at 4 and 8
    recorder.record("a", [_hash(1), _hash(2)], tokens)
    recorder.record("b", [_hash(1)], tokens[:4])          # a shared prefix: written once
    tokens += [111, 112]                                   # output fills the third block
    recorder.record("a", [_hash(1), _hash(2), _hash(3)], tokens)
    recorder.record("c", [_hash(4)], [1, 2])               # a hash past the tokens it was given: not written
    records = read_prefix_records([tmp_path])
    assert records.records == 3 and not records.conflicts
    assert records.get(_hash(1).hex()) == PrefixDigest(3, prefix_digest([101, 102, 103]))
    assert records.get(_hash(2).hex()) == PrefixDigest(3, prefix_digest([105, 106, 107]))
    assert records.get(_hash(3).hex()) == PrefixDigest(3, prefix_digest([109, 110, 111]))
    assert records.get(_hash(4).hex()) is None


def test_the_window_is_the_conv_kernel_less_one_whatever_the_family_calls_it():
    assert conv_window(SimpleNamespace(conv_kernel=4)) == 3                     # Mamba2, Nemotron-H
    assert conv_window(SimpleNamespace(mamba_d_conv=4)) == 3                    # Granite, Zamba2, Falcon-H1
    assert conv_window(SimpleNamespace(linear_conv_kernel_dim=4)) == 3          # Qwen3-Next / 3.5
    assert conv_window(SimpleNamespace(conv_L_cache=3)) == 2                    # LFM2
    assert conv_window(SimpleNamespace(num_attention_heads=8)) is None          # attention alone
