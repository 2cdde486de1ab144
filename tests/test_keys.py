import pytest

from audit.keys import parse_key, vllm_key


def test_vllm_key_with_group_and_prefix_round_trips():
    key = vllm_key("Qwen3.5-9B", "a1b2", tp_rank=1, group=2, cache_prefix="tenant@x")
    assert key == "tenant@x@Qwen3.5-9B@tp_rank:1@pcp0@dcp0@pp_rank:0@group:2@a1b2"
    assert parse_key(key) == {"scheme": "vllm", "cache_prefix": "tenant@x", "model": "Qwen3.5-9B",
                              "tp_rank": 1, "pcp": 0, "dcp": 0, "pp_rank": 0, "group": 2, "chunk_hash": "a1b2"}


def test_vllm_key_from_releases_without_group():
    fields = parse_key("mamba-130m-hf@tp_rank:0@pcp0@dcp0@pp_rank:3@ff00")
    assert fields["scheme"] == "vllm" and "group" not in fields and fields["pp_rank"] == 3


def test_lmcache_keys_new_and_old():
    assert parse_key("Llama-3@8@3@1a2b@bfloat16@lora%x") == {
        "scheme": "lmcache", "model": "Llama-3", "world_size": 8, "worker_id": 3, "chunk_hash": "1a2b",
        "dtype": "bfloat16", "tags": {"lora": "x"}}
    old = parse_key("vllm@Llama-3@8@3@-1a2b@half")
    assert old["scheme"] == "lmcache" and old["fmt"] == "vllm" and old["chunk_hash"] == "-1a2b"


def test_sglang_hicache_keys():
    assert parse_key("deadbeefdeadbeef00_1_k") == {
        "scheme": "sglang", "page_hash": "deadbeefdeadbeef00", "shard": 1, "part": "k"}
    mamba = parse_key("tag_model_deadbeefdeadbeef00_1_2_conv_0")
    assert mamba["prefix"] == "tag_model" and mamba["pp_rank"] == 2 and mamba["part"] == "conv_0"
    assert parse_key("deadbeefdeadbeef00_0_temporal")["part"] == "temporal"


def test_anything_else_is_opaque():
    for key in ["hello", "a@b", "x\n@tp_rank:0", "", "[red]x[/]"]:
        assert parse_key(key) == {"scheme": "opaque"}


# Store-TP namespaces (vLLM 0.32.0 store/worker.py _select_store_tp_layout) sit between the model
# and @tp_rank: they must parse, and never leak into cache_prefix/model.
@pytest.mark.parametrize("namespace, extra", [
    ("@store_pp:1@store_format:tp_shared_mqa", {"store_pp": 1, "store_format": "tp_shared_mqa"}),
    ("@store_tp:4@store_pp:1@store_format:tp_shared_lbhnc",
     {"store_tp": 4, "store_pp": 1, "store_format": "tp_shared_lbhnc"}),
    ("@store_tp:8@store_pp:2@store_format:tp_shared_lbnhc",
     {"store_tp": 8, "store_pp": 2, "store_format": "tp_shared_lbnhc"}),
    ("@store_pp:1@store_format:rank_local_tp2_layout_LBHNC",
     {"store_pp": 1, "store_format": "rank_local_tp2_layout_LBHNC", "producer_tp": 2}),
])
@pytest.mark.parametrize("cache_prefix", ["", "team@a"])
def test_store_tp_keys_parse(namespace, extra, cache_prefix):
    key = vllm_key("Qwen3-8B", "ab12", tp_rank=3, group=1, cache_prefix=cache_prefix, store_namespace=namespace)
    expected = {"scheme": "vllm", "model": "Qwen3-8B", "tp_rank": 3, "pcp": 0, "dcp": 0, "pp_rank": 0,
                "group": 1, "chunk_hash": "ab12", **extra}
    if cache_prefix:
        expected["cache_prefix"] = cache_prefix
    assert parse_key(key) == expected


@pytest.mark.parametrize("key", [
    "m@store_pp:1@store_format:unknown_format@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@ab12",
    "m@store_format:tp_shared_mqa@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@ab12",  # no store_pp
    "m@tp_rank:x@pcp0@dcp0@pp_rank:0@group:0@ab12",
    "m@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@not-hex",
    "m@tp_rank:0@pcp0@dcp0@group:0@ab12",  # no pp_rank
])
def test_near_vllm_keys_are_unparsed_not_half_parsed(key):
    assert parse_key(key) == {"scheme": "opaque"}


# LMCache, as its own code names keys (tests/producers/lmcache_0_5_6.json).
def test_lmcache_keys_from_lmcaches_own_code():
    from tests.producers.writers import GOLDEN

    keys = GOLDEN["keys"]
    assert parse_key(keys["negative_hash"]) == {
        "scheme": "lmcache", "model": "/models/tiny-llama", "world_size": 2, "worker_id": 1,
        "chunk_hash": "-5db65aa1f24507d4", "dtype": "float"}
    assert parse_key(keys["tags"])["tags"] == {"user": "alice", "lora": "x%y"}
    assert parse_key(keys["layerwise"]) == {
        "scheme": "lmcache", "model": "Qwen/Qwen3-0.6B", "world_size": 2, "worker_id": 1, "chunk_hash": "99",
        "dtype": "bfloat16", "layer": 3}
    assert parse_key(keys["layerwise_tags"]) == {
        "scheme": "lmcache", "model": "m", "world_size": 1, "worker_id": 0, "chunk_hash": "-99",
        "dtype": "fp8_e4m3fn", "layer": 11, "tags": {"user": "bob"}}


def test_lmcache_object_keys_of_multiprocess_mode():
    assert parse_key("m@01000100@3@00ff@tenant-a") == {
        "scheme": "lmcache", "model": "m", "kv_rank": "01000100", "object_group": 3, "chunk_hash": "00ff",
        "cache_salt": "tenant-a", "world_size": 1, "worker_id": 0, "local_world_size": 1, "local_rank": 0}


H = "ab" * 32  # a page hash (sha256 hex)


@pytest.mark.parametrize("key, fields", [
    (f"{H}_1_v", {"tp_rank": 1, "part": "v"}),
    (f"{H}_1_k", {"shard": 1, "part": "k"}),              # an MHA pool's TP rank, or an MLA pool's PP rank
    (f"{H}__k", {"part": "k"}),                           # MLA without PP
    (f"{H}_0_2_k", {"tp_rank": 0, "pp_rank": 2, "part": "k"}),
    (f"{H}_dcp1_cp0_2_k", {"dcp_rank": 1, "cp_rank": 0, "pp_rank": 2, "part": "k"}),
    (f"{H}_3_draft_k", {"shard": 3, "part": "draft_k"}),
    (f"{H}_3_draft_v", {"tp_rank": 3, "part": "draft_v"}),
    (f"{H}__draft_k", {"part": "draft_k"}),
    (f"{H}_0_swa_k", {"tp_rank": 0, "part": "swa_k"}),
    (f"{H}_1_swa", {"pp_rank": 1, "part": "swa"}),         # MLA's single-object SWA pool
    (f"{H}_2_temporal", {"tp_rank": 2, "part": "temporal"}),
    (f"{H}_2_1_conv_0", {"tp_rank": 2, "pp_rank": 1, "part": "conv_0"}),
    (f"{H}__indexer", {"part": "indexer"}),
    (f"{H}_1_deepseek_v4_c4_indexer", {"pp_rank": 1, "part": "deepseek_v4_c4_indexer"}),
])
def test_sglang_key_grammar(key, fields):
    assert parse_key(key) == {"scheme": "sglang", "page_hash": H, **fields}
    assert parse_key(f"tag_Qwen-Qwen3-8B_{key}") == {"scheme": "sglang", "prefix": "tag_Qwen-Qwen3-8B",
                                                     "page_hash": H, **fields}


def test_sglang_warmup_keys():
    assert parse_key("sglang_mooncake_store_warmup_key" + "0f" * 16) == {"scheme": "sglang", "warmup": True}
    assert parse_key("sglang_mooncake_store_warmup_keyXYZ") == {"scheme": "opaque"}


@pytest.mark.parametrize("key", [
    f"{H}_1_x", f"{H}_1_", f"{H}_k", "m@1@0@ab@float32", "m@1@0@ab@half@user", "m@x@0@ab@half",
    "m@0100010@0@00ff", "m@01000100@0@0ff", "\x00@1@0@ab@half@%" + "\n",
])
def test_near_producer_keys_are_opaque(key):
    assert parse_key(key) == {"scheme": "opaque"}


@pytest.mark.parametrize("text", ["", "0", "deadBEEF", "4c499327637fdb82000000000000b3fa", "0x1f", "ab\n", " ab",
                                  "ab ", "1_2", "-1", "+f", "é", "ＡＢ", "g", "abc@", "١٢"])
def test_a_chunk_hash_is_hex_digits_as_the_pattern_reads_them(text):
    """`is_hex` (what splits every listed key's stem from its chunk hash) against the regular
    expression it stands in for."""
    import re

    from audit.producers.vllm import is_hex, split_stem

    assert is_hex(text) == bool(re.fullmatch(r"[0-9a-fA-F]+", text))
    assert split_stem(f"m@tp_rank:0@{text}") == (("m@tp_rank:0", text) if is_hex(text) else None)


@pytest.mark.parametrize("key", [
    vllm_key("Qwen/Qwen3-0.6B", "ab12"), vllm_key("m", "ff", group=2, cache_prefix="tenant@a"),
    vllm_key("m", "ff", store_namespace="@store_tp:2@store_pp:0@store_format:tp_shared_lbhnc"),
    "m@tp_rank:x@pp_rank:0@ab",            # vLLM's markers, not its shape: nobody's
    "m@store_pp:1@00", "fmt@model@1@0@ab12",  # the first a claim, the second LMCache's
    "sglang_0_k", "tenant/plain-key", "",
])
def test_a_key_vllm_claims_is_one_its_parser_answers_for(key):
    """`claims` (the cheap look that lets vLLM's keys skip being read by a model config) is true
    exactly where vLLM's parser answers, with vLLM's fields or as nobody's."""
    from audit.producers import parse_key
    from audit.producers.vllm import VLLM, claims

    assert claims(key) == (VLLM().parse(key) is not None)
    if claims(key):
        assert parse_key(key)["scheme"] in ("vllm", "opaque")


def test_a_vllm_key_naming_a_configured_model_is_not_read_by_the_config():
    """A config's model in a vLLM key's name does not make its value one to read by that config
    (LMCache's and SGLang's are): vLLM's values are read by their layouts."""
    from audit.judge.values import may_be_configured

    configs = {"Qwen3-0.6B": {}}
    assert not may_be_configured(vllm_key("Qwen/Qwen3-0.6B", "ab12"), configs)
    assert may_be_configured("vllm@Qwen3-0.6B@1@0@ab12", configs)
    assert not may_be_configured("vllm@other@1@0@ab12", configs)
