"""The producer simulator: what it publishes, what its block tables and labels say, and that the
states are real recurrences. Cluster tests use the session cluster with their own cache_prefix."""

from __future__ import annotations

import json

import numpy as np
import pytest

from audit.blocktables import NULL_BLOCK_ID, read_block_tables
from audit.errors import AuditError
from audit.layouts import load_layout_file
from audit.simulate import (MAMBA_130M, REPORTED_NULL_BOUNDARIES, TINY_MAMBA1, TINY_MAMBA2,
                            SimulationOptions, build_workload, read_labels, simulate)
from audit.simulate.faults import TRUNCATED_BYTES
from tests.layouts.configs import QWEN3_NEXT

ALL_TREATMENTS = dict(inject_nan=2, truncate=2, zero_layers=2, tricky_good=3)


def _decode(raw: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return raw.view({"float16": np.float16, "float32": np.float32}[dtype]).astype(np.float32)


def _regions(layout, value: np.ndarray) -> dict[tuple[int, str], np.ndarray]:
    """(layer, region name) -> decoded state, shaped as the layout says."""
    return {(segment.layer, region.name):
            _decode(value[region.offset:region.offset + region.length], region.dtype).reshape(region.shape)
            for segment, region in layout.regions() if region.kind == "state"}


def _stored(publisher, key: str) -> bytes:
    return publisher.store.get(key)


def test_publishes_the_labelled_workload(publisher, namespace, tmp_path):
    options = SimulationOptions(tp_size=2, seed=3, cache_prefix=namespace, **ALL_TREATMENTS)
    result = simulate(publisher, model_config=TINY_MAMBA1, model="/models/tiny-mamba",
                      out_dir=tmp_path, options=options)
    workload = build_workload(TINY_MAMBA1, "/models/tiny-mamba", options)
    layout = result.layout

    assert layout.model == "tiny-mamba" and layout.size == 4 * (3 * 32 + 32 * 16) * 2
    assert result.keys == tuple(entry.label.key for entry in workload.entries)
    assert all(key.startswith(f"{namespace}@tiny-mamba@tp_rank:") and "@group:0@" in key
               for key in result.keys)
    assert {cause: result.counts[cause] for cause in ("nan", "truncated", "zeroed_layer", "tricky_good")} == \
        {"nan": 2, "truncated": 2, "zeroed_layer": 2, "tricky_good": 3}
    assert sum(result.counts.values()) == len(result.keys) and result.counts["null_block"] >= 4
    assert read_labels(result.labels_path) == list(result.labels)
    assert load_layout_file(result.layout_path)[0] == layout
    for entry in workload.entries:
        stored = _stored(publisher, entry.label.key)
        expected_size = layout.size - (TRUNCATED_BYTES if entry.label.cause == "truncated" else 0)
        assert len(stored) == expected_size == entry.value.size
        assert stored == entry.value.tobytes()
        if entry.label.null_backed:
            assert not any(stored)

    tables = read_block_tables([result.block_tables_path.parent])
    assert set(tables.entries) == set(result.keys)
    assert {key for key, entry in tables.entries.items() if entry.null_backed} == \
        {label.key for label in result.labels if label.null_backed}
    real_blocks = [label.block_id for label in result.labels if label.tp_rank == 0 and not label.null_backed]
    assert min(real_blocks) >= 1 and len(set(real_blocks)) == len(real_blocks)


def test_reported_boundaries_are_null_backed_and_share_garbage(publisher, namespace, tmp_path):
    options = SimulationOptions(requests=1, tokens=3072, block_size=16, tp_size=2, seed=5,
                                null_boundaries=REPORTED_NULL_BOUNDARIES, null_block_fill="garbage",
                                cache_prefix=namespace)
    result = simulate(publisher, model_config=TINY_MAMBA2, model="tiny-mamba2", out_dir=tmp_path,
                      options=options)

    at_reported = [label for label in result.labels if label.boundary in REPORTED_NULL_BOUNDARIES]
    assert len(at_reported) == 6 and all(label.null_backed for label in at_reported)
    assert all(label.expected_with_tables == ["NULL_BACKED", "SHARED_CONTENT"] for label in at_reported)
    tables = [json.loads(line) for line in result.block_tables_path.open()]
    assert [table["tp_rank"] for table in tables] == [0, 1]
    for boundary in REPORTED_NULL_BOUNDARIES:
        assert all(table["block_ids"][boundary // 16 - 1] == NULL_BLOCK_ID for table in tables)

    null_bytes = {rank: {_stored(publisher, label.key) for label in result.labels
                         if label.null_backed and label.tp_rank == rank} for rank in (0, 1)}
    assert all(len(contents) == 1 for contents in null_bytes.values())  # one block 0 per rank
    assert null_bytes[0] != null_bytes[1]
    for (garbage,) in null_bytes.values():
        assert len(garbage) == result.layout.size and np.count_nonzero(np.frombuffer(garbage, np.uint8))


def test_same_seed_same_workload():
    options = SimulationOptions(tokens=1000, tp_size=2, null_block_fill="garbage", **ALL_TREATMENTS)
    first, second = (build_workload(TINY_MAMBA2, "m", options) for _ in range(2))
    assert [e.label for e in first.entries] == [e.label for e in second.entries]
    assert all(np.array_equal(a.value, b.value) for a, b in zip(first.entries, second.entries))
    assert first.block_tables == second.block_tables
    other = build_workload(TINY_MAMBA2, "m", SimulationOptions(tokens=1000, tp_size=2, seed=1))
    assert not {e.label.key for e in other.entries} & {e.label.key for e in first.entries}


@pytest.mark.parametrize("config", [TINY_MAMBA1, TINY_MAMBA2], ids=["mamba1", "mamba2"])
def test_states_are_real_recurrences(config):
    workload = build_workload(config, "m", SimulationOptions(tokens=1500, block_size=64, seed=2))
    good = [entry for entry in workload.entries if entry.label.cause is None]
    assert len(good) >= 8
    previous = None
    for entry in good:
        states = _regions(workload.layout, entry.value)
        for (layer, name), state in states.items():
            assert np.isfinite(state).all() and np.count_nonzero(state) > 0.9 * state.size
        if previous is not None and previous[0] == entry.label.req_id:
            assert all(not np.array_equal(state, previous[1][where]) for where, state in states.items())
        previous = (entry.label.req_id, states)


@pytest.mark.parametrize("config", [TINY_MAMBA1, TINY_MAMBA2, {**TINY_MAMBA2, "n_groups": 1}],
                         ids=["mamba1", "mamba2", "mamba2-one-group"])
def test_tp_ranks_hold_vllm_slices_of_the_tp1_state(config):
    def good_states(tp_size):
        workload = build_workload(config, "m", SimulationOptions(tokens=600, block_size=64, tp_size=tp_size))
        return {(e.label.boundary, e.label.tp_rank): _regions(workload.layout, e.value)
                for e in workload.entries if e.label.cause is None}

    whole, shards = good_states(1), good_states(2)
    inner, n = 64, 16
    groups = config.get("n_groups", 0)
    for (boundary, rank), states in shards.items():
        full = whole[(boundary, 0)]
        for layer in range(4):
            conv, ssm = full[(layer, "conv")], full[(layer, "ssm")]
            x = conv[:, rank * inner // 2:(rank + 1) * inner // 2]
            if config is TINY_MAMBA1:
                expected_conv, rows = x, ssm[rank * inner // 2:(rank + 1) * inner // 2]
            else:  # x | B | C of the rank's group (the one group, replicated, when n_groups == 1)
                group = rank if groups == 2 else 0
                b = conv[:, inner + group * n:inner + (group + 1) * n]
                c = conv[:, inner + groups * n + group * n:inner + groups * n + (group + 1) * n]
                expected_conv, rows = np.concatenate([x, b, c], axis=1), ssm[rank * 4:(rank + 1) * 4]
            np.testing.assert_array_equal(states[(layer, "conv")], expected_conv)
            np.testing.assert_array_equal(states[(layer, "ssm")], rows)


@pytest.mark.parametrize("ssm_dtype", ["bfloat16", "float32"])
def test_damaged_and_tricky_values(ssm_dtype):
    workload = build_workload(TINY_MAMBA1, "m", SimulationOptions(ssm_dtype=ssm_dtype,
                                                                 **{**ALL_TREATMENTS, "tricky_good": 6}))
    layout = workload.layout
    seen = set()
    for entry in workload.entries:
        label, value = entry.label, entry.value
        if label.null_backed:
            continue
        if label.cause == "truncated":
            assert value.size == layout.size - TRUNCATED_BYTES
            continue
        states = _regions(layout, value)
        zero_layers = {layer for layer in range(4)
                       if not states[(layer, "conv")].any() and not states[(layer, "ssm")].any()}
        if label.cause == "nan":
            assert sum(np.isnan(state).sum() for state in states.values()) == 1
        elif label.cause == "zeroed_layer":
            assert 1 <= len(zero_layers) <= 3
        elif label.cause == "tricky_good":
            seen.add(label.detail.split(":")[0])
            ssms = [states[(layer, "ssm")] for layer in range(4)]
            if label.detail.startswith("one all-zero"):
                assert all((~ssm.any(axis=-1)).sum() == 1 for ssm in ssms)
            elif label.detail.startswith("half"):
                assert all((ssm == 0).mean() >= 0.5 for ssm in ssms)
            else:
                limit = 2e-30 if ssm_dtype == "float32" else 2.0 ** -124
                assert all(np.count_nonzero(ssm) == ssm.size and np.abs(ssm).max() < limit for ssm in ssms)
                assert all(np.abs(states[(layer, "conv")]).max() < 2.0 ** -124 for layer in range(4))
        if label.cause != "zeroed_layer":
            assert not zero_layers
        assert all(np.isfinite(state).all() for state in states.values()) or label.cause == "nan"
    assert len(seen) == 3


def test_mamba_130m_values_have_the_real_size(publisher, namespace, tmp_path):
    options = SimulationOptions(requests=1, tokens=256, block_size=64, cache_prefix=namespace)
    result = simulate(publisher, model_config=MAMBA_130M, model="state-spaces/mamba-130m-hf",
                      out_dir=tmp_path, options=options)
    assert len(result.keys) == 4 and result.bytes_published == 4 * 1_400_832
    assert all(publisher.store.get_size(key) == 1_400_832 for key in result.keys)


@pytest.mark.parametrize("config, options, message", [
    (TINY_MAMBA1, SimulationOptions(null_boundaries=(2112,)), "not a multiple of block_size"),
    (QWEN3_NEXT, SimulationOptions(), "pure Mamba1/Mamba2"),
    (TINY_MAMBA1, SimulationOptions(tokens=512, inject_nan=9), "only"),
    (TINY_MAMBA1, SimulationOptions(real_fraction=1.0, null_block_fill="garbage"), "two or more"),
    (TINY_MAMBA1, SimulationOptions(null_block_fill="ones"), "null_block_fill"),
])
def test_refuses_what_it_cannot_simulate(config, options, message):
    with pytest.raises(AuditError, match=message):
        build_workload(config, "m", options)


def test_refuses_to_publish_over_existing_keys(publisher, namespace, tmp_path):
    options = SimulationOptions(requests=1, tokens=256, block_size=64, cache_prefix=namespace)
    simulate(publisher, model_config=TINY_MAMBA1, model="m", out_dir=tmp_path / "a", options=options)
    with pytest.raises(AuditError, match="already in the store"):
        simulate(publisher, model_config=TINY_MAMBA1, model="m", out_dir=tmp_path / "b", options=options)
