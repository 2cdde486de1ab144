"""Acceptance for the #53084 detector: simulated producer workloads (real Mamba recurrences,
align-mode sparse block tables, null-backed keys and other damage) published into the real
cluster; every labelled bad key gets exactly its expected verdicts and no good key is flagged.
"""

from __future__ import annotations

import pytest

from audit.simulate import TINY_MAMBA1, TINY_MAMBA2, SimulationOptions, simulate
from tests.helpers import by_key, scan_json

WORKLOADS = [
    # (model config, model name, options beyond the namespace)
    (TINY_MAMBA1, "tiny-mamba1", dict(seed=1, tp_size=1, inject_nan=2, truncate=2, zero_layers=2, tricky_good=3)),
    (TINY_MAMBA1, "tiny-mamba1", dict(seed=2, tp_size=2, null_block_fill="garbage", inject_nan=1, zero_layers=1,
                                      tricky_good=3, ssm_dtype="float32")),
    (TINY_MAMBA2, "tiny-mamba2", dict(seed=3, tp_size=1, truncate=1, zero_layers=2, tricky_good=3)),
    (TINY_MAMBA2, "tiny-mamba2", dict(seed=4, tp_size=2, null_block_fill="garbage", inject_nan=2, tricky_good=3)),
    (TINY_MAMBA1, "tiny-mamba1", dict(seed=5, tp_size=2, block_size=16, tokens=3072, requests=1,
                                      null_boundaries=(2112, 2960, 3024), inject_nan=1)),
]


def _precision_recall(labels, records, expected_of) -> tuple[float, float, dict]:
    wrong = {}
    flagged_right = flagged = bad = 0
    for label in labels:
        got = sorted(records[label.key]["verdicts"]) if label.key in records else []
        expected = sorted(expected_of(label))
        if got != expected:
            wrong[label.key] = (label.cause, expected, got)
        if got:
            flagged += 1
            flagged_right += bool(expected)
        bad += bool(expected)
    caught = sum(1 for label in labels if expected_of(label) and label.key not in wrong)
    return flagged_right / max(flagged, 1), caught / max(bad, 1), wrong


@pytest.mark.parametrize("config, model, extra", WORKLOADS, ids=[f"{m}-seed{e['seed']}-tp{e['tp_size']}"
                                                                 for _, m, e in WORKLOADS])
def test_every_labelled_key_gets_its_verdicts(publisher, cli_args, namespace, tmp_path, config, model, extra):
    prefix = namespace.rstrip("/")
    result = simulate(publisher, model_config=config, model=model, out_dir=tmp_path,
                      options=SimulationOptions(cache_prefix=prefix, **extra))
    assert result.counts.get("null_block", 0) >= 2
    layout_args = ["--prefix", prefix, "--layout", str(result.layout_path), "--all"]

    code, without = scan_json(cli_args, *layout_args)
    precision, recall, wrong = _precision_recall(result.labels, by_key(without), lambda l: l.expected_without_tables)
    assert wrong == {} and (precision, recall) == (1.0, 1.0)
    assert code == 1

    _, with_tables = scan_json(cli_args, *layout_args, "--block-tables", str(result.block_tables_path.parent))
    precision, recall, wrong = _precision_recall(result.labels, by_key(with_tables), lambda l: l.expected_with_tables)
    assert wrong == {} and (precision, recall) == (1.0, 1.0)
    null_keys = {label.key for label in result.labels if label.null_backed}
    assert {r["key"] for r in with_tables["keys"] if "NULL_BACKED" in r["verdicts"]} == null_keys
    records = by_key(with_tables)
    assert all(records[label.key]["evidence"]["block_table"]["boundary_tokens"] == label.boundary
               for label in result.labels)
    if extra.get("null_boundaries"):
        boundaries = {label.boundary for label in result.labels if label.null_backed}
        assert {2112, 2960, 3024} <= boundaries
