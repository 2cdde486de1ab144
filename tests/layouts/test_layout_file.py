"""The JSON layout file: round trips, the documented example, and refusals that name the file."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from audit.layouts import LayoutError, dump_layout_file, layouts_from_hf_config, load_layout_file

from .configs import LFM2_1_2B, MAMBA_130M, QWEN3_NEXT

DOCS = Path(__file__).resolve().parents[2] / "docs" / "layouts.md"


def _write(tmp_path, document) -> Path:
    path = tmp_path / "layout.json"
    path.write_text(document if isinstance(document, str) else json.dumps(document))
    return path


@pytest.mark.parametrize("config", [MAMBA_130M, QWEN3_NEXT, LFM2_1_2B], ids=["mamba", "qwen3_next", "lfm2"])
def test_round_trip(tmp_path, config):
    layouts = layouts_from_hf_config(config, model="m", tp_size=2)
    assert load_layout_file(_write(tmp_path, dump_layout_file(layouts))) == layouts


def test_repeated_segments_are_written_once():
    [layout] = layouts_from_hf_config(MAMBA_130M, model="mamba-130m-hf")
    [entry] = dump_layout_file([layout])["layouts"]
    assert entry["segments"] == {"count": 24, "regions": [
        {"name": "conv", "kind": "state", "dtype": "bfloat16", "shape": [3, 1536]},
        {"name": "ssm", "kind": "state", "dtype": "bfloat16", "shape": [1536, 16]}]}
    # LFM2's conv groups end with an unused slot, so their segments are listed one by one
    lfm2 = dump_layout_file(layouts_from_hf_config(LFM2_1_2B, model="m"))["layouts"]
    assert isinstance(lfm2[0]["segments"], list) and isinstance(lfm2[2]["segments"], dict)


def test_documented_example_loads(tmp_path):
    example = re.search(r"<!-- layout-file-example -->\s*```json\n(.*?)```", DOCS.read_text(), re.S)
    layouts = load_layout_file(_write(tmp_path, example.group(1)))
    # two groups of a 2-layer toy hybrid; see docs/layouts.md for the arithmetic
    assert [(layout.group, layout.kind, layout.size) for layout in layouts] == [
        (0, "mamba2", 2 * 16_384), (1, "attention", 2 * 16_384)]
    conv, ssm, padding = layouts[0].segments[1].regions
    assert (conv.offset, ssm.offset, padding.offset, padding.length) == (16_384, 17_536, 21_632, 11_136)
    assert [segment.layer for segment in layouts[0].segments] == [0, 2]
    # ...and it is exactly what vLLM's rules give for that toy as a Nemotron-H config
    toy = {"model_type": "nemotron_h", "hybrid_override_pattern": "M*M*", "mamba_num_heads": 8,
           "mamba_head_dim": 16, "n_groups": 2, "ssm_state_size": 16, "conv_kernel": 4,
           "num_key_value_heads": 2, "head_dim": 32}
    assert layouts_from_hf_config(toy, model="toy-hybrid", block_size=64, ssm_dtype="bfloat16") == layouts


def _document(**layout_overrides):
    layout = {"model": "m", "group": 0, "kind": "mamba1", "tp_size": 1,
              "segments": {"count": 2, "regions": [
                  {"name": "conv", "kind": "state", "dtype": "bfloat16", "shape": [3, 8]},
                  {"kind": "padding", "length": 16}]}}
    layout.update(layout_overrides)
    return {"schema": "mooncake-audit/layout", "version": 1, "layouts": [layout]}


def test_padding_shorthand_and_explicit_segments(tmp_path):
    # conv 3*8*2 = 48 B + 16 B padding = 64 B per segment, 2 segments
    [layout] = load_layout_file(_write(tmp_path, _document()))
    assert layout.size == 128
    assert layout.segments[1].regions[1].offset == 64 + 48
    explicit = _document(segments=[
        {"name": "mixer.0", "layer": 5, "length": 48,
         "regions": [{"name": "conv", "kind": "state", "dtype": "bf16", "shape": [3, 8]}]}])
    [layout] = load_layout_file(_write(tmp_path, explicit))
    assert (layout.segments[0].name, layout.segments[0].layer, layout.size) == ("mixer.0", 5, 48)


@pytest.mark.parametrize("document, message", [
    ("{not json", "not JSON"),
    ({"schema": "other", "version": 1, "layouts": []}, "\"schema\" must be"),
    ({"schema": "mooncake-audit/layout", "version": 2, "layouts": []}, "\"version\" 2 is not supported"),
    ({"schema": "mooncake-audit/layout", "version": 1, "layouts": []}, "layouts: expected a non-empty list"),
    (_document(shape=[1]), r"layouts\[0\]: unknown field\(s\) \['shape'\]"),
    (_document(kind="mamba9"), "layout kind 'mamba9'"),
    (_document(tp_size=0), r"layouts\[0\].tp_size: expected an integer >= 1"),
    (_document(model=""), "model: expected a non-empty string"),
    (_document(segments={"count": 1, "regions": [
        {"name": "conv", "kind": "state", "dtype": "bf17", "shape": [3]}]}), "unknown dtype 'bf17'"),
    (_document(segments={"count": 1, "regions": [
        {"name": "conv", "kind": "state", "dtype": "bfloat16", "shape": [3], "length": 5}]}),
     r"length 5 != shape \[3\] x bfloat16 = 6 bytes"),
    (_document(segments={"count": 1, "regions": [{"name": "conv", "kind": "state", "dtype": "bfloat16"}]}),
     "needs \"shape\""),
    (_document(segments={"count": 2, "layers": [0], "regions": [{"kind": "padding", "length": 4}]}),
     "1 layers for count 2"),
    (_document(segments=[{"length": 10, "regions": [{"kind": "padding", "length": 4}]}]),
     "length 10 != 4 bytes of its regions"),
    (_document(segments=[{"regions": [{"name": "x", "kind": "secret", "length": 4}]}]), "kind 'secret'"),
])
def test_malformed_files_name_the_file(tmp_path, document, message):
    path = _write(tmp_path, document)
    with pytest.raises(LayoutError, match=message) as error:
        load_layout_file(path)
    assert str(error.value).startswith(str(path))
    assert "\n" not in str(error.value)


def test_missing_file(tmp_path):
    with pytest.raises(LayoutError, match="nope.json: cannot read"):
        load_layout_file(tmp_path / "nope.json")
