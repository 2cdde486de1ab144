"""The #53084 verdicts on a real cluster: values laid out like vLLM's, with and without block tables."""

from __future__ import annotations

import json

import numpy as np
import pytest

from audit.keys import vllm_key
from audit.layouts import layouts_from_hf_config
from tests.helpers import by_key, run_cli, scan_json

TINY_MAMBA = {"model_type": "mamba", "hidden_size": 32, "intermediate_size": 64, "state_size": 4,
              "conv_kernel": 4, "num_hidden_layers": 3}
# Per layer: conv (3, 64) bf16 = 384 bytes, ssm (64, 4) float32 = 1,024 bytes; 3 layers = 4,224 bytes.
LAYOUT = layouts_from_hf_config(TINY_MAMBA, model="tiny-mamba", ssm_dtype="float32")[0]
NAN_BF16, INF_BF16 = 0x7FC0, 0x7F80


def _value(rng, edit=None) -> np.ndarray:
    """A plausible state value: every region filled with small non-zero numbers."""
    value = np.zeros(LAYOUT.size, np.uint8)
    for segment, region in LAYOUT.regions():
        view = value[region.offset: region.offset + region.length]
        numbers = (rng.standard_normal(region.length // 4) * 0.1).astype(np.float32)
        if region.dtype == "float32":
            view[:] = numbers.view(np.uint8)
        else:  # bfloat16: the top half of float32
            bf16 = (rng.standard_normal(region.length // 2).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
            view[:] = bf16.view(np.uint8)
        if edit:
            edit(segment, region, view)
    return value


def _zero_layer(layer):
    def edit(segment, region, view):
        if segment.layer == layer:
            view[:] = 0
    return edit


def _poke(layer, name, word_bits, dtype=np.uint16):
    def edit(segment, region, view):
        if segment.layer == layer and region.name == name:
            view[: np.dtype(dtype).itemsize] = np.array([word_bits], dtype).view(np.uint8)
    return edit


def _tricky(segment, region, view):
    if region.name == "ssm":
        words = view.view(np.float32).reshape(64, 4)
        words[5] = 0.0                      # an all-zero row
        words[::2] = 0.0                    # half the elements exactly zero
        words[1, :] = np.float32(1e-30)     # tiny values
    if region.name == "conv" and segment.layer == 2:
        view[:2] = 0                        # a single zero element


@pytest.fixture
def workload(publisher, namespace, tmp_path):
    """Keys with known defects, the config directory, and the producer's block table."""
    rng = np.random.default_rng(5)
    garbage = _value(rng)
    cases = {
        "good": (_value(rng), 3),
        "good-tricky": (_value(rng, _tricky), 4),
        "null-zero-a": (np.zeros(LAYOUT.size, np.uint8), 0),
        "null-zero-b": (np.zeros(LAYOUT.size, np.uint8), 0),
        "null-garbage-a": (garbage, 0),
        "null-garbage-b": (garbage.copy(), 0),
        "partial": (_value(rng, _zero_layer(1)), 5),
        "nan-ssm": (_value(rng, _poke(2, "ssm", 0x7FC00000, np.uint32)), 6),
        "inf-conv": (_value(rng, _poke(0, "conv", INF_BF16)), 7),
        "truncated": (_value(rng)[:-1024], 8),
        "truncated-zero": (np.zeros(LAYOUT.size - 1024, np.uint8), 9),
    }
    keys = {}
    for name, (value, block) in cases.items():
        key = vllm_key("tiny-mamba", name.encode().hex(), cache_prefix=namespace.rstrip("/"))
        publisher.put(key, value)
        keys[name] = (key, block)
    opaque = namespace + "opaque-zero-sized-like-a-state"
    publisher.put(opaque, np.zeros(LAYOUT.size, np.uint8))
    model_dir = tmp_path / "tiny-mamba"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(TINY_MAMBA))
    table = tmp_path / "tables.jsonl"
    table.write_text("".join(json.dumps({"key": key, "block_id": block}) + "\n" for key, block in keys.values()))
    return {name: key for name, (key, _) in keys.items()}, opaque, model_dir, table


EXPECTED_WITHOUT_TABLES = {
    "good": [], "good-tricky": [],
    "null-zero-a": ["ZERO_STATE"], "null-zero-b": ["ZERO_STATE"],
    "null-garbage-a": ["SHARED_CONTENT"], "null-garbage-b": ["SHARED_CONTENT"],
    "partial": ["PARTIAL_ZERO"], "nan-ssm": ["NONFINITE"], "inf-conv": ["NONFINITE"],
    "truncated": ["SIZE_MISMATCH"], "truncated-zero": ["SIZE_MISMATCH", "ZERO_VALUE"],
}


def _layout_args(model_dir):
    return ["--model-config", str(model_dir), "--ssm-dtype", "float32"]


def test_verdicts_from_bytes_and_layout_alone(cli_args, namespace, workload):
    keys, opaque, model_dir, _ = workload
    code, report = scan_json(cli_args, "--prefix", namespace.rstrip("/"), *_layout_args(model_dir), "--all")
    records = by_key(report)
    assert {name: sorted(records[key]["verdicts"]) for name, key in keys.items()} == EXPECTED_WITHOUT_TABLES
    assert records[opaque]["verdicts"] == ["ZERO_VALUE"] and "layout" not in records[opaque]
    assert code == 1
    partial = records[keys["partial"]]
    assert partial["evidence"]["partial_zero"] == {"zero_layers": [1], "layers": 3}
    nan = records[keys["nan-ssm"]]["evidence"]["nonfinite"]
    assert (nan["nan"], nan["inf"]) == (1, 0) and nan["regions"][0]["region"] == "ssm"
    assert records[keys["inf-conv"]]["evidence"]["nonfinite"]["inf"] == 1
    assert records[keys["truncated"]]["evidence"]["size_mismatch"] == {"expected": 4224, "actual": 3200}
    regions = records[keys["good"]]["regions"]
    assert [(r["segment"], r["region"], r["length"], r["dtype"]) for r in regions[:2]] == [
        ("layers.0", "conv", 384, "bfloat16"), ("layers.0", "ssm", 1024, "float32")]
    assert len(regions) == 6 and report["summary"]["layouts"][0].startswith("tiny-mamba group 0 (mamba1, TP 1): 4,224")


def test_block_tables_add_null_backed_with_evidence(cli_args, namespace, workload):
    keys, _, model_dir, table = workload
    code, report = scan_json(cli_args, "--prefix", namespace.rstrip("/"), *_layout_args(model_dir),
                             "--block-tables", str(table), "--all")
    records = by_key(report)
    null_backed = {name for name, key in keys.items() if "NULL_BACKED" in records[key]["verdicts"]}
    assert null_backed == {"null-zero-a", "null-zero-b", "null-garbage-a", "null-garbage-b"}
    assert records[keys["null-zero-a"]]["evidence"]["null_backed"] == {"null_block_id": 0, "bytes_zero": True,
                                                                      "state_zero": True}
    assert records[keys["null-garbage-a"]]["evidence"]["null_backed"]["bytes_zero"] is False
    assert records[keys["good"]]["verdicts"] == [] and records[keys["good"]]["evidence"]["block_table"]["block_ids"] == [3]
    assert report["summary"]["block_tables"]["null_backed_keys"] == 4


def test_crossref_adds_the_same_verdicts_offline(cli_args, namespace, workload, tmp_path):
    keys, _, model_dir, table = workload
    scanned = tmp_path / "scan.json"
    run_cli("scan", *cli_args, "--prefix", namespace.rstrip("/"), *_layout_args(model_dir), "--all",
            "--format", "json", "--output", str(scanned), "--no-progress")
    result = run_cli("crossref", str(scanned), "--block-tables", str(table), "--format", "json", "--all")
    assert result.exit_code == 1
    records = by_key(json.loads(result.stdout))
    assert records[keys["null-zero-b"]]["verdicts"] == ["NULL_BACKED", "ZERO_STATE"]
    assert records[keys["null-garbage-b"]]["verdicts"] == ["NULL_BACKED", "SHARED_CONTENT"]
    assert records[keys["good"]]["verdicts"] == []
    summary = json.loads(result.stdout)["summary"]
    assert summary["crossref"]["report_lists_every_key"] is True and summary["block_tables"]["keys_not_in_store"] == 0


def test_layout_for_all_applies_to_renamed_models(publisher, cli_args, namespace, workload):
    _, _, model_dir, _ = workload
    renamed = vllm_key("tiny-mamba-renamed", "ff", cache_prefix=namespace.rstrip("/"))
    publisher.put(renamed, np.zeros(LAYOUT.size, np.uint8))
    _, plain = scan_json(cli_args, "--prefix", namespace.rstrip("/"), *_layout_args(model_dir), "--all")
    assert by_key(plain)[renamed]["verdicts"] == ["ZERO_VALUE"]
    _, for_all = scan_json(cli_args, "--prefix", namespace.rstrip("/"), *_layout_args(model_dir), "--all",
                           "--layout-for-all")
    assert by_key(for_all)[renamed]["verdicts"] == ["ZERO_STATE"]


def test_explain_shows_regions_stats_and_block_table(cli_args, workload):
    keys, _, model_dir, table = workload
    result = run_cli("explain", keys["nan-ssm"], *cli_args, *_layout_args(model_dir), "--block-tables", str(table),
                     "--format", "json")
    assert result.exit_code == 1, result.output
    document = json.loads(result.stdout)
    assert document["verdicts"] == ["NONFINITE"]
    ssm = [r for r in document["regions"] if r["segment"] == "layers.2" and r["region"] == "ssm"][0]
    assert ssm["nan"] == 1 and ssm["hexdump"].startswith("00 00 c0 7f")
    assert ssm["stats"]["min"] < 0 < ssm["stats"]["max"]
    assert document["block_table_records"][0]["block_ids"] == [6]
    human = run_cli("explain", keys["null-zero-a"], *cli_args, *_layout_args(model_dir))
    assert human.exit_code == 1 and "ZERO_STATE" in human.stdout and "layers.2" in human.stdout


def test_layout_errors_are_one_line(cli_args, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "plamo2", "mamba_d_state": 16}))
    result = run_cli("scan", *cli_args, "--model-config", str(tmp_path))
    assert result.exit_code == 2 and "not supported" in result.stderr and result.stderr.count("\n") == 1
