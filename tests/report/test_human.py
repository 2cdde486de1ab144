"""The human report's lines that summarise a whole part of the run, rendered from its summary."""

from __future__ import annotations

from audit.report.human import _binding_line


def test_the_binding_line_says_how_many_keys_were_left_unflagged_as_maybe_supplied_embeddings():
    line = _binding_line({"bound": ["vl-model"], "not_bound": {"text-model": "no layer-0 image rule yet"},
                          "supplied_rows": {"recorded": 2, "unrecorded": 3}})
    assert line == ("layer-0 binding: vl-model; not bound: text-model: no layer-0 image rule yet; not flagged, "
                    "rows of no token that may be embeddings given to vLLM: 2 as their producers recorded, "
                    "3 of a model taking an encoder's embeddings with no record (give --block-tables)")
    assert _binding_line({"bound": ["m"], "not_bound": {}}) == "layer-0 binding: m"
    assert _binding_line({"bound": ["m"], "not_bound": {}, "supplied_rows": {
        "recorded": 0, "unrecorded": 4, "no_key_bound": ["m"]}}).endswith(
        "; no key of m bound to a token: of other weights, unless every key read is of an image")
