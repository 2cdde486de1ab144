"""A value size that fits several readings: the bytes choose where they can, and no reading the
audit merely assumed can produce a finding (issue #19). One test per class of ambiguity: attention
pages in float32 and bfloat16, padded Mamba pages, TP 1 and TP 2 sizes."""

from __future__ import annotations

import json

import numpy as np
import pytest

from audit.checks.floats import decode_floats
from audit.judge.readings import choose_reading, combine_readings
from audit.keys import vllm_key
from audit.layouts.infer import LayoutRequest, infer_layouts, observed_sizes
from audit.records import KeyInfo, KeyRecord, Verdict
from tests.helpers import by_key, scan_json
from tests.layouts.test_families import LLAMA_TINY, MAMBA2_TINY, NEMOTRON_TINY

_WIDTH = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1}
_E4M3FN = decode_floats(np.arange(256, dtype=np.uint8), "float8_e4m3fn")  # each byte's number


def _fill(layout, rng, nan_at: int | None = None) -> np.ndarray:
    """A plausible value read `layout`'s way: normal numbers in each region's dtype, zero padding;
    `nan_at`: the index of a state/KV region whose first element is NaN."""
    value = np.zeros(layout.size, np.uint8)
    for index, (_, region) in enumerate(layout.regions()):
        if region.kind == "padding":
            continue
        numbers = rng.normal(0, 0.5, region.length // _WIDTH[region.dtype]).astype(np.float32)
        if index == nan_at:
            numbers[0] = np.nan
        if region.dtype == "float32":
            raw = numbers.view(np.uint8)
        elif region.dtype == "float16":
            raw = numbers.astype(np.float16).view(np.uint8)
        elif region.dtype == "float8_e4m3fn":  # each number rounded to its nearest e4m3 (by its byte)
            finite = np.flatnonzero(np.isfinite(_E4M3FN))
            order = finite[np.argsort(_E4M3FN[finite])]
            at = np.clip(np.searchsorted(_E4M3FN[order], numbers), 1, len(order) - 1)
            nearer = np.abs(_E4M3FN[order[at - 1]] - numbers) <= np.abs(_E4M3FN[order[at]] - numbers)
            raw = np.where(nearer, order[at - 1], order[at]).astype(np.uint8)
        else:
            raw = (numbers.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
        value[region.offset: region.offset + region.length] = raw
    return value


def _readings(config, sizes, **request):
    keys = [KeyInfo(vllm_key("m", f"{group:02x}{i:02x}", group=group), size)
            for group, size in sizes.items() for i in range(2)]
    inference = infer_layouts(LayoutRequest(config, "m", **request), observed_sizes(keys))
    return inference.readings


def _says(assumed, value) -> bool:
    """A reading's setting is one value, or every value that gives the same bytes (a list)."""
    return assumed == value or (isinstance(assumed, list) and value in assumed)


def _reading(readings, **assumed):
    return next(r for r in readings if all(_says(r.assumed[name], value) for name, value in assumed.items()))


@pytest.mark.parametrize("truth", [{"kv_dtype": "float32"}, {"kv_dtype": "float16"}, {"kv_dtype": "float8_e4m3fn"}])
def test_attention_pages_in_any_dtype_are_read_as_they_were_written(truth):
    """fp8 (`--kv-cache-dtype fp8`, not given) is a reading of every attention size: its pages hold
    twice the tokens of a 16-bit page; 16-bit bytes read as fp8 hold NaN bytes, so it is dropped
    there (`test_bfloat16_and_float16_states_stay_undecided_not_guessed`)."""
    readings = _readings(LLAMA_TINY, {0: 16_384})[("m", 0)]
    written = _reading(readings, **truth)
    rng = np.random.default_rng(1)
    kept, evidence = choose_reading([r.layout for r in readings], [_fill(written.layout, rng) for _ in range(4)])
    assert [readings[i] for i in kept] == [written], evidence


def test_bfloat16_and_float16_states_stay_undecided_not_guessed():
    readings = _readings(LLAMA_TINY, {0: 16_384})[("m", 0)]
    written = _reading(readings, kv_dtype="bfloat16")
    rng = np.random.default_rng(2)
    kept, evidence = choose_reading([r.layout for r in readings], [_fill(written.layout, rng) for _ in range(4)])
    assert sorted(readings[i].assumed["kv_dtype"] for i in kept) == ["bfloat16", "float16"]
    assert evidence["rule"] == "the bytes cannot tell these readings apart"


def _boundaries(layout):
    return [(region.offset, region.length, region.kind) for _, region in layout.regions()]


@pytest.mark.parametrize("truth, exact", [
    ({"platform": "cpu", "conv_dtype": "bfloat16", "ssm_dtype": "float32"}, False),  # its float16 twin ties
    ({"platform": "cuda", "conv_dtype": "float32", "ssm_dtype": "float32"}, True),
    ({"platform": "cuda", "conv_dtype": "float32", "ssm_dtype": "float16"}, True),
])
def test_padded_mamba_pages_find_their_boundaries(truth, exact):
    readings = _readings(NEMOTRON_TINY, {0: 32_768, 1: 32_768, 2: 32_768})[("m", 0)]
    assert len(readings) > 10  # dtypes x TP sizes x platforms all fit one padded page
    written = _reading(readings, tp_size=1, **truth)
    rng = np.random.default_rng(3)
    kept, evidence = choose_reading([r.layout for r in readings], [_fill(written.layout, rng) for _ in range(4)])
    kept = [readings[i] for i in kept]
    assert written in kept and {str(_boundaries(r.layout)) for r in kept} == {str(_boundaries(written.layout))}
    assert len(kept) == (1 if exact else 2), evidence


def test_all_zero_samples_decide_nothing():
    readings = _readings(LLAMA_TINY, {0: 16_384})[("m", 0)]
    kept, evidence = choose_reading([r.layout for r in readings], [np.zeros(16_384, np.uint8)])
    assert len(kept) == len(readings) and evidence["rule"] == "no non-zero bytes to judge by"


def test_a_verdict_only_some_readings_give_is_withheld():
    def record(*verdicts):
        return KeyRecord(key="k", size=8, fields=None, xxh3=1, zero=False, verdicts=list(verdicts),
                         evidence={"nonfinite": {"nan": 1}}, regions=[{"region": "kv"}])
    combined = combine_readings(record(Verdict.NULL_BACKED, Verdict.NONFINITE), [record(Verdict.NULL_BACKED)])
    assert combined.verdicts == [Verdict.NULL_BACKED, Verdict.AMBIGUOUS_LAYOUT]
    assert combined.evidence["ambiguous_layout"]["withheld"] == ["NONFINITE"]
    assert "nonfinite" not in combined.evidence and combined.regions is None
    agreed = combine_readings(record(Verdict.NONFINITE), [record(Verdict.NONFINITE)])
    assert agreed.verdicts == [Verdict.NONFINITE] and agreed.regions == [{"region": "kv"}]


def _model_dir(tmp_path, name, config):
    directory = tmp_path / name
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def _publish(publisher, namespace, model, group, values):
    keys = []
    for index, value in enumerate(values):
        key = vllm_key(model, f"{group:02x}{index:06x}", group=group, cache_prefix=namespace.rstrip("/"))
        publisher.put(key, value)
        keys.append(key)
    return keys


def test_float32_attention_scanned_with_only_the_config_is_clean(publisher, cli_args, namespace, tmp_path):
    """The field failure: a Llama served with --dtype float32 was read as bfloat16 and flagged NONFINITE."""
    model_dir = _model_dir(tmp_path, "llama-f32", LLAMA_TINY)
    written = _reading(_readings(LLAMA_TINY, {0: 16_384})[("m", 0)], kv_dtype="float32").layout
    rng = np.random.default_rng(4)
    keys = _publish(publisher, namespace, "llama-f32", 0, [_fill(written, rng) for _ in range(24)])
    code, report = scan_json(cli_args, "--prefix", namespace.rstrip("/"), "--model-config", str(model_dir))
    assert (code, report["findings"]) == (0, []), report["findings"][:2]
    (row,) = report["summary"]["layout_inference"]
    assert (row["status"], row["assumed"]["kv_dtype"], row["assumed"]["block_size"]) == ("from_bytes", "float32", 16)
    # float32 read as float16 leaves NaN and absurd numbers: only the float32 reading decodes cleanly
    assert row["bytes"]["keys_sampled"] == 16 and row["bytes"]["rule"] == "most plausible"
    # a real NaN in a float32 page is still found, and an all-zero page still is
    bad = _publish(publisher, namespace + "bad", "llama-f32", 0, [_fill(written, rng, nan_at=1), np.zeros(16_384, np.uint8)])
    code, report = scan_json(cli_args, "--prefix", namespace.rstrip("/"), "--model-config", str(model_dir))
    records = by_key(report)
    assert code == 1 and {key: records[key]["verdicts"] for key in bad} == {bad[0]: ["NONFINITE"], bad[1]: ["ZERO_VALUE"]}
    assert len(keys) + len(bad) == report["summary"]["keys_scanned"]


def test_undecided_readings_withhold_what_depends_on_them(publisher, cli_args, namespace, tmp_path):
    """bfloat16 and float16 states look alike: a NaN only one reading sees is not a finding, the
    key is AMBIGUOUS_LAYOUT (exit 3); --dtype settles it."""
    config = dict(MAMBA2_TINY, dtype="bfloat16")
    model_dir = _model_dir(tmp_path, "mamba2-b", config)
    readings = _readings(config, {0: 18_304})[("m", 0)]
    written = _reading(readings, conv_dtype="bfloat16").layout
    rng = np.random.default_rng(5)
    values = [_fill(written, rng) for _ in range(8)]
    odd = values[0].copy()
    odd[:2] = np.array([0x7C01], np.uint16).view(np.uint8)  # NaN as float16, 2.4e36 as bfloat16
    _publish(publisher, namespace, "mamba2-b", 0, values[1:] + [odd])
    code, report = scan_json(cli_args, "--prefix", namespace.rstrip("/"), "--model-config", str(model_dir), "--all")
    (row,) = report["summary"]["layout_inference"]
    assert row["status"] == "ambiguous" and "--dtype" in row["settle_with"]
    ambiguous = [r for r in report["keys"] if r["verdicts"]]
    assert code == 3 and report["findings"] == [] and report["summary"]["keys_not_fully_judged"] == 1
    assert [r["verdicts"] for r in ambiguous] == [["AMBIGUOUS_LAYOUT"]]
    assert ambiguous[0]["evidence"]["ambiguous_layout"]["withheld"] == ["NONFINITE"]
    code, report = scan_json(cli_args, "--prefix", namespace.rstrip("/"), "--model-config", str(model_dir),
                             "--dtype", "float16")
    assert code == 1 and [r["verdicts"] for r in report["findings"]] == [["NONFINITE"]]
    code, report = scan_json(cli_args, "--prefix", namespace.rstrip("/"), "--model-config", str(model_dir),
                             "--dtype", "bfloat16")
    assert code == 0 and report["summary"]["layout_inference"][0]["status"] == "inferred"


def test_tp_sizes_that_share_a_value_size_are_readings_too():
    # n_groups 2 splits over TP 2: TP 2 in float32 has the bytes of TP 1 in bfloat16
    config = dict(MAMBA2_TINY, dtype="float32", n_groups=2)
    tp1 = LayoutRequest(config, "m", model_dtype="bfloat16", ssm_dtype="bfloat16").layouts()[0]
    tp2 = LayoutRequest(config, "m", tp_size=2, model_dtype="float32", ssm_dtype="float32").layouts()[0]
    assert tp1.size == tp2.size
    readings = _readings(config, {0: tp1.size})[("m", 0)]
    assert {1, 2} <= {r.assumed["tp_size"] for r in readings}
    written = _reading(readings, tp_size=2, conv_dtype="float32", ssm_dtype="float32")
    rng = np.random.default_rng(6)
    kept, evidence = choose_reading([r.layout for r in readings], [_fill(written.layout, rng) for _ in range(4)])
    assert [readings[i] for i in kept] == [written], evidence


def test_explain_names_the_candidates_and_what_the_bytes_said(publisher, cli_args, namespace, tmp_path):
    from tests.helpers import run_cli

    config = dict(MAMBA2_TINY, dtype="bfloat16")
    model_dir = _model_dir(tmp_path, "mamba2-e", config)
    written = _reading(_readings(config, {0: 18_304})[("m", 0)], conv_dtype="bfloat16").layout
    (key,) = _publish(publisher, namespace, "mamba2-e", 0, [_fill(written, np.random.default_rng(8))])
    human = run_cli("explain", key, *cli_args, "--model-config", str(model_dir))
    assert human.exit_code == 0, human.output
    assert "layout ambiguous" in human.stdout and human.stdout.count("candidate:") == 2
    assert "settle with --dtype" in human.stdout
    document = json.loads(run_cli("explain", key, *cli_args, "--model-config", str(model_dir), "--format",
                                  "json").stdout)
    (row,) = document["layout_inference"]
    assert row["status"] == "ambiguous" and row["bytes"]["rule"] == "the bytes cannot tell these readings apart"


def test_a_plan_weighs_each_sample_as_it_comes_and_keeps_none():
    """`CheckPlan.add_sample` weighs a sampled value under every reading of its group while the
    reader's buffer holds it: the plan decides as `choose_reading` over all the samples would, and
    keeps no reference to any of them (a copy of every sample was once held through the scan)."""
    import weakref

    from audit.judge.plan import CheckPlan
    from audit.layouts.infer import LayoutRequest

    keys = [KeyInfo(vllm_key("m", f"{i:04x}"), 16_384) for i in range(6)]
    plan = CheckPlan(requests=[LayoutRequest(LLAMA_TINY, "m")])
    plan.fit_sizes(keys)
    readings = plan.readings[("m", 0)]
    rng = np.random.default_rng(4)
    written = _reading(readings, kv_dtype="float32")
    values = [_fill(written.layout, rng) for _ in keys]
    expected = choose_reading([r.layout for r in readings], values)
    held = []
    for key, value in zip(keys, values):
        plan.add_sample(key, value)
        held.append(weakref.ref(value))
    del value, values
    assert all(ref() is None for ref in held)
    plan.decide_readings()
    row = next(row for row in plan.inference if (row["model"], row["group"]) == ("m", 0))
    assert row["bytes"] == expected[1] and row["bytes"]["keys_sampled"] == 6
    assert row["status"] == "from_bytes" and ("m", 0) not in plan.readings


def test_a_key_is_flagged_only_where_every_reading_of_its_size_decodes_layer0():
    """A size an fp8 e5m2 cache (not bound) shares with a 16-bit one: rows that bind under neither
    reading are no WEIGHTS_MISMATCH, since the reading tried may be the wrong one; a size whose every
    reading decodes layer 0 is judged."""
    from audit.judge.binding import _every_reading_decoded, layer0_region

    keys = [KeyInfo(vllm_key("m", f"{i:02x}"), 8_192) for i in range(2)]
    (e5m2,) = infer_layouts(LayoutRequest(LLAMA_TINY, "m", kv_cache_dtype="fp8_e5m2"), observed_sizes(keys)).layouts
    sixteen = [r.layout for r in _readings(LLAMA_TINY, {0: 8_192})[("m", 0)] if r.assumed["kv_dtype"] in ("bfloat16", "float16")]
    assert layer0_region(e5m2) is None and e5m2.size == 8_192
    assert len(sixteen) == 2 and all(layer0_region(layout) is not None for layout in sixteen)
    assert _every_reading_decoded(KeyRecord(keys[0].name, 8_192, None), sixteen)
    assert not _every_reading_decoded(KeyRecord(keys[0].name, 8_192, None), [*sixteen, e5m2])
    assert _every_reading_decoded(KeyRecord(keys[0].name, 16_384, None), [*sixteen, e5m2])  # (readings of its own size only)
