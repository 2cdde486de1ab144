"""The audit's geometry of SGLang's hybrid pages against SGLang's own (`sglang_mamba_geometry.py`,
run by the SGLang Python: its config classes, `mambaish_config` and `mamba2_cache_params`, at TP 1
and 2): per family, the state layers, the attention layers its KV pool keeps, and each Mamba page's
numbers; a page of SGLang's size is read with no disagreement, one segment per state layer."""

from __future__ import annotations

import json
import math
import os
import subprocess
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest

from audit.layouts.config_shapes import hybrid_pools
from audit.producers.sglang.pages import read_page

SCRIPT = Path(__file__).with_name("sglang_mamba_geometry.py")
pytestmark = pytest.mark.skipif(not os.environ.get("SGLANG_PYTHON"), reason="SGLANG_PYTHON: a Python with sglang")


@lru_cache
def sglang_geometry() -> dict:
    run = subprocess.run([os.environ["SGLANG_PYTHON"], str(SCRIPT)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])["families"]


# A config whose `layer_types` contradict its `full_attention_interval`: SGLang's Qwen3-Next reads
# the interval, the audit (as vLLM does) the layer types. No checkpoint has both disagree.
_DIVERGES = {"qwen3_next_gdn_layer_types_disagree": "SGLang reads full_attention_interval, vLLM layer_types"}


def cases():
    """Every family and TP size SGLang sized (configs its own classes refuse are left out)."""
    if not os.environ.get("SGLANG_PYTHON"):
        return []
    return [pytest.param(family, tp, marks=[pytest.mark.xfail(strict=True, reason=_DIVERGES[family])]
                         if family in _DIVERGES else [])
            for family, found in sglang_geometry().items() for tp, geometry in found["per_tp"].items()
            if "num_mamba_layers" in geometry]


@pytest.mark.parametrize("family, tp", cases())
def test_the_audits_hybrid_pools_are_sglangs(family, tp):
    found = sglang_geometry()[family]
    config, theirs = found["config"], found["per_tp"][tp]
    ours = hybrid_pools(config, int(tp))
    assert ours is not None, family
    assert ours.state_layers == theirs["num_mamba_layers"]
    assert ours.attention_layers == theirs["num_attention_layers"]
    temporal = math.prod(theirs["temporal_state_shape"])
    assert ours.state_numbers.get("ssm", 0) == temporal
    assert [ours.state_numbers["conv"]] == [math.prod(shape) for shape in theirs["conv_state_shapes"]]
    rank = int(tp) - 1  # the highest rank of that TP size: every smaller TP size is out
    pages = {"conv_0": theirs["conv_key_bytes_per_slot"][0]}
    if temporal:  # a conv-only model (LFM2) publishes no `_temporal`
        pages["temporal"] = theirs["temporal_key_bytes_per_slot"]
    for part, size in pages.items():
        value = np.random.default_rng(0).integers(1, 255, size, dtype=np.uint8)
        reading = read_page({"part": part, "tp_rank": rank}, value, config)
        assert reading is not None and reading.disagreements == (), (family, tp, part)
        per_layer = size // theirs["num_mamba_layers"]
        splits = [[region.length for _, region in layout.regions()] for layout in (reading.layout, *reading.alternatives)]
        assert [per_layer] * theirs["num_mamba_layers"] in splits, (family, tp, part)
