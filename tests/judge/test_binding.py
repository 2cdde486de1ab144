"""WEIGHTS_MISMATCH in a real scan (issue #40): values whose layer-0 conv rows are images of tokens
under the weights given are clean; rows made under other weights, and garbage, are flagged; a model
whose directory holds no weights is scanned as before and named as not bound."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

from audit.judge.plan import load_layouts
from audit.layouts.weights import token_images
from audit.producers.vllm import vllm_key
from tests.helpers import gpu_host, report_schema, run_cli, tiny_mamba2_checkpoint

MODEL = "m-tiny"
FLAGS = ("--state-dtype", "float32", "--ssm-dtype", "float32")


def _value(layout, conv_rows: np.ndarray, rng) -> bytes:
    """A state value of `layout`: layer 0's conv rows as given, every other region random."""
    value = bytearray()
    for segment, region in layout.regions():
        numbers = conv_rows if (segment.layer, region.name) == (0, "conv") else rng.standard_normal(region.shape)
        value += np.asarray(numbers, dtype=np.float32).tobytes()
    return bytes(value)


def _scan(cli_args, namespace, model_dir, *extra):
    result = run_cli("scan", *cli_args, "--prefix", namespace[:-1] + "@", "--model-config", str(model_dir), *FLAGS,
                     "--format", "json", "--no-progress", *extra)
    assert result.exit_code in (0, 1), result.output
    document = json.loads(result.stdout)
    jsonschema.validate(document, report_schema())
    return result.exit_code, document


def _records(lines: list[str], tabled: bool, directory):
    """The prefix records of `lines`, as the guards keep them (a `PrefixRecords`, a line at a time) or
    as a scan reads them from files (`read_prefix_records`: sorted tables, looked up a batch at once)."""
    from audit.prefixrecords import PrefixRecords, parse_prefix_record
    from audit.prefixtable import read_prefix_records

    if not tabled:
        records = PrefixRecords()
        for line in lines:
            records.add(*parse_prefix_record(json.loads(line)))
        return records
    (directory / "prefixes-test-0-0000.jsonl").write_text("".join(line + "\n" for line in lines))
    return read_prefix_records([directory])


def test_rows_of_other_weights_or_garbage_are_weights_mismatch(publisher, cli_args, namespace, tmp_path):
    ours = tmp_path / MODEL
    tiny_mamba2_checkpoint(ours, seed=0)
    tiny_mamba2_checkpoint(tmp_path / "other" / MODEL, seed=1)
    (layout,) = load_layouts(model_configs=[ours], state_dtype="float32", ssm_dtype="float32")
    mine, theirs = token_images(ours, MODEL, 1, 0), token_images(tmp_path / "other" / MODEL, MODEL, 1, 0)
    rng = np.random.default_rng(7)
    healthy = {vllm_key(MODEL, f"{i:064x}", cache_prefix=namespace[:-1]): mine.images(rng.integers(0, 32, 3))
               for i in range(6)}
    planted = {vllm_key(MODEL, f"{100 + i:064x}", cache_prefix=namespace[:-1]): rows for i, rows in enumerate(
        [theirs.images([1, 2, 3]), rng.standard_normal((3, 24))])}
    for key, rows in {**healthy, **planted}.items():
        publisher.put(key, _value(layout, rows, rng))
    code, document = _scan(cli_args, namespace, ours)
    flagged = {r["key"]: r for r in document["findings"]}
    assert set(flagged) == set(planted) and code == 1
    for record in flagged.values():
        assert record["verdicts"] == ["WEIGHTS_MISMATCH"]
        evidence = record["evidence"]["weights_mismatch"]
        assert evidence["layer"] == 0 and min(row["distance"] for row in evidence["rows"]) > evidence["row_tolerance"]
    assert document["summary"]["binding"] == {"bound": [MODEL], "not_bound": {}, "row_tolerance": 0.05,
                                              "keys_decoded": {MODEL: 8}}
    assert document["summary"]["verdicts"].get("WEIGHTS_MISMATCH") == 2
    human = run_cli("scan", *cli_args, "--prefix", namespace[:-1] + "@", "--model-config", str(ours), *FLAGS,
                    "--no-progress")
    assert "layer-0 binding: m-tiny" in human.stdout and "WEIGHTS_MISMATCH=2" in human.stdout, human.stdout

    (ours / "model.safetensors").unlink()  # the config alone: nothing to bind against, the scan as before
    code, document = _scan(cli_args, namespace, ours)
    assert code == 0 and document["findings"] == [] and "binding" not in document["summary"]



def test_a_value_is_bound_under_the_reading_that_decodes_to_tokens(tmp_path):
    """A size that fits bfloat16 and float16 conv states alike: the healthy value binds under its
    own reading (the other decodes to nothing) and is not flagged; garbage binds under neither."""
    from audit.judge.binding import Bindings, Values, bind_values
    from audit.judge.key import judge_read
    from audit.records import KeyInfo

    ours = tmp_path / MODEL
    tiny_mamba2_checkpoint(ours)
    readings = tuple(load_layouts(model_configs=[ours], state_dtype=dtype, ssm_dtype="float32")[0]
                     for dtype in ("float16", "bfloat16"))
    assert readings[0].size == readings[1].size
    rows = token_images(ours, MODEL, 1, 0).images([4, 5, 6])
    bits = rows.astype(np.float32).view(np.uint32)
    value = bytearray(np.random.default_rng(3).standard_normal(readings[1].size // 4).astype(np.float32).tobytes())
    conv = next(region for segment, region in readings[1].regions() if (segment.layer, region.name) == (0, "conv"))
    value[conv.offset:conv.offset + conv.length] = (bits >> 16).astype(np.uint16).tobytes()  # bfloat16 rows
    garbage = bytes(np.random.default_rng(4).integers(1, 255, readings[1].size, dtype=np.uint8))
    records = [judge_read(KeyInfo(f"{MODEL}@k{i}", readings[1].size), readings[1].size, None) for i in range(2)]
    for record in records:
        record.verdicts.clear()
    bind_values(records, Values.listed([np.frombuffer(bytes(value), np.uint8), np.frombuffer(garbage, np.uint8)]),
                [readings, readings], Bindings.of([ours]))
    assert records[0].verdicts == [] and records[1].verdicts == ["WEIGHTS_MISMATCH"]


def _attention_page(v_rows: np.ndarray, heads: int, rng, order: str = "cpu", k_rows=None) -> np.ndarray:
    """One layer's page of (heads, tokens, 2 * head) float32 numbers whose tokens' V (over the heads)
    is `v_rows`, K `k_rows` (or random): "cpu" as vLLM 0.32's CPU backend keeps it (a head's K,
    transposed: (dim, tokens), then its V by token), "by-head" with K by token too, "tokens" as
    (tokens, heads, k|v)."""
    tokens, size = len(v_rows), v_rows.shape[1] // heads
    v = v_rows.reshape(tokens, heads, size)
    k = rng.standard_normal(v.shape) if k_rows is None else k_rows.reshape(tokens, heads, size)
    if order == "cpu":
        return np.stack([k.transpose(1, 2, 0).reshape(heads, tokens, size), v.transpose(1, 0, 2)],
                        axis=1).astype(np.float32)  # (heads, K (dim, tokens) | V (tokens, dim))
    if order == "by-head":  # K kept as V is, a token a row
        return np.stack([k.transpose(1, 0, 2), v.transpose(1, 0, 2)], axis=1).astype(np.float32)
    return np.stack([k, v], axis=2).astype(np.float32)  # (tokens, heads, k|v, dim)


def test_attention_values_are_bound_by_layer_0s_v_rows(tmp_path):
    """A Llama's layer-0 V rows are token images: a value of these weights binds (in the CPU
    backend's order, and in a token-major page), one of other weights or garbage is WEIGHTS_MISMATCH
    (evidence region "v"); a conv window's record says nothing of a KV block."""
    from audit.judge.binding import Bindings, Values, bind_values
    from audit.judge.key import judge_read
    from audit.prefixrecords import PrefixDigest, PrefixRecords, prefix_digest
    from audit.records import KeyInfo
    from tests.layouts.test_images import llama_checkpoint

    ours, theirs = tmp_path / MODEL, tmp_path / "other" / MODEL
    llama_checkpoint(ours, np.random.default_rng(0), kv_heads=2)
    llama_checkpoint(theirs, np.random.default_rng(1), kv_heads=2)
    layout = next(layout for layout in load_layouts(model_configs=[ours], kv_cache_dtype="float32", block_size=16,
                                                    model_dtype="float32", tp_given=True) if layout.tp_size == 1)
    pages = [region for _, region in layout.regions()]
    assert [region.shape for region in pages] == [(2, 16, 8)] * 2
    rng = np.random.default_rng(2)
    tokens = rng.integers(0, 32, 16)
    mine, other = token_images(ours, MODEL, 1, 0).images(tokens), token_images(theirs, MODEL, 1, 0).images(tokens)
    layer1 = rng.standard_normal(pages[1].shape).astype(np.float32)
    values = [np.concatenate([_attention_page(rows, 2, rng, order).ravel(), layer1.ravel()]).view(np.uint8)
              for rows, order in ((mine, "cpu"), (mine, "tokens"), (other, "cpu"))]
    values.append(rng.standard_normal(layout.size // 4).astype(np.float32).view(np.uint8))
    keys = [vllm_key(MODEL, f"{i:064x}") for i in range(len(values))]
    records = [judge_read(KeyInfo(key, layout.size), layout.size, None) for key in keys]
    for record in records:
        record.verdicts.clear()
    bindings = Bindings.of([ours])
    bindings.prefixes = PrefixRecords()  # a record no V row could match: not consulted
    bindings.prefixes.add(f"{0:064x}", PrefixDigest(3, prefix_digest([99, 99, 99])))
    bind_values(records, Values.listed(values), [(layout,)] * len(values), bindings)
    assert [record.verdicts for record in records] == [[], [], ["WEIGHTS_MISMATCH"], ["WEIGHTS_MISMATCH"]]
    evidence = records[2].evidence["weights_mismatch"]
    assert evidence["region"] == "v" and len(evidence["rows"]) == 16
    assert min(row["distance"] for row in evidence["rows"]) > evidence["row_tolerance"]
    assert bindings.summary()["bound"] == [MODEL] and bindings.summary()["not_bound"] == {}


def _rotated_k(tensors: dict, tokens, positions, kv_heads: int) -> np.ndarray:
    """vLLM's llama.py at layer 0: input_layernorm, k_proj, then neox RoPE (theta 10000) at `positions`."""
    from audit.layouts.rotary import rotary_of, rotate
    from tests.layouts.test_images import HEAD, _rms_normed

    n = _rms_normed(tensors["model.embed_tokens.weight"][tokens], tensors["model.layers.0.input_layernorm.weight"])
    k = (n @ tensors["model.layers.0.self_attn.k_proj.weight"].T).reshape(len(tokens), kv_heads, HEAD)
    rotary, half = rotary_of({}, HEAD), HEAD // 2
    angles = rotary.angles(np.asarray(positions), np.arange(half))[:, None, :]
    first, second = rotate(k[..., :half], k[..., half:], angles)
    return np.concatenate([first, second], axis=-1).reshape(len(tokens), kv_heads * HEAD).astype(np.float32)


@pytest.mark.parametrize("tabled", [False, True], ids=["records", "tables"])
def test_attention_k_rows_bind_to_their_blocks_positions(tmp_path, tabled):
    """Layer 0's K is the token's K turned to its position: a page of a block's tokens at the block's
    positions binds (the CPU backend's transposed K, K by token, and a token-major page); K turned to positions
    not a block's start, or a row's K of its neighbour's token, is PREFIX_MISMATCH (evidence
    `key_positions`: the start decoded), though its V binds and no record is given; so is a block
    whose tokens are its record's but whose K is at positions other than the start it recorded."""
    from audit.judge.binding import Bindings, Values, bind_values
    from audit.judge.key import judge_read
    from audit.prefixrecords import prefix_line
    from audit.records import KeyInfo
    from tests.layouts.test_images import HEAD, llama_checkpoint

    rng = np.random.default_rng(4)
    ours = tmp_path / MODEL
    tensors = llama_checkpoint(ours, rng, kv_heads=2, **{
        "model.layers.0.self_attn.k_proj.weight": rng.standard_normal((2 * HEAD, 8)).astype(np.float32)})
    layout = next(layout for layout in load_layouts(model_configs=[ours], kv_cache_dtype="float32", block_size=16,
                                                    model_dtype="float32", tp_given=True) if layout.tp_size == 1)
    tokens = rng.integers(0, 32, 16)
    v = token_images(ours, MODEL, 1, 0).images(tokens)
    at_block = _rotated_k(tensors, tokens, 48 + np.arange(16), 2)
    shifted = _rotated_k(tensors, tokens, 45 + np.arange(16), 2)
    swapped = _rotated_k(tensors, np.roll(tokens, 1), 48 + np.arange(16), 2)
    layer1 = rng.standard_normal(layout.size // 4 - v.size * 2).astype(np.float32)
    pages = [(at_block, "cpu"), (at_block, "tokens"), (shifted, "cpu"), (swapped, "cpu"), (at_block, "by-head"),
             (at_block, "cpu")]
    values = [np.concatenate([_attention_page(v, 2, rng, order, k).ravel(), layer1]).view(np.uint8)
              for k, order in pages]
    records = [judge_read(KeyInfo(vllm_key(MODEL, f"{i:064x}"), layout.size), layout.size, None)
               for i in range(len(values))]
    for record in records:
        record.verdicts.clear()
    bindings = Bindings.of([ours])
    # the first block recorded at its own start, the last at 16
    bindings.prefixes = _records([prefix_line(f"{0:064x}", None, None, tokens.tolist(), 48),
                                  prefix_line(f"{5:064x}", None, None, tokens.tolist(), 16)], tabled, tmp_path)
    bind_values(records, Values.listed(values), [(layout,)] * len(values), bindings)
    assert [record.verdicts for record in records] == [[], [], ["PREFIX_MISMATCH"], ["PREFIX_MISMATCH"], [],
                                                       ["PREFIX_MISMATCH"]]
    shifted_evidence, swapped_evidence, elsewhere = (records[i].evidence["key_positions"] for i in (2, 3, 5))
    assert shifted_evidence["decoded_start"] == 45 and shifted_evidence["block_tokens"] == 16
    assert shifted_evidence["worst_distance"] <= shifted_evidence["row_tolerance"]  # at 45, every row fits
    assert swapped_evidence["rows_beyond_tolerance"] > 8 and swapped_evidence["worst_distance"] > 0.3
    # the same tokens' block from position 48 under a hash recorded at 16 (a repeated passage): only K tells
    assert (elsewhere["recorded_start"], elsewhere["decoded_start"]) == (16, 48) and "prefix_mismatch" not in \
        records[5].evidence and elsewhere["worst_distance"] > 0.3
    assert bindings.summary()["k_checked"] == 6


def test_mla_values_are_bound_by_layer_0s_latent_and_a_one_head_page_stays_v(tmp_path):
    """An MLA page is (1, tokens, kv_lora_rank + rope): its tokens' normed latents, rotary part last.
    A value of these weights binds whatever its rotary part holds; one of other weights is
    WEIGHTS_MISMATCH (evidence region "latent"). A one-head attention page of the same shape is
    read for its V rows, never as a latent."""
    from audit.judge.binding import Bindings, Values, bind_values, layer0_region
    from audit.judge.key import judge_read
    from audit.records import KeyInfo
    from tests.layouts.test_images import _deepseek_checkpoint

    ours, theirs = tmp_path / MODEL, tmp_path / "other" / MODEL
    _deepseek_checkpoint(ours, np.random.default_rng(0))
    _deepseek_checkpoint(theirs, np.random.default_rng(1))
    layout = next(layout for layout in load_layouts(model_configs=[ours], kv_cache_dtype="float32", block_size=16,
                                                    model_dtype="float32", tp_given=True) if layout.tp_size == 1)
    pages = [region for _, region in layout.regions()]
    assert [region.shape for region in pages] == [(1, 16, 20)] * 2
    assert layer0_region(layout, "latent") is pages[0] and layer0_region(layout, "v") is pages[0]
    rng = np.random.default_rng(2)
    tokens = rng.integers(0, 32, 16)
    mine, other = token_images(ours, MODEL, 1, 0).images(tokens), token_images(theirs, MODEL, 1, 0).images(tokens)
    layer1 = rng.standard_normal(pages[1].shape).astype(np.float32)
    values = [np.concatenate([np.hstack([rows, rng.standard_normal((16, 4))]).ravel(), layer1.ravel()])
              .astype(np.float32).view(np.uint8) for rows in (mine, other)]
    keys = [vllm_key(MODEL, f"{i:064x}") for i in range(len(values))]
    records = [judge_read(KeyInfo(key, layout.size), layout.size, None) for key in keys]
    for record in records:
        record.verdicts.clear()
    bindings = Bindings.of([ours])
    bind_values(records, Values.listed(values), [(layout,)] * len(values), bindings)
    assert [record.verdicts for record in records] == [[], ["WEIGHTS_MISMATCH"]]
    evidence = records[1].evidence["weights_mismatch"]
    assert evidence["region"] == "latent" and len(evidence["rows"]) == 16
    assert min(row["distance"] for row in evidence["rows"]) > evidence["row_tolerance"]


@pytest.mark.parametrize("tabled", [False, True], ids=["records", "tables"])
def test_an_attention_block_of_other_tokens_under_its_hash_is_prefix_mismatch(tmp_path, tabled):
    """A KV block's record names the block's own tokens (issue #40 §3): a page whose V rows are
    images of other tokens is PREFIX_MISMATCH (evidence region "v"); a partial tail block is judged
    on the rows its record names (its later rows hold whatever the page held before: here no
    token's image, which without its record is WEIGHTS_MISMATCH); other weights stay
    WEIGHTS_MISMATCH; a block without a record is judged on its weights alone."""
    from audit.judge.binding import Bindings, Values, bind_values
    from audit.judge.key import judge_read
    from audit.prefixrecords import prefix_line
    from audit.records import KeyInfo
    from tests.layouts.test_images import llama_checkpoint

    ours, theirs = tmp_path / MODEL, tmp_path / "other" / MODEL
    llama_checkpoint(ours, np.random.default_rng(0), kv_heads=2)
    llama_checkpoint(theirs, np.random.default_rng(1), kv_heads=2)
    layout = next(layout for layout in load_layouts(model_configs=[ours], kv_cache_dtype="float32", block_size=16,
                                                    model_dtype="float32", tp_given=True) if layout.tp_size == 1)
    rng = np.random.default_rng(3)
    mine, other = token_images(ours, MODEL, 1, 0), token_images(theirs, MODEL, 1, 0)
    blocks = [rng.integers(0, 32, 16) for _ in range(5)]
    tail = mine.images(blocks[2])
    tail[5:] = 50 * rng.standard_normal(tail[5:].shape)  # past the tail block's 5 tokens: no token's image
    v_rows = [mine.images(blocks[0]), mine.images(blocks[1][::-1]), tail, other.images(blocks[3]), mine.images(blocks[4])]
    layer1 = rng.standard_normal((2, 16, 8)).astype(np.float32)
    values = [np.concatenate([_attention_page(rows, 2, rng).ravel(), layer1.ravel()]).view(np.uint8) for rows in v_rows]
    hashes = [f"{i:064x}" for i in range(len(values))]
    records = [judge_read(KeyInfo(vllm_key(MODEL, h), layout.size), layout.size, None) for h in hashes]
    for record in records:
        record.verdicts.clear()
    bindings = Bindings.of([ours])
    bindings.prefixes = _records([prefix_line(chunk_hash, None, None, list(tokens)) for chunk_hash, tokens
                                  in zip(hashes[:4], (blocks[0], blocks[1], blocks[2][:5], blocks[3]))], tabled, tmp_path)
    bind_values(records, Values.listed(values), [(layout,)] * len(values), bindings)
    assert [record.verdicts for record in records] == [[], ["PREFIX_MISMATCH"], [], ["WEIGHTS_MISMATCH"], []]
    evidence = records[1].evidence["prefix_mismatch"]
    assert evidence["region"] == "v" and evidence["window"] == 16 and evidence["chunk_hash"] == hashes[1]
    unrecorded = [judge_read(KeyInfo(vllm_key(MODEL, "f" * 64), layout.size), layout.size, None)]
    unrecorded[0].verdicts.clear()
    bind_values(unrecorded, Values.listed(values[2:3]), [(layout,)], bindings)  # the tail page without its record
    assert unrecorded[0].verdicts == ["WEIGHTS_MISMATCH"]


def test_a_model_none_of_whose_keys_were_decoded_at_layer_0_is_not_bound(tmp_path):
    """Its weights' images built is not binding: a model whose values hold none of the rows its
    images are of (here: conv images, values whose only layer-0 rows are attention V rows, as
    Falcon-H1's keys were read when its mixers' offset names hid layer 0's conv state) is listed as
    not bound, with the reason; once a key is decoded, it is bound, with its count."""
    from audit.judge.binding import NO_LAYER0_STATE, Bindings, Values, bind_values
    from audit.judge.key import judge_read
    from audit.records import KeyInfo
    from tests.layouts.test_images import llama_checkpoint

    ours = tmp_path / MODEL
    tiny_mamba2_checkpoint(ours)
    attention_dir = tmp_path / "attention" / MODEL
    llama_checkpoint(attention_dir, np.random.default_rng(0))
    attention = next(layout for layout in load_layouts(model_configs=[attention_dir], kv_cache_dtype="float32",
                                                       block_size=16, model_dtype="float32", tp_given=True)
                     if layout.tp_size == 1)
    (state,) = load_layouts(model_configs=[ours], state_dtype="float32", ssm_dtype="float32")
    rng = np.random.default_rng(1)
    bindings = Bindings.of([ours])

    def judge(layout, value: bytes) -> None:
        record = judge_read(KeyInfo(vllm_key(MODEL, f"{len(value):064x}"), layout.size), layout.size, None)
        record.verdicts.clear()
        bind_values([record], Values.listed([np.frombuffer(value, np.uint8)]), [(layout,)], bindings)
        assert record.verdicts == []

    judge(attention, rng.standard_normal(attention.size // 4).astype(np.float32).tobytes())
    summary = bindings.summary()
    assert (summary["bound"], summary["not_bound"], summary["keys_decoded"]) == ([], {MODEL: NO_LAYER0_STATE}, {})
    judge(state, _value(state, token_images(ours, MODEL, 1, 0).images([1, 2, 3]), rng))
    summary = bindings.summary()
    assert (summary["bound"], summary["not_bound"], summary["keys_decoded"]) == ([MODEL], {}, {MODEL: 1})


@pytest.mark.parametrize("device", [None, "cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not gpu_host(), reason="pins a GPU host: a batch in GPU memory"))])
def test_a_batchs_conv_rows_are_gathered_as_slicing_each_value_would(device):
    """`_gathered`: the members' region bytes, one after another, from the batch's buffer (host
    memory: `device` None; a torch tensor on `device`, as a scan into GPU memory holds it): a strided
    copy where the values lie a fixed step apart, a copy of each region where they do not (not a fixed
    step, regions that would overlap, past the buffer's end), and from its values without a buffer."""
    from types import SimpleNamespace

    from audit.judge.binding import Values, _gathered

    host = np.arange(4096, dtype=np.uint64).view(np.uint8)[:30000]
    if device is None:
        buffer = host
    else:
        torch = pytest.importorskip("torch")
        buffer = torch.from_numpy(host.copy()).to(device)
    region = SimpleNamespace(offset=40, length=96)

    def gathered(offsets, members):
        found = _gathered(Values(members, None, (buffer, offsets)), members, region)
        assert isinstance(found, np.ndarray)
        return found

    def sliced(offsets, members):
        return np.concatenate([host[offsets[i] + 40:offsets[i] + 136] for i in members])

    offsets = [0, 1024, 2048, 3072, 4096, 9000]
    for at, members in ((offsets, [1, 2, 3, 4]), (offsets, [5]), (offsets, [0, 1, 5]), ([0, 50], [0, 1]),
                        ([0, 29900], [0, 1])):
        assert np.array_equal(gathered(at, members), sliced(at, members))
    listed = Values.listed([host[:200], None, host[1000:1200]])
    assert np.array_equal(_gathered(listed, [0, 2], region), np.concatenate([host[40:136], host[1040:1136]]))


def test_rows_that_may_be_embeddings_given_to_vllm_are_not_weights_mismatch(tmp_path):
    """A multimodal item's placeholder positions hold its encoder's embeddings: no token's image. A
    block whose producer recorded such rows (`supplied_line`) is not flagged; nor, for a model that
    takes an encoder's embeddings (a LLaVA's ``image_token_index``), is a block with no record; a
    text model's unrecorded block, and a block whose record names its tokens, still are."""
    from audit.judge.binding import Bindings, Values, bind_values
    from audit.judge.key import judge_read
    from audit.prefixrecords import PrefixRecords, parse_prefix_record, prefix_line, supplied_line
    from audit.records import KeyInfo
    from tests.layouts.test_images import llama_checkpoint

    ours = tmp_path / MODEL
    llama_checkpoint(ours, np.random.default_rng(0), kv_heads=2)
    layout = next(layout for layout in load_layouts(model_configs=[ours], kv_cache_dtype="float32", block_size=16,
                                                    model_dtype="float32", tp_given=True) if layout.tp_size == 1)
    rng = np.random.default_rng(5)
    mine = token_images(ours, MODEL, 1, 0)
    tokens = rng.integers(0, 32, 16)
    v_rows = [mine.images(tokens), *(3 * rng.standard_normal((16, mine.columns)) for _ in range(3))]
    layer1 = rng.standard_normal((2, 16, 8)).astype(np.float32)
    values = [np.concatenate([_attention_page(rows, 2, rng).ravel(), layer1.ravel()]).view(np.uint8) for rows in v_rows]
    hashes = [f"{i:064x}" for i in range(len(values))]  # healthy; recorded as supplied; no record; its tokens recorded
    lines = [prefix_line(hashes[0], None, None, list(tokens)), supplied_line(hashes[1]),
             prefix_line(hashes[3], None, None, list(tokens))]

    def verdicts(read=range(len(values))) -> tuple[list, dict]:
        records = [judge_read(KeyInfo(vllm_key(MODEL, hashes[i]), layout.size), layout.size, None) for i in read]
        for record in records:
            record.verdicts.clear()
        bindings = Bindings.of([ours])
        bindings.prefixes = PrefixRecords()
        for line in lines:
            bindings.prefixes.add(*parse_prefix_record(json.loads(line)))
        bind_values(records, Values.listed([values[i] for i in read]), [(layout,)] * len(records), bindings)
        return [record.verdicts for record in records], bindings.summary().get("supplied_rows")

    assert verdicts() == ([[], [], ["WEIGHTS_MISMATCH"], ["WEIGHTS_MISMATCH"]], {"recorded": 1, "unrecorded": 0})
    config = json.loads((ours / "config.json").read_text())
    (ours / "config.json").write_text(json.dumps({**config, "image_token_index": 7}))
    assert verdicts() == ([[], [], [], ["WEIGHTS_MISMATCH"]], {"recorded": 1, "unrecorded": 1})
    # the unbound keys alone: none of the model's keys bound to a token, which the summary says
    assert verdicts([1, 2]) == ([[], []], {"recorded": 1, "unrecorded": 1, "no_key_bound": [MODEL]})
