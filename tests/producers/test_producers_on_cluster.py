"""LMCache's and SGLang's keys and values in a real Mooncake cluster: each clean set-up scans clean
(exit 0), and faults planted beside them are each flagged exactly.

LMCache's values are built by its documented format, whose bytes test_writers.py checks against
LMCache 0.5.6's own code; the store holds what its Mooncake connector's `put_parts(key, header,
kv)` stores. SGLang's keys come from its own MooncakeStore when SGLANG_PYTHON names a Python with
sglang==0.5.23 (`sglang_store.py`; SGLang's engine does not run on this CPU machine), else from
the same format built here."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import by_key, scan_json
from tests.producers.writers import (KV_T2D, checksum_frame, header_bytes, kv_chunk, lmcache_key, lmcache_value,
                                     object_key)

MODEL = "/models/tiny-llama"  # LMCache names vLLM's model argument as given: a path, slashes and all


def lmcache_prompt(namespace: str, seed: int, *, chunks: int = 4, world: int = 1, replicated: bool = False,
                   header: bool = True, tags: list[dict] | None = None, last_tokens: int | None = None) -> dict:
    """One prompt's chunks as LMCache publishes them: a key per (chunk, worker[, tags]); at a TP size
    above the KV-head count every worker holds the same head."""
    rng = np.random.default_rng(seed)
    values = {}
    for chunk in range(chunks):
        tokens = last_tokens if last_tokens is not None and chunk == chunks - 1 else 256
        chunk_hash = (-1) ** chunk * (0x5DB65AA1F24507D4 + 97 * seed + chunk)  # LMCache's hashes can be negative
        head = kv_chunk(rng, tokens=tokens)
        for worker in range(world):
            kv = head if replicated else kv_chunk(rng, tokens=tokens)
            for tag in tags or [None]:
                key = lmcache_key(f"{namespace}{MODEL}", world, worker, chunk_hash, "float", tags=tag)
                values[key] = lmcache_value(kv, header=header)
    return values


def lmcache_layerwise(namespace: str, seed: int, *, chunks: int = 2, layers: int = 4) -> dict:
    """Layerwise keys (`@{layer}` after the dtype): one [tokens, 2, hidden] half-precision layer each."""
    rng = np.random.default_rng(seed)
    values = {}
    for chunk in range(chunks):
        for layer in range(layers):
            kv = rng.normal(size=(256, 2, 64)).astype(np.float16)
            key = lmcache_key(f"{namespace}{MODEL}", 1, 0, 0xC0FFEE + chunk, "half", layer=layer)
            values[key] = header_bytes(kv.nbytes, KV_T2D, [(2, kv.shape)]) + kv.tobytes()
    return values


def lmcache_checksum_serde(namespace: str, seed: int, *, chunks: int = 3) -> dict:
    """Multiprocess mode's L2 keys (ObjectKey), each value framed by the checksum serde."""
    rng = np.random.default_rng(seed)
    values = {}
    for chunk in range(chunks):
        chunk_hash = rng.bytes(32)
        values[object_key(f"{namespace}Qwen/Qwen3-0.6B", chunk_hash)] = checksum_frame(kv_chunk(rng).tobytes(), chunk_hash)
    return values


def _publish(publisher, values: dict) -> None:
    for key, value in values.items():
        publisher.put(key, value)


# set-up -> (values, keys that are expected duplicates, their groups)
LMCACHE_SETUPS = {
    "default (save_chunk_meta)": (lambda ns: lmcache_prompt(ns, 1), 0, 0),
    "save_unfull_chunk": (lambda ns: lmcache_prompt(ns, 2, last_tokens=100), 0, 0),
    "no header (save_chunk_meta false)": (lambda ns: lmcache_prompt(ns, 3, header=False), 0, 0),
    "tags": (lambda ns: lmcache_prompt(ns, 4, tags=[{"user": "alice"}, {"user": "bob"}]), 8, 4),
    "TP 2, 1 KV head": (lambda ns: lmcache_prompt(ns, 5, world=2, replicated=True), 8, 4),
    "TP 2, 2 KV heads": (lambda ns: lmcache_prompt(ns, 6, world=2), 0, 0),
    "layerwise": (lambda ns: lmcache_layerwise(ns, 7), 0, 0),
    "multiprocess L2, checksum serde": (lambda ns: lmcache_checksum_serde(ns, 8), 0, 0),
}


@pytest.mark.parametrize("setup", list(LMCACHE_SETUPS))
def test_clean_lmcache_setups_scan_clean(publisher, cli_args, namespace, setup):
    build, duplicates, groups = LMCACHE_SETUPS[setup]
    values = build(namespace)
    _publish(publisher, values)
    code, document = scan_json(cli_args, "--prefix", namespace, "--all")
    summary = document["summary"]
    assert code == 0 and document["findings"] == [] and summary["keys_scanned"] == len(values)
    assert summary["verdicts"] == ({"EXPECTED_DUPLICATE": duplicates} if duplicates else {})
    assert summary["expected_duplicate_groups"] == groups == len(document["expected_duplicates"])
    assert summary["chunks"]["incomplete"] == 0
    if "no header" not in setup:  # every value decoded: its header (or frame) and its layers
        assert all(record["layout"].startswith("lmcache ") and "decoded" in record["evidence"]
                   for record in document["keys"])


def test_a_replicated_head_in_one_chunk_only_is_a_finding(publisher, cli_args, namespace):
    """TP 2 with 2 KV heads: workers differ in every chunk, but one chunk's worker 1 holds worker 0's head."""
    values = lmcache_prompt(namespace, 9, world=2)
    first, second = list(values)[:2]  # chunk 0's workers 0 and 1
    values[second] = values[first]
    _publish(publisher, values)
    code, document = scan_json(cli_args, "--prefix", namespace, "--fail-on", "warning")  # SHARED_CONTENT: a warning
    assert code == 1 and {r["key"]: r["verdicts"] for r in document["findings"]} == {
        first: ["SHARED_CONTENT"], second: ["SHARED_CONTENT"]}


def test_faults_beside_lmcache_keys_are_each_flagged_exactly(publisher, cli_args, namespace):
    values = lmcache_prompt(namespace, 10, chunks=3)
    rng = np.random.default_rng(11)
    model = f"{namespace}{MODEL}"

    def key(chunk_hash: int, dtype: str = "float") -> str:
        return lmcache_key(model, 1, 0, chunk_hash, dtype)

    good = lmcache_value(kv_chunk(rng))
    nan = kv_chunk(rng)
    nan[1, 1, 7, 3] = np.nan  # layer 1's V
    wrong_length = (len(good) - 28 + 64).to_bytes(4, "little") + good[4:]
    payload = kv_chunk(rng).tobytes()
    frame = bytearray(checksum_frame(payload, b"\x42" * 32))
    frame[5000] ^= 0x10
    faults = {
        key(0xF1): ("ZERO_VALUE", lmcache_value(np.zeros((2, 2, 256, 64), np.float32))),  # zero KV, valid header
        key(0xF2): ("NONFINITE", lmcache_value(nan)),
        key(0xF3): ("SIZE_MISMATCH", good[:-4096]),                                       # truncated
        key(0xF4): ("SIZE_MISMATCH", wrong_length),
        key(0xF5, "half"): ("IDENTITY_SUSPECT", good),                                    # the header says float32
        object_key(model, b"\x42" * 32): ("CHECKSUM_MISMATCH", bytes(frame)),
    }
    _publish(publisher, values | {name: value for name, (_, value) in faults.items()})
    code, document = scan_json(cli_args, "--prefix", namespace)
    assert code == 1
    assert {r["key"]: r["verdicts"] for r in document["findings"]} == {name: [v] for name, (v, _) in faults.items()}
    found = by_key(document)
    assert found[key(0xF1)]["evidence"]["zero"] == {"kv_all_zero": True, "value_all_zero": False}
    assert [r["segment"] for r in found[key(0xF2)]["evidence"]["nonfinite"]["regions"]] == ["v.layers.1"]
    assert found[key(0xF3)]["evidence"]["size_mismatch"] == {
        "value_size": 258076, "header_bytes": 28, "header_length": 262144, "shape_bytes": 262144,
        "expected_size": 262172}
    assert found[key(0xF4)]["evidence"]["size_mismatch"]["header_length"] == 262208
    assert found[key(0xF5, "half")]["evidence"]["value_identity"] == {"key_dtype": "half", "header_dtypes": ["float32"]}
    assert set(found[object_key(model, b"\x42" * 32)]["evidence"]["checksum_mismatch"]) == {"stored_xxh3", "payload_xxh3"}


# SGLang ------------------------------------------------------------------------------------------

SGLANG_STORE = Path(__file__).parent / "sglang_store.py"
PAGES = [f"{0xABC000 + page:064x}" for page in range(3)]


def sglang_pages(tag: str, seed: int) -> dict:
    """What sglang_store.py writes, by the format: MHA at TP 2 (`_{tp}_k/_v`), MLA (`__k`), MLA at
    PP 2 (`_{pp}_k`), under the prefix `{tag}{setup}_{model with / as -}`, 2 KiB per object."""
    rng = np.random.default_rng(seed)
    names = []
    for page in PAGES:
        names += [f"{tag}mha-tp2_Qwen-Qwen3-0.6B_{page}_{tp}_{half}" for tp in (0, 1) for half in "kv"]
        names += [f"{tag}mla_Qwen-Qwen3-0.6B_{page}__k"]
        names += [f"{tag}mla-pp2_Qwen-Qwen3-0.6B_{page}_{pp}_k" for pp in (0, 1)]
    return {name: rng.integers(1, 255, 2048, dtype=np.uint8).tobytes() for name in names}


def _scan_with_warmup_keys(cli_args, namespace, *extra):
    return scan_json(cli_args, "--match", f"^({namespace}|sglang_mooncake_store_warmup_key)", "--all", *extra)


def test_a_clean_sglang_store_with_its_warmup_key_scans_clean(publisher, cli_args, namespace):
    values = sglang_pages(namespace, 12)
    values[f"sglang_mooncake_store_warmup_key{uuid.uuid4().hex}"] = bytes(4096)  # MooncakeStore.warmup
    _publish(publisher, values)
    code, document = _scan_with_warmup_keys(cli_args, namespace)
    summary = document["summary"]
    assert code == 0 and document["findings"] == [] and summary["verdicts"]["WARMUP_KEY"] >= 1
    assert summary["chunks"]["incomplete"] == 0
    fields = {record["key"]: record["fields"] for record in document["keys"]}
    assert fields[f"{namespace}mla-pp2_Qwen-Qwen3-0.6B_{PAGES[0]}_1_k"] == {
        "scheme": "sglang", "prefix": f"{namespace}mla-pp2_Qwen-Qwen3-0.6B", "page_hash": PAGES[0], "part": "k",
        "shard": 1}
    assert fields[f"{namespace}mla_Qwen-Qwen3-0.6B_{PAGES[0]}__k"]["part"] == "k"


def test_zero_pages_beside_sglang_keys_are_flagged(publisher, cli_args, namespace):
    values = sglang_pages(namespace, 13)
    zero = [f"{namespace}mha-tp2_Qwen-Qwen3-0.6B_{PAGES[1]}_1_{half}" for half in "kv"]
    values.update({name: bytes(2048) for name in zero})
    _publish(publisher, values)
    code, document = _scan_with_warmup_keys(cli_args, namespace)
    assert code == 1 and {r["key"]: r["verdicts"] for r in document["findings"]} == {name: ["ZERO_VALUE"] for name in zero}


HYBRID_PREFIX = "hybrid_nvidia-Nemotron-H-tiny"  # sglang_store.py's hybrid set-up: `{tag}hybrid_{model}`
HYBRID_OBJECTS = ("k", "v", "temporal", "conv_0")


def _sglang_store_run(cluster, namespace: str) -> dict:
    run = subprocess.run([os.environ["SGLANG_PYTHON"], str(SGLANG_STORE), cluster.master_address,
                          cluster.metadata_url, namespace], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"})
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def _hybrid_checks(cli_args, namespace: str, tmp_path: Path, setup: dict) -> None:
    """The hybrid's pages by its own config (a directory named as the key prefix's model): exit 0,
    no finding; each state page split per state layer, its KV pages sized by the attention layer."""
    assert setup["state_layers"] == [0, 1] and setup["attention_layers"] == [2]
    assert (setup["temporal_dtype"], setup["conv_dtype"], setup["dtype"]) == ("float32", "bfloat16", "bfloat16")
    model = tmp_path / "Nemotron-H-tiny"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(setup["config"]))
    code, document = _scan_with_warmup_keys(cli_args, namespace, "--model-config", str(model))
    assert code == 0 and document["findings"] == [], document["findings"]
    records = {record["key"]: record for record in document["keys"]
               if record["key"].startswith(f"{namespace}{HYBRID_PREFIX}_")}
    assert len(records) == len(PAGES) * len(HYBRID_OBJECTS)
    states = len(setup["state_layers"])
    for key, record in records.items():
        part = key.rsplit("_0_", 1)[1]
        page = record["evidence"]["decoded"]["sglang_page"]
        if part in ("temporal", "conv_0"):
            numbers = math.prod(setup["temporal_shape"] if part == "temporal" else setup["conv_shapes"][0])
            width = 4 if part == "temporal" else 2
            assert page["pool"] == "Mamba", key
            assert {"bytes_per_number": width, "page_tokens": 1, "layers": states,
                    "numbers_per_token_and_layer": numbers} in page["fits"], key
            # The reading the record shows: one region a state layer, of equal length.
            assert record["layout"].startswith("sglang Mamba page"), key
            regions = record["regions"]
            assert [row["segment"] for row in regions] == [f"layers.{layer}" for layer in range(states)], key
            dtype = setup["temporal_dtype"] if part == "temporal" else setup["conv_dtype"]
            assert {(row["region"], row["kind"], row["dtype"], row["length"]) for row in regions} == {
                (part, "state", dtype, setup["object_bytes"][part] // states)}, key
            assert [row["offset"] for row in regions] == [layer * setup["object_bytes"][part] // states
                                                          for layer in range(states)], key
        else:
            # The KV pool holds the attention layer only (1, or up to 4 more packed draft layers);
            # the evidence names its first fits (float32's come first), the config's 1 layer among them.
            row = setup["kv_heads_per_rank"] * setup["head_dim"]
            assert page["pool"] == "MHA" and page["layers"] == [1, 5], key
            assert row in page["numbers_per_token_and_layer"], key
            assert any(fit["layers"] == 1 and fit["page_tokens"] == setup["page_tokens"] for fit in page["fits"]), key
            assert record["size"] == setup["page_tokens"] * 1 * row * 2, key
            assert page["dtypes"][0] == "bfloat16" and record["evidence"]["decoded"]["reading"]["dtypes"][0] \
                == "bfloat16", key


@pytest.mark.skipif(not os.environ.get("SGLANG_PYTHON"), reason="SGLANG_PYTHON: a Python with sglang==0.5.23")
def test_sglangs_own_store_writes_what_the_audit_expects(cluster, cli_args, namespace, tmp_path):
    printed = _sglang_store_run(cluster, namespace)
    assert printed["pages"] == PAGES
    setups = printed["setups"]
    # SGLang's own host pools (bfloat16, pages of 4 tokens): one page of one rank's K (or V).
    assert {name: setup["value_bytes"] for name, setup in setups.items()} == {
        "mha-tp2": 1024, "mha-direct": 2048, "mla": 1280, "mla-pp2": 640, "hybrid": 1024}
    for setup in setups.values():
        row = setup["kv_cache_dim"] if setup["mla"] else setup["kv_heads_per_rank"] * setup["head_dim"]
        assert setup["value_bytes"] == setup["page_tokens"] * setup["layers_per_rank"] * row * 2
    # The hybrid's Mamba pool: one state slot a page, [state layers, 1, *state] of temporal (float32) and conv.
    hybrid = setups["hybrid"]
    assert hybrid["object_bytes"] == {
        "k": 1024, "v": 1024,
        "temporal": len(hybrid["state_layers"]) * math.prod(hybrid["temporal_shape"]) * 4,
        "conv_0": len(hybrid["state_layers"]) * math.prod(hybrid["conv_shapes"][0]) * 2}
    code, document = _scan_with_warmup_keys(cli_args, namespace)
    records = {record["key"]: record for record in document["keys"] if record["key"].startswith(namespace)}
    direct = [f"{namespace}mha-direct_Qwen-Qwen3-0.6B_{page}_0_{half}" for page in PAGES for half in "kv"]
    expected = {name: setups[name[len(namespace):].split("_", 1)[0]]["value_bytes"]
                for name in [*sglang_pages(namespace, 0), *direct]}
    expected |= {f"{namespace}{HYBRID_PREFIX}_{page}_0_{part}": hybrid["object_bytes"][part]
                 for page in PAGES for part in HYBRID_OBJECTS}
    assert {key: record["size"] for key, record in records.items()} == expected
    # The bytes the audit read are the pages the script sliced out of the host pools by their layout.
    assert {key: record["xxh3"] for key, record in records.items()} == printed["xxh3"]
    assert code == 0 and document["summary"]["verdicts"]["WARMUP_KEY"] >= 7  # one per store start

    # By the model's config (the script's geometry): SGLang's own MHA pages sized and read as the
    # bfloat16 they are, at TP 2 and TP 1, page_first and page_first_direct; MLA pages under an
    # MHA config are left to their bytes (`__k`) or fit as bytes do. Clean: exit 0. The hybrid's
    # keys name another model: this config is not theirs.
    model = tmp_path / "Qwen3-0.6B"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "model_type": "qwen3", "hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 64,
        "num_hidden_layers": 2, "torch_dtype": "bfloat16"}))
    code, document = _scan_with_warmup_keys(cli_args, namespace, "--model-config", str(model))
    assert code == 0 and document["findings"] == []
    decoded = {record["key"]: record["evidence"].get("decoded", {}) for record in document["keys"]
               if record["key"].startswith(namespace)}
    for key, found in decoded.items():
        setup = setups[key[len(namespace):].split("_", 1)[0]]
        if setup["mla"] or setup.get("hybrid"):
            continue
        row = setup["kv_heads_per_rank"] * setup["head_dim"]
        assert {"bytes_per_number": 2, "page_tokens": 4, "layers": 2, "numbers_per_token_and_layer": row} \
            in found["sglang_page"]["fits"], key
        assert found["reading"]["dtypes"][0] == "bfloat16" and "float32" not in found["reading"]["dtypes"], key
    # 12 at TP 2, 6 direct, and mla-pp2's 6 `_{n}_k`: an MHA config reads n as a TP rank (the
    # model's name is the test's, shared by both pools); `__k` is no MHA pool's, and left alone.
    assert sum("sglang_page" in found for found in decoded.values()) == 24

    # By the hybrid's own config: its 12 keys, KV and Mamba pools.
    _hybrid_checks(cli_args, namespace, tmp_path, hybrid)


@pytest.mark.parametrize("kv_heads, verdict, code", [(1, "EXPECTED_DUPLICATE", 0), (2, "SHARED_CONTENT", 1)])
def test_the_model_config_decides_which_workers_share_a_head(publisher, cli_args, namespace, tmp_path, kv_heads,
                                                              verdict, code):
    """One chunk, TP 2, both workers' bytes identical: alone it could be either; the config says."""
    config = _tiny_llama_config(tmp_path, kv_heads)
    values = lmcache_prompt(namespace, 14, chunks=1, world=2, replicated=True)
    _publish(publisher, values)
    found, document = scan_json(cli_args, "--prefix", namespace, "--all", "--model-config", str(config),
                                "--fail-on", "warning")  # SHARED_CONTENT is a warning (docs/verdicts.md#severity)
    assert found == code and {r["key"]: r["verdicts"] for r in document["keys"]} == {key: [verdict] for key in values}


def _tiny_llama_config(tmp_path: Path, kv_heads: int) -> Path:
    """MODEL's config: 2 layers, KV heads of 64."""
    config = tmp_path / "tiny-llama" / "config.json"
    config.parent.mkdir()
    config.write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 128,
                                  "num_attention_heads": 2, "num_key_value_heads": kv_heads, "head_dim": 64,
                                  "num_hidden_layers": 2, "intermediate_size": 256, "vocab_size": 1000,
                                  "torch_dtype": "float32"}))
    return config


def test_headerless_values_are_read_by_the_model_config(publisher, cli_args, namespace, tmp_path):
    """save_chunk_meta false, save_unfull_chunk, TP 2 with 1 KV head: with --model-config each value is
    [2, 2, tokens, 64] float32; faults beside them are each flagged exactly."""
    values = lmcache_prompt(namespace, 15, chunks=3, world=2, replicated=True, header=False, last_tokens=100)
    rng = np.random.default_rng(16)
    nan = kv_chunk(rng)
    nan[1, 1, 7, 3] = np.nan  # layer 1's V

    def key(chunk_hash: int) -> str:  # TP 1: a chunk of one key
        return lmcache_key(f"{namespace}{MODEL}", 1, 0, chunk_hash, "float")

    faults = {
        key(0xF1): ("ZERO_VALUE", bytes(262_144)),
        key(0xF2): ("NONFINITE", lmcache_value(nan, header=False)),
        key(0xF3): ("SIZE_MISMATCH", lmcache_value(kv_chunk(rng), header=False)[:-1000]),  # not a whole token
    }
    _publish(publisher, values | {name: value for name, (_, value) in faults.items()})
    code, document = scan_json(cli_args, "--prefix", namespace, "--all", "--model-config",
                               str(_tiny_llama_config(tmp_path, 1)))
    assert code == 1
    assert {r["key"]: r["verdicts"] for r in document["findings"]} == {name: [v] for name, (v, _) in faults.items()}
    found = by_key(document)
    shapes = sorted(tuple(found[name]["evidence"]["decoded"]["headerless"]["shape"]) for name in values)
    assert shapes == [(2, 2, 100, 64)] * 2 + [(2, 2, 256, 64)] * 4
    assert all(found[name]["layout"].startswith("lmcache KV_2LTD headerless") for name in values)
    assert all(found[name]["verdicts"] == ["EXPECTED_DUPLICATE"] for name in values)  # each worker's copy of the head
    assert document["summary"]["expected_duplicate_groups"] == 3
    assert [r["segment"] for r in found[key(0xF2)]["evidence"]["nonfinite"]["regions"]] == ["v.layers.1"]
    assert found[key(0xF3)]["evidence"]["size_mismatch"] == {
        "value_size": 261_144, "bytes_per_token": 1024, "tokens": 255.023,
        "expected_size": "a positive multiple of 1024"}
