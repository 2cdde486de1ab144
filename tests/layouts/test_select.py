"""Picking the layout for a key by its parsed model name and group."""

from __future__ import annotations

from dataclasses import replace

import pytest

from audit.layouts import LayoutError, layouts_from_hf_config, select_layout

from .configs import MAMBA_130M, QWEN3_NEXT


def test_exact_group_wins():
    layouts = layouts_from_hf_config(QWEN3_NEXT, model="Qwen3-Next-80B-A3B-Instruct")
    chosen = select_layout(layouts, "Qwen3-Next-80B-A3B-Instruct", 3, for_all=False)
    assert chosen.kind == "attention"
    assert select_layout(layouts, "Qwen3-Next-80B-A3B-Instruct", 7, for_all=False) is None
    assert select_layout(layouts, "other-model", 0, for_all=False) is None


def test_key_without_group_field_is_group_0():
    [layout] = layouts_from_hf_config(MAMBA_130M, model="mamba-130m-hf")
    assert select_layout([layout], "mamba-130m-hf", None, for_all=False) is layout


def test_any_group_layout_and_for_all():
    [layout] = layouts_from_hf_config(MAMBA_130M, model="mamba-130m-hf")
    anywhere = replace(layout, group=None)
    assert select_layout([anywhere], "mamba-130m-hf", 5, for_all=False) is anywhere
    assert select_layout([anywhere], None, 5, for_all=False) is None
    assert select_layout([anywhere], None, 5, for_all=True) is anywhere
    # an exact group beats "any group"
    assert select_layout([anywhere, layout], "mamba-130m-hf", 0, for_all=False) is layout


def test_ambiguous_layouts_are_refused():
    tp1 = layouts_from_hf_config(MAMBA_130M, model="m")
    tp2 = layouts_from_hf_config(MAMBA_130M, model="m", tp_size=2)
    with pytest.raises(LayoutError, match=r"2 layouts match model 'm' group 0 \(TP sizes \[1, 2\]\)"):
        select_layout(tp1 + tp2, "m", 0, for_all=False)
