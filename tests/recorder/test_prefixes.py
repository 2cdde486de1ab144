"""The prefix recorder (issue #40 §3): per chunk hash, the digest of its boundary's last `window`
tokens, each hash once, a request's later hashes as its output adds them. (vLLM's scheduler hook
itself is exercised by the real-vLLM e2e, tests/e2e/test_binding_e2e.py.)"""

from __future__ import annotations

from types import SimpleNamespace

from audit.prefixrecords import PrefixDigest, prefix_digest
from audit.prefixtable import read_prefix_records
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


def test_a_kv_block_names_its_own_tokens_up_to_each_boundary(tmp_path):
    """Where layer 0 is attention, a hash names its KV block's tokens from the block's start to the
    boundary: the whole block at a block end, the filled part at a boundary inside it (a partial
    tail block, keyed there), and the block's start; a model with both windows records both on one line."""
    recorder = PrefixRecorder(RecordWriter(tmp_path, stem="prefixes"), window=None, hash_block_size=4,
                              kv_block_size=8)
    tokens = list(range(100, 116))  # boundaries 4, 8, 12, 16: blocks [100..107], [108..115]
    recorder.record("a", [_hash(i) for i in range(1, 5)], tokens)
    both = PrefixRecorder(RecordWriter(tmp_path / "both", stem="prefixes"), window=3, hash_block_size=4,
                          kv_block_size=4)
    both.record("b", [_hash(9)], tokens[:4])
    records = read_prefix_records([tmp_path])
    assert records.records == 5 and not records.conflicts and not records.skipped
    assert [records.get(_hash(i).hex(), "v") for i in range(1, 5)] == [
        PrefixDigest(4, prefix_digest(tokens[0:4]), 0), PrefixDigest(8, prefix_digest(tokens[0:8]), 0),
        PrefixDigest(4, prefix_digest(tokens[8:12]), 8), PrefixDigest(8, prefix_digest(tokens[8:16]), 8)]
    assert records.get(_hash(1).hex()) is None  # no conv window recorded
    assert records.get(_hash(9).hex()) == PrefixDigest(3, prefix_digest(tokens[1:4]))
    assert records.get(_hash(9).hex(), "v") == PrefixDigest(4, prefix_digest(tokens[0:4]), 0)


def test_a_hash_whose_windows_hold_supplied_embeddings_is_recorded_as_such_with_no_digest(tmp_path):
    """A multimodal item's placeholder positions (its `mm_position`; a request shaped as vLLM's, not
    one) are fed its encoder's embeddings: a hash whose conv window or KV block reaches one is
    recorded as `supplied`, the others as before; a request given prompt embeddings, all its prompt."""
    from audit.recorder.prefixes import supplied_positions

    item = SimpleNamespace(mm_position=SimpleNamespace(offset=5, length=4))  # positions 5..8
    request = SimpleNamespace(mm_features=[item], prompt_embeds=None, num_prompt_tokens=16)
    assert supplied_positions(request) == [(5, 9)]
    assert supplied_positions(SimpleNamespace(mm_features=[], prompt_embeds=object(), num_prompt_tokens=12)) == [(0, 12)]
    tokens = list(range(100, 116))  # boundaries 4, 8, 12, 16
    conv = PrefixRecorder(RecordWriter(tmp_path / "conv", stem="prefixes"), window=3, hash_block_size=4)
    conv.record("a", [_hash(i) for i in range(1, 5)], tokens, supplied_positions(request))
    kv = PrefixRecorder(RecordWriter(tmp_path / "kv", stem="prefixes"), window=None, hash_block_size=4, kv_block_size=8)
    kv.record("b", [_hash(i) for i in range(11, 15)], tokens, supplied_positions(request))
    records = read_prefix_records([tmp_path])
    assert records.records == 8 and not records.skipped and not records.conflicts
    # conv windows [1, 4), [5, 8), [9, 12), [13, 16): the second alone reaches positions 5..8
    assert [records.is_supplied(_hash(i).hex()) for i in range(1, 5)] == [False, True, False, False]
    assert records.get(_hash(1).hex()) == PrefixDigest(3, prefix_digest(tokens[1:4])) and records.get(_hash(2).hex()) is None
    # KV blocks [0, 4), [0, 8), [8, 12), [8, 16): all but the first reach them
    assert [records.is_supplied(_hash(i).hex()) for i in range(11, 15)] == [False, True, True, True]


def test_records_are_versioned_and_a_version_1_line_still_reads(tmp_path):
    """Version 1 (a conv window, no "v") reads as before; a version-2 line with both windows keeps
    its conv fields where a version-1 reader looks; a version this audit does not know, or a line
    naming no window, is passed over as malformed, never read as something else."""
    import json

    from audit.prefixrecords import parse_prefix_record, prefix_line

    assert prefix_line("ab", 3, [1, 2, 3]) == f'{{"hash":"ab","window":3,"digest":"{prefix_digest([1, 2, 3])}"}}'
    two = json.loads(prefix_line("cd", 3, [1, 2, 3], [0, 1, 2, 3]))
    assert two["v"] == 2 and (two["window"], two["digest"]) == (3, prefix_digest([1, 2, 3]))
    assert parse_prefix_record(two) == ("cd", PrefixDigest(3, prefix_digest([1, 2, 3])),
                                        PrefixDigest(4, prefix_digest([0, 1, 2, 3])), False)
    (tmp_path / "prefixes-h-1-0000.jsonl").write_text("\n".join([
        prefix_line("ab", 3, [1, 2, 3]), prefix_line("ef", None, None, [5, 6]),
        '{"v":3,"hash":"99","window":3,"digest":"x"}', '{"v":2,"hash":"98"}']) + "\n")
    records = read_prefix_records([tmp_path])
    assert records.get("ab") == PrefixDigest(3, prefix_digest([1, 2, 3])) and records.get("ab", "v") is None
    assert records.get("ef", "v") == PrefixDigest(2, prefix_digest([5, 6])) and records.skipped == 2
