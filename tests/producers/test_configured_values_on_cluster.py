"""Values that only a model config sizes, in a real Mooncake cluster, through the CLI: SGLang's host
pool pages (`--model-config` for the model its key prefix names) and LMCache's values without a
header. A healthy store scans clean; a NaN, a truncated page and a zero page beside it are each
flagged exactly; `explain` shows what the config decoded."""

from __future__ import annotations

import json

import numpy as np

from tests.helpers import by_key, run_cli, scan_json
from tests.producers.test_sglang_pages import PAGE, page, qwen
from tests.producers.writers import kv_chunk, lmcache_key, lmcache_value

NUMBERS = 16 * 2 * 64  # 16 tokens x 2 layers x 1 KV head of 64 (2 heads at TP 2)


def _model_dir(tmp_path, name: str, config: dict):
    directory = tmp_path / name
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def _sglang_pages(namespace: str, rng, pages: int = 3, *, float32: bool = False) -> dict[str, bytes]:
    """An MHA pool's pages at TP 2 under SGLang's prefix `{tag}_{model with / as -}`."""
    prefix = f"{namespace}{'f32' if float32 else 'bf16'}_Qwen-Qwen3-0.6B"
    return {f"{prefix}_{index:064x}_{rank}_{half}": page(rng, NUMBERS, bfloat16=not float32)
            for index in range(0xABC000, 0xABC000 + pages) for rank in (0, 1) for half in ("k", "v")}


def test_sglang_pages_scan_clean_by_their_config_and_faults_beside_them_are_flagged(
        publisher, cli_args, namespace, tmp_path):
    rng = np.random.default_rng(11)
    values = {**_sglang_pages(namespace, rng), **_sglang_pages(namespace, rng, float32=True)}
    for key, value in values.items():
        publisher.put(key, value)
    model = _model_dir(tmp_path, "Qwen3-0.6B", qwen())
    code, report = scan_json(cli_args, "--prefix", namespace, "--model-config", str(model))
    assert (code, report["findings"]) == (0, []), report["findings"][:2]
    assert report["summary"]["keys_scanned"] == 24

    faults = f"{namespace}faults_Qwen-Qwen3-0.6B_{PAGE}"
    nan = bytearray(page(rng, NUMBERS))
    nan[64:66] = np.array([0x7FC0], dtype=np.uint16).tobytes()
    planted = {f"{faults}_0_k": bytes(nan), f"{faults}_0_v": page(rng, NUMBERS)[:-20],
               f"{faults}_1_k": bytes(2 * NUMBERS), f"{faults}_1_v": page(rng, NUMBERS)}
    for key, value in planted.items():
        publisher.put(key, value)
    code, report = scan_json(cli_args, "--prefix", namespace, "--model-config", str(model))
    verdicts = {key: record["verdicts"] for key, record in by_key(report).items()}
    assert code == 1
    assert verdicts[f"{faults}_0_k"] == ["NONFINITE"]
    assert "SIZE_MISMATCH" in verdicts[f"{faults}_0_v"]
    assert verdicts[f"{faults}_1_k"] == ["ZERO_VALUE"]
    assert set(verdicts) <= set(planted)
    decoded = by_key(report)[f"{faults}_0_v"]["evidence"]["decoded"]["sglang_page"]
    assert decoded["pool"] == "MHA" and decoded["geometries"] == 0

    document = json.loads(run_cli("explain", f"{faults}_1_v", *cli_args, "--model-config", str(model),
                                  "--format", "json").stdout)
    page_decoded = document["evidence"]["decoded"]
    assert page_decoded["sglang_page"]["pool"] == "MHA"
    assert page_decoded["reading"]["dtypes"] == ["bfloat16", "float16"]
    assert [region["dtype"] for region in document["regions"]] == ["bfloat16"]


def test_explain_decodes_an_lmcache_value_without_a_header(publisher, cli_args, namespace, tmp_path):
    llama = {"model_type": "llama", "hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1,
             "head_dim": 64, "num_hidden_layers": 2, "torch_dtype": "float32"}
    model = _model_dir(tmp_path, "tiny-llama", llama)
    key = lmcache_key(f"{namespace}/models/tiny-llama", 1, 0, 0x5DB65AA1F24507D4, "float")
    publisher.put(key, lmcache_value(kv_chunk(np.random.default_rng(12)), header=False))
    result = run_cli("explain", key, *cli_args, "--model-config", str(model), "--format", "json")
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    assert document["evidence"]["decoded"]["headerless"]["shape"] == [2, 2, 256, 64]
    assert [region["segment"] for region in document["regions"]] == ["k.layers.0", "k.layers.1", "v.layers.0",
                                                                     "v.layers.1"]
