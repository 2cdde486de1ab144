"""A scan of a store whose dtype the bytes cannot settle (bfloat16 against float16, what every bf16
deployment run without --dtype leaves open) reports exactly what it reported when each key was
checked and judged once per open reading (issue #31 item 3): the same verdicts, digests, evidence,
regions and coverage, from one pass over the bytes; and the Triton checker (under the interpreter
on CPU) writes the same report bit for bit."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from audit.checks.host import HostChecker  # noqa: E402
from audit.judge.key import judge_read  # noqa: E402
from audit.judge.readings import combine_readings  # noqa: E402
from audit.run import scan  # noqa: E402
from tests.helpers import gpu_host, interpreted, scan_json  # noqa: E402
from tests.judge.test_readings import _fill, _model_dir, _publish, _reading, _readings  # noqa: E402
from tests.layouts.test_families import LLAMA_TINY, MAMBA2_TINY  # noqa: E402

TIMES = ("started_at", "finished_at", "duration_s", "bytes_per_s")
WHICH_CHECKER = ("checker", "device")  # the lines of a report that name the checker that wrote it, and where


def _per_reading_checks(self, buffer, items):
    """The path before one pass: every reading of a value checked in a pass of its own."""
    return [tuple(self.check_values(buffer, [(offset, length, layout)])[0] for layout in readings)
            or tuple(self.check_values(buffer, [(offset, length, None)]))
            for offset, length, readings in items]


def _judged_under_every_reading(record, key, code, checks, layouts, table=None):
    """The judging before: a record under every other reading, then combined."""
    return combine_readings(record, [judge_read(key, code, check, layout=layout, table=table)
                                     for check, layout in zip(checks[1:], layouts[1:])])


def _comparable(report: dict) -> dict:
    return {**report, "summary": {k: v for k, v in report["summary"].items() if k not in TIMES + WHICH_CHECKER}}


def _word(value: np.ndarray, at: int, word: int) -> np.ndarray:
    value = value.copy()
    value[at: at + 2] = np.array([word], np.uint16).view(np.uint8)
    return value


@pytest.fixture
def ambiguous_store(publisher, namespace, tmp_path):
    """A bf16 Mamba2 and a bf16 Llama, no --dtype: every group reads as bfloat16 or float16. Keys
    whose verdicts every reading gives, and keys whose verdicts only some give (withheld)."""
    mamba_config, llama_config = dict(MAMBA2_TINY, dtype="bfloat16"), LLAMA_TINY
    dirs = [_model_dir(tmp_path, "mamba2-one", mamba_config), _model_dir(tmp_path, "llama-one", llama_config)]
    rng = np.random.default_rng(31)
    mamba = _reading(_readings(mamba_config, {0: 18_304})[("m", 0)], conv_dtype="bfloat16").layout
    llama = _reading(_readings(llama_config, {0: 16_384})[("m", 0)], kv_dtype="bfloat16").layout
    for model, layout in (("mamba2-one", mamba), ("llama-one", llama)):
        clean = [_fill(layout, rng) for _ in range(20)]
        state = next(region for _, region in layout.regions() if region.kind != "padding")
        zero_layer = clean[0].copy()
        segment = layout.segments[-1]
        zero_layer[segment.offset: segment.offset + segment.length] = 0
        odd = [
            _word(clean[1], state.offset, 0x7C01),   # NaN as float16, a huge number as bfloat16
            _word(clean[2], state.offset, 0x7FC0),   # NaN in both
            _word(clean[3], state.offset + 2, 0x7F80),  # Inf as bfloat16, NaN as float16
            _word(clean[4], state.offset, 0xFC00),   # -Inf as float16, a huge negative bfloat16
            np.zeros(layout.size, np.uint8),
            zero_layer,
        ]
        _publish(publisher, namespace, model, 0, clean + odd)
    return [arg for path in dirs for arg in ("--model-config", str(path))]


@pytest.mark.parametrize("checker", ["numpy", "triton"])
def test_one_pass_report_equals_the_per_reading_report(ambiguous_store, cli_args, namespace, monkeypatch, checker):
    """Triton where this host runs it: interpreted on host memory, or on its GPU."""
    args = [*cli_args, "--prefix", namespace.rstrip("/"), *ambiguous_store, "--all"]
    device = "cuda" if checker == "triton" and not interpreted() else "cpu"
    if device == "cuda" and not gpu_host():
        pytest.skip("Triton without its interpreter needs a GPU host")
    code, report = scan_json(args, "--checker", checker, "--device", device)
    with monkeypatch.context() as patched:
        patched.setattr(HostChecker, "check_readings", _per_reading_checks)
        patched.setattr(scan, "judge_readings", _judged_under_every_reading)
        reference_code, reference = scan_json(args, "--checker", "numpy", "--device", "cpu")
    assert (code, _comparable(report)) == (reference_code, _comparable(reference))
    assert report["summary"]["checker"] == checker
    # what the store holds, so the comparison can fail: both groups open, verdicts withheld and kept
    rows = report["summary"]["layout_inference"]
    assert sorted(row["status"] for row in rows) == ["ambiguous", "ambiguous"]
    verdicts = sorted(tuple(record["verdicts"]) for record in report["keys"] if record["verdicts"])
    assert code == 1 and ("AMBIGUOUS_LAYOUT",) in verdicts and ("NONFINITE",) in verdicts
    assert any("ZERO" in verdict for verdict_tuple in verdicts for verdict in verdict_tuple)
    withheld = {name for record in report["keys"]
                for name in record["evidence"].get("ambiguous_layout", {}).get("withheld", ())}
    assert "NONFINITE" in withheld
