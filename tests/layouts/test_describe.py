"""What the layout command prints."""

from __future__ import annotations

from audit.layouts import describe, layouts_from_hf_config, summarize

from .configs import MAMBA_130M, QWEN3_NEXT


def test_rows_in_byte_order():
    [layout] = layouts_from_hf_config(MAMBA_130M, model="mamba-130m-hf")
    rows = describe(layout)
    assert len(rows) == 48  # 24 segments x (conv, ssm)
    assert rows[0] == {"segment": "layers.0", "layer": 0, "region": "conv", "kind": "state",
                       "offset": 0, "length": 9_216, "dtype": "bfloat16", "shape": (3, 1536)}
    assert rows[3]["segment"] == "layers.1" and rows[3]["offset"] == 58_368 + 9_216


def test_summary_line():
    [layout] = layouts_from_hf_config(MAMBA_130M, model="mamba-130m-hf")
    assert summarize(layout) == ("mamba-130m-hf group 0 (mamba1, TP 1): 1,400,832 bytes per key = "
                                 "24 segments x 58,368 bytes; state 1,400,832, kv 0, padding 0")
    # 12 x 16,384 B padding = 196,608; state = 12 x 1,097,728 = 13,172,736
    gdn = layouts_from_hf_config(QWEN3_NEXT, model="Qwen3-Next-80B-A3B-Instruct")[0]
    assert summarize(gdn).endswith("state 13,172,736, kv 0, padding 196,608")
