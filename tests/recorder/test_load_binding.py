"""The load guard binds loaded states at layer 0 (issue #40 §4): a state of other weights is refused
as WEIGHTS_MISMATCH, one of other tokens than the consumer's own request recorded for the key's
hash as PREFIX_MISMATCH; a healthy one, and one without a record, are kept; nothing is bound until
the token images are ready. The values lie in host memory as a consumer's KV pages do (the guard
reads them through their addresses); the real consumer is tests/e2e/test_consumer.py's."""

from __future__ import annotations

import numpy as np
import pytest

from audit.keys import vllm_key
from audit.layouts.weights import token_images
from audit.prefixrecords import prefix_line
from audit.recorder.binding import StateBinder
from audit.recorder.deny import DenyList
from audit.recorder.guard import LoadGuard
from audit.recorder.records import RecordWriter
from tests.helpers import gpu_host, interpreted, tiny_mamba2_checkpoint

MODEL = "m-tiny"
SSM = (4, 8)


def _document(model_dir, columns: int) -> dict:
    conv_length, ssm_length = 3 * columns * 4, int(np.prod(SSM)) * 4
    segments = [{"index": i, "block_len": conv_length + ssm_length, "layer": f"model.layers.{i}.mixer",
                 "layer_index": i, "offset_in_page": 0}
                for i in range(2)]
    return {"model": MODEL, "model_path": str(model_dir), "tp_size": 1, "tp_rank": 0, "groups": [{
        "group": 0, "segments": segments,
        "states": [{"name": "conv", "dtype": "float32", "shape": [3, columns], "offset": 0, "length": conv_length},
                   {"name": "ssm", "dtype": "float32", "shape": list(SSM), "offset": conv_length,
                    "length": ssm_length}]}]}


def _pages(conv_rows: list[np.ndarray], rng) -> list[np.ndarray]:
    """Per value, two segments (layers 0 and 1): conv rows then a non-zero ssm state."""
    pages = []
    for rows in conv_rows:
        for layer in range(2):
            conv = rows if layer == 0 else rng.standard_normal(rows.shape)
            pages.append(np.concatenate([np.asarray(conv, np.float32).ravel(),
                                         rng.standard_normal(SSM).astype(np.float32).ravel()]).view(np.uint8).copy())
    return pages


@pytest.mark.parametrize("memory", [
    "host",
    pytest.param("torch", marks=pytest.mark.skipif(not interpreted(), reason="CPU tensors through the kernel: the interpreter")),
    pytest.param("cuda", marks=pytest.mark.skipif(not gpu_host(), reason="pins a GPU host: a consumer's caches in GPU memory"))])
def test_the_guard_refuses_other_weights_and_other_prefixes_and_keeps_the_rest(tmp_path, memory):
    """`memory`: the pages as host memory (read through their addresses), or as torch tensors on the
    CPU (the GPU path's byte views and one copy a batch, the region kernel interpreted) or on a GPU."""
    ours, theirs = tmp_path / MODEL, tmp_path / "other" / MODEL
    tiny_mamba2_checkpoint(ours, seed=0)
    tiny_mamba2_checkpoint(theirs, seed=1)
    mine, other = token_images(ours, MODEL, 1, 0), token_images(theirs, MODEL, 1, 0)
    records = tmp_path / "records"
    records.mkdir()
    hashes = [f"{i:064x}" for i in range(5)]
    keys = [vllm_key(MODEL, h) for h in hashes]
    (records / "prefixes-host-1-0000.jsonl").write_text("".join(prefix_line(h, 3, t) + "\n" for h, t in zip(
        hashes, ([1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12]))))  # the 5th key has no record
    rows = [mine.images([1, 2, 3]),      # healthy
            mine.images([6, 5, 4]),      # another prefix's state under this hash
            other.images([7, 8, 9]),     # other weights
            mine.images([10, 11, 12]),   # healthy
            mine.images([13, 14, 15])]   # no record: judged on the weights alone
    pages = _pages(rows, np.random.default_rng(5))
    caches = {}
    if memory != "host":
        torch = pytest.importorskip("torch")
        if memory == "torch":
            pytest.importorskip("triton")
        caches = {f"page.{i}": torch.from_numpy(page).to("cpu" if memory == "torch" else "cuda")
                  for i, page in enumerate(pages)}
        pages = list(caches.values())
    address = (lambda page: page.ctypes.data) if memory == "host" else (lambda page: page.data_ptr())
    addrs = [[address(pages[2 * v]), address(pages[2 * v + 1])] for v in range(len(keys))]
    sizes = [[len(pages[2 * v]), len(pages[2 * v + 1])] for v in range(len(keys))]

    guard = LoadGuard(DenyList(records, RecordWriter(records, stem="denied")), StateBinder(records))
    guard.describe(_document(ours, mine.columns), caches, in_kernel=True if memory == "torch" else None)
    assert bool(guard.memory.storages) is (memory != "host")
    guard.binder.building.join(60)
    assert guard.binder.status == "bound", guard.binder.status
    found = guard.check(keys, addrs, sizes, [0] * len(keys))
    assert found == {1: "PREFIX_MISMATCH", 2: "WEIGHTS_MISMATCH"}
    assert guard.check(keys, addrs, sizes, [0, -704, -704, 0, 0]) == {}  # only what loaded is judged


def test_until_the_images_are_built_nothing_is_bound(tmp_path):
    binder = StateBinder(tmp_path)
    binder.layer0 = {0: None}  # described, images not ready: not one value judged
    assert binder.refusals([vllm_key(MODEL, "ab")], [0], lambda wanted: 1 / 0) == {}


def test_nothing_is_bound_where_the_weights_are_not_here(tmp_path):
    binder = StateBinder(tmp_path)
    binder.describe({"model": MODEL, "model_path": None, "groups": []})
    assert binder.status == "no layer-0 conv state or attention page" and binder.building is None
    tiny_mamba2_checkpoint(tmp_path / MODEL)
    (tmp_path / MODEL / "model.safetensors").unlink()
    binder.describe(_document(tmp_path / MODEL, 8), background=False)  # a config, no weights
    assert binder.images is None and binder.status.startswith("not bound"), binder.status
    assert binder.refusals([vllm_key(MODEL, "ab")], [0], lambda wanted: [np.zeros(64, np.uint8)] * len(wanted)) == {}


@pytest.mark.parametrize("device", ["host", pytest.param("cuda", marks=pytest.mark.skipif(
    not gpu_host(), reason="pins a GPU host: a producer's caches in GPU memory"))])
def test_the_put_guard_withholds_what_the_load_guard_would_refuse(tmp_path, device):
    """The producer's side (`MOONCAKE_AUDIT_GUARD=1`, caches in host or GPU memory): the same two
    states are withheld, with their reasons in the put records; the rest reach the put. (The store
    is a stand-in: only what reaches the put matters.)"""
    import json

    from audit.recorder.records import RecordWriter as Writer
    from audit.recorder.wrapper import WITHHELD_RESULT, recording_store_class
    from tests.recorder.test_recorder import SpyStore

    ours, theirs = tmp_path / MODEL, tmp_path / "other" / MODEL
    tiny_mamba2_checkpoint(ours, seed=0)
    tiny_mamba2_checkpoint(theirs, seed=1)
    mine, other = token_images(ours, MODEL, 1, 0), token_images(theirs, MODEL, 1, 0)
    records = tmp_path / "records"
    hashes = [f"{i:064x}" for i in range(4)]
    keys = [vllm_key(MODEL, h) for h in hashes]
    records.mkdir()
    (records / "prefixes-host-1-0000.jsonl").write_text("".join(
        prefix_line(h, 3, t) + "\n" for h, t in zip(hashes, ([1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12]))))
    pages = _pages([mine.images([1, 2, 3]), mine.images([6, 5, 4]), other.images([7, 8, 9]),
                    mine.images([10, 11, 12])], np.random.default_rng(6))
    page = pages[0].nbytes
    layers = [np.zeros((len(keys) + 1) * page, np.uint8) for _ in range(2)]  # block 0: the null block
    for value in range(len(keys)):
        for layer in range(2):
            layers[layer][(value + 1) * page:(value + 2) * page] = pages[2 * value + layer]

    caches, base = {}, [layer.ctypes.data for layer in layers]
    if device == "cuda":
        import torch

        caches = {f"model.layers.{i}.mixer": torch.from_numpy(layer).cuda() for i, layer in enumerate(layers)}
        base = [tensor.data_ptr() for tensor in caches.values()]
    store = recording_store_class(SpyStore, Writer(records), guard=True)()
    for address in base:
        store.register_buffer(address, len(layers[0]))
    store.audit_describe(_document(ours, mine.columns), caches)
    assert bool(store.audit_put_memory.storages) is (device == "cuda")
    store.audit_put_binder.building.join(60)
    addrs = [[address + (value + 1) * page for address in base] for value in range(len(keys))]
    results = store.batch_put_from_multi_buffers(keys, addrs, [[page, page]] * len(keys))

    assert results == [0, WITHHELD_RESULT, WITHHELD_RESULT, 0]
    assert store.calls[0][0] == [keys[0], keys[3]]
    lines = [json.loads(line) for path in records.glob("blocks-*.jsonl") for line in path.read_text().splitlines()]
    assert {line["key"]: line.get("reason") for line in lines} == {
        keys[0]: None, keys[1]: "PREFIX_MISMATCH", keys[2]: "WEIGHTS_MISMATCH", keys[3]: None}


def test_falcon_h1s_layer0_conv_is_found_under_its_offset_mixer_name(tmp_path):
    """vLLM names Falcon-H1's decoder layer 0 mixer ``model.{num_hidden_layers}.mixer``: the binder
    takes its conv state from that segment, in a manifest with ``decoder_layer`` and in one of a
    recorder before it (the real vLLM's, tests/e2e/observed.json)."""
    import json
    from pathlib import Path

    from audit.recorder.binding import Layer0Rows

    runs = json.loads((Path(__file__).parents[1] / "e2e" / "observed.json").read_text())["runs"]
    document = runs["manifest-falcon-h1-tiny"]["manifest"]
    for segment in document["groups"][1]["segments"]:
        segment.pop("decoder_layer", None)  # as an older recorder wrote it
    expected = {1: Layer0Rows(0, 0, 1920, "float32", (3, 160))}
    binder = StateBinder(tmp_path)
    binder.describe(document)
    assert binder.layer0 == expected
    for segment, decoder in zip(document["groups"][1]["segments"], (1, 0)):
        segment["decoder_layer"] = decoder  # the manifest's word wins
    binder.describe(document)
    assert binder.layer0 == {1: Layer0Rows(1, 0, 1920, "float32", (3, 160))}


def _attention_document(model_dir) -> dict:
    """A Llama consumer's manifest as vLLM's CPU backend describes it: one attention group of blocks
    of 16 tokens, a page per layer of 2 KV heads of 4, K and V."""
    segments = [{"index": i, "block_len": 2 * 16 * 8 * 4, "layer": f"model.layers.{i}.self_attn.attn",
                 "layer_index": i, "offset_in_page": 0} for i in range(2)]
    return {"model": MODEL, "model_path": str(model_dir), "tp_size": 1, "tp_rank": 0, "groups": [{
        "group": 0, "kind": "attention", "block_size": 16, "segments": segments,
        "attention": {"num_kv_heads": 2, "head_size": 4, "head_size_v": 4, "dtype": "float32"}}]}


def _attention_values(tmp_path):
    """Eight attention blocks under their hashes, and the consumer's prefix records of seven: healthy;
    another block's tokens; other weights; a partial tail block of 5 tokens whose later rows are no
    token's image (what its page held before); no record; healthy in a token-major page; a partial
    tail block of 3 tokens in a token-major page; healthy."""
    from tests.judge.test_binding import _attention_page
    from tests.layouts.test_images import llama_checkpoint

    ours, theirs = tmp_path / MODEL, tmp_path / "other" / MODEL
    llama_checkpoint(ours, np.random.default_rng(0), kv_heads=2)
    llama_checkpoint(theirs, np.random.default_rng(1), kv_heads=2)
    mine, other = token_images(ours, MODEL, 1, 0), token_images(theirs, MODEL, 1, 0)
    rng = np.random.default_rng(4)
    blocks = [rng.integers(0, 32, 16) for _ in range(8)]
    tail, short_tail = mine.images(blocks[3]), mine.images(blocks[6])
    tail[5:] = 50 * rng.standard_normal(tail[5:].shape)
    short_tail[3:] = 50 * rng.standard_normal(short_tail[3:].shape)
    v_rows = [mine.images(blocks[0]), mine.images(blocks[1][::-1]), other.images(blocks[2]), tail,
              mine.images(blocks[4]), mine.images(blocks[5]), short_tail, mine.images(blocks[7])]
    pages = []
    for value, rows in enumerate(v_rows):
        order = "tokens" if value in (5, 6) else "cpu"
        pages.append(_attention_page(rows, 2, rng, order).ravel().view(np.uint8).copy())
        pages.append(rng.standard_normal(256).astype(np.float32).view(np.uint8).copy())  # layer 1
    hashes = [f"{i:064x}" for i in range(len(v_rows))]
    records = tmp_path / "records"
    records.mkdir()
    recorded = zip(hashes, (blocks[0], blocks[1], blocks[2], blocks[3][:5], None, blocks[5], blocks[6][:3],
                            blocks[7]))
    (records / "prefixes-host-1-0000.jsonl").write_text("".join(
        prefix_line(h, None, None, list(t)) + "\n" for h, t in recorded if t is not None))
    return ours, records, [vllm_key(MODEL, h) for h in hashes], pages


def test_the_guard_binds_attention_blocks_by_their_own_tokens(tmp_path):
    """Issue #40 §4 for attention: a loaded KV block whose layer-0 V rows are images of other tokens
    than its block's own (the consumer's record of its hash) is refused as PREFIX_MISMATCH, one of
    other weights as WEIGHTS_MISMATCH; the healthy blocks, the partial tail blocks (each judged on
    its own tokens, in either byte order), the one without a record and the one in another byte
    order are kept."""
    ours, records, keys, pages = _attention_values(tmp_path)
    addrs = [[pages[2 * v].ctypes.data, pages[2 * v + 1].ctypes.data] for v in range(len(keys))]
    sizes = [[pages[2 * v].nbytes, pages[2 * v + 1].nbytes] for v in range(len(keys))]
    guard = LoadGuard(DenyList(records, RecordWriter(records, stem="denied")), StateBinder(records))
    guard.describe(_attention_document(ours), {})
    guard.binder.building.join(60)
    assert guard.binder.status == "bound" and guard.binder.layer0[0].kind == "v", guard.binder.status
    assert guard.check(keys, addrs, sizes, [0] * len(keys)) == {1: "PREFIX_MISMATCH", 2: "WEIGHTS_MISMATCH"}


def test_the_put_guard_withholds_attention_blocks_of_other_tokens(tmp_path):
    """The producer's side: the same two blocks are withheld, the rest reach the put."""
    from audit.recorder.records import RecordWriter as Writer
    from audit.recorder.wrapper import WITHHELD_RESULT, recording_store_class
    from tests.recorder.test_recorder import SpyStore

    ours, records, keys, pages = _attention_values(tmp_path)
    page = pages[0].nbytes
    layers = [np.zeros((len(keys) + 1) * page, np.uint8) for _ in range(2)]  # block 0: the null block
    for value in range(len(keys)):
        for layer in range(2):
            layers[layer][(value + 1) * page:(value + 2) * page] = pages[2 * value + layer]
    store = recording_store_class(SpyStore, Writer(records), guard=True)()
    for layer in layers:
        store.register_buffer(layer.ctypes.data, layer.nbytes)
    store.audit_describe(_attention_document(ours), {})
    store.audit_put_binder.building.join(60)
    addrs = [[layer.ctypes.data + (value + 1) * page for layer in layers] for value in range(len(keys))]
    results = store.batch_put_from_multi_buffers(keys, addrs, [[page, page]] * len(keys))
    assert results == [0, WITHHELD_RESULT, WITHHELD_RESULT, 0, 0, 0, 0, 0]
    assert store.calls[0][0] == [keys[0], *keys[3:]]


def test_the_guard_binds_mla_blocks_by_their_latent_rows(tmp_path):
    """An MLA consumer (``MLAAttentionSpec``: one latent of 16 + 4 a token, block 16): a block whose
    latent rows are images of other tokens than its record's is refused as PREFIX_MISMATCH, one of
    other weights as WEIGHTS_MISMATCH; a healthy block is kept whatever its rotary part holds."""
    from tests.layouts.test_images import _deepseek_checkpoint

    ours, theirs = tmp_path / MODEL, tmp_path / "other" / MODEL
    _deepseek_checkpoint(ours, np.random.default_rng(0))
    _deepseek_checkpoint(theirs, np.random.default_rng(1))
    mine, other = token_images(ours, MODEL, 1, 0), token_images(theirs, MODEL, 1, 0)
    rng = np.random.default_rng(5)
    blocks = [rng.integers(0, 32, 16) for _ in range(3)]
    latents = [mine.images(blocks[0]), mine.images(blocks[1][::-1]), other.images(blocks[2])]
    pages = []
    for rows in latents:
        pages.append(np.hstack([rows, rng.standard_normal((16, 4))]).astype(np.float32).ravel().view(np.uint8).copy())
        pages.append(rng.standard_normal(16 * 20).astype(np.float32).view(np.uint8).copy())  # layer 1
    hashes = [f"{i:064x}" for i in range(len(latents))]
    records = tmp_path / "records"
    records.mkdir()
    (records / "prefixes-host-1-0000.jsonl").write_text(
        "".join(prefix_line(h, None, None, list(t)) + "\n" for h, t in zip(hashes, blocks)))
    segments = [{"index": i, "block_len": 16 * 20 * 4, "layer": f"model.layers.{i}.self_attn.attn",
                 "layer_index": i, "offset_in_page": 0} for i in range(2)]
    document = {"model": MODEL, "model_path": str(ours), "tp_size": 1, "tp_rank": 0, "groups": [{
        "group": 0, "kind": "attention", "spec": "MLAAttentionSpec", "block_size": 16, "segments": segments,
        "attention": {"num_kv_heads": 1, "head_size": 20, "head_size_v": 20, "dtype": "float32"}}]}
    keys = [vllm_key(MODEL, h) for h in hashes]
    addrs = [[pages[2 * v].ctypes.data, pages[2 * v + 1].ctypes.data] for v in range(len(keys))]
    sizes = [[pages[2 * v].nbytes, pages[2 * v + 1].nbytes] for v in range(len(keys))]
    guard = LoadGuard(DenyList(records, RecordWriter(records, stem="denied")), StateBinder(records))
    guard.describe(document, {})
    guard.binder.building.join(60)
    assert guard.binder.status == "bound" and guard.binder.layer0[0].kind == "latent", guard.binder.status
    assert guard.check(keys, addrs, sizes, [0] * len(keys)) == {1: "PREFIX_MISMATCH", 2: "WEIGHTS_MISMATCH"}


def test_the_guard_binds_attention_blocks_to_their_recorded_positions(tmp_path):
    """K at layer 0 (issue #40): a loaded block whose V rows are its record's own tokens but whose K
    was turned to positions other than the start its request recorded (the same tokens' block from
    elsewhere in a prompt) is refused as PREFIX_MISMATCH. Kept: K at the recorded start (the CPU
    backend's transposed K, and K by token), a partial tail block (its filled rows at their start),
    and blocks recorded without a start (judged on V alone, as a key without a record is: the scan
    reads their start from the bytes), one of them at positions that are no block's. Among the
    blocks recorded with a start (judged as arrays, `StateBinder._judge_pages`), V rows of other
    tokens than the record's are PREFIX_MISMATCH, and rows that are no token's image WEIGHTS_MISMATCH.
    Records written right after a load are read by the next load, however soon it comes."""
    from tests.judge.test_binding import _attention_page, _rotated_k
    from tests.layouts.test_images import HEAD, llama_checkpoint

    rng = np.random.default_rng(8)
    ours = tmp_path / MODEL
    tensors = llama_checkpoint(ours, rng, kv_heads=2, **{
        "model.layers.0.self_attn.k_proj.weight": rng.standard_normal((2 * HEAD, 8)).astype(np.float32)})
    mine = token_images(ours, MODEL, 1, 0)
    blocks = [rng.integers(0, 32, 16) for _ in range(6)]
    # (K's first position, the recorded start, the rows recorded, page order)
    cases = [(32, 32, 16, "cpu"), (64, 16, 16, "cpu"), (37, None, 16, "cpu"), (48, 48, 16, "by-head"),
             (80, 80, 5, "cpu"), (96, None, 16, "cpu"), (112, 112, 16, "cpu"), (128, 128, 16, "cpu")]
    blocks += [rng.integers(0, 32, 16) for _ in range(2)]
    v_rows = [mine.images(tokens) for tokens in blocks]
    v_rows[6] = mine.images(blocks[6][::-1])  # (another block's tokens)
    v_rows[7] = 50 * rng.standard_normal(v_rows[7].shape)  # (no token's image)
    pages, lines = [], []
    for value, ((first, start, filled, order), tokens) in enumerate(zip(cases, blocks)):
        k = _rotated_k(tensors, tokens, first + np.arange(16), 2)
        k[filled:] = 50 * rng.standard_normal(k[filled:].shape)  # (a partial tail's rows hold what was there)
        pages.append(_attention_page(v_rows[value], 2, rng, order, k).ravel().view(np.uint8).copy())
        pages.append(rng.standard_normal(256).astype(np.float32).view(np.uint8).copy())  # layer 1
        lines.append(prefix_line(f"{value:064x}", None, None, list(tokens[:filled]), start))
    records = tmp_path / "records"
    records.mkdir()
    (records / "prefixes-host-1-0000.jsonl").write_text("\n".join(lines) + "\n")
    keys = [vllm_key(MODEL, f"{value:064x}") for value in range(len(cases))]
    addrs = [[pages[2 * v].ctypes.data, pages[2 * v + 1].ctypes.data] for v in range(len(keys))]
    sizes = [[pages[2 * v].nbytes, pages[2 * v + 1].nbytes] for v in range(len(keys))]
    guard = LoadGuard(DenyList(records, RecordWriter(records, stem="denied")), StateBinder(records))
    guard.describe(_attention_document(ours), {})
    guard.binder.building.join(60)
    assert guard.binder.status == "bound" and guard.binder.images.keys is not None, guard.binder.status
    assert guard.check(keys, addrs, sizes, [0] * len(keys)) == {1: "PREFIX_MISMATCH", 6: "PREFIX_MISMATCH",
                                                               7: "WEIGHTS_MISMATCH"}
    # the next step's requests: their scheduler records them just before their loads, which come at once
    # (a TP 2 consumer's rank once judged such a block on V alone: its records were read too recently)
    later = [vllm_key(MODEL, f"{value + 100:064x}") for value in range(len(cases))]
    with open(records / "prefixes-host-1-0000.jsonl", "a", encoding="utf-8") as handle:
        handle.write("".join(prefix_line(f"{value + 100:064x}", None, None, list(tokens[:filled]), start) + "\n"
                             for value, ((_, start, filled, _), tokens) in enumerate(zip(cases, blocks))))
    assert guard.check(later, addrs, sizes, [0] * len(later)) == {1: "PREFIX_MISMATCH", 6: "PREFIX_MISMATCH",
                                                                 7: "WEIGHTS_MISMATCH"}


def test_the_guard_keeps_blocks_whose_rows_may_be_embeddings_their_request_was_given(tmp_path):
    """A multimodal item's placeholder positions hold its encoder's embeddings, no token's image:
    a block the consumer's scheduler recorded as holding such rows (`supplied_line`) is kept, as is
    one of a model taking an encoder's embeddings with no record; a text model's unrecorded block
    of no token's image is still refused."""
    import json

    from audit.prefixrecords import supplied_line

    ours, records, keys, pages = _attention_values(tmp_path)
    addrs = [[pages[2 * v].ctypes.data, pages[2 * v + 1].ctypes.data] for v in range(len(keys))]
    sizes = [[pages[2 * v].nbytes, pages[2 * v + 1].nbytes] for v in range(len(keys))]
    embedded = keys[2].rpartition("@")[2]  # its V rows are no token's image under these weights
    path = records / "prefixes-host-1-0000.jsonl"
    others = "".join(line + "\n" for line in path.read_text().splitlines() if embedded not in line)

    def refused(recorded: str) -> dict[int, str]:
        path.write_text(recorded)
        guard = LoadGuard(DenyList(records, RecordWriter(records, stem="denied")), StateBinder(records))
        guard.describe(_attention_document(ours), {})
        guard.binder.building.join(60)
        return guard.check(keys, addrs, sizes, [0] * len(keys))

    assert refused(others + supplied_line(embedded) + "\n") == {1: "PREFIX_MISMATCH"}
    assert refused(others) == {1: "PREFIX_MISMATCH", 2: "WEIGHTS_MISMATCH"}
    config = json.loads((ours / "config.json").read_text())
    (ours / "config.json").write_text(json.dumps({**config, "image_token_index": 7}))  # a LLaVA's field
    assert refused(others) == {1: "PREFIX_MISMATCH"}
