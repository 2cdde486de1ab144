"""`/batch_query_keys` asked the two ways the admin client builds its query strings: vLLM-style
keys joined as they are, and keys that need percent-encoding, on a real master."""

from __future__ import annotations

import pytest

from audit.connection import QUERY_URL_BUDGET, AdminClient, _query_strings

HOSTILE = ["sp ace", "per%cent", "plus+and&amp", "hash#mark", "quest?ion", "é-accent", "tab\tkey", "slash/ed",
           "semi;colon", "eq=ual"]


def test_plain_keys_are_joined_as_they_are_and_others_encoded_within_the_budget():
    plain = ["mamba-130m-hf@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@9858647abc4e2552", "a.b_c~d-e"]
    assert list(_query_strings(plain)) == [",".join(plain)]
    assert list(_query_strings(["a b", "ok"])) == ["a%20b,ok"]
    long = [f"k{i:05d} é" * 4 for i in range(3000)]  # each one lengthened by encoding
    pieces = list(_query_strings(long))
    assert len(pieces) > 1 and all(len(piece) <= QUERY_URL_BUDGET for piece in pieces)
    assert sum(piece.count(",") + 1 for piece in pieces) == len(long)


@pytest.mark.parametrize("count", [3, 2500])  # one call; several, split by the key count
def test_every_key_is_answered_under_its_own_name(publisher, settings, namespace, count):
    names = [f"{namespace}{HOSTILE[i % len(HOSTILE)]}{i}" for i in range(count)]
    plain = [f"{namespace}@tp_rank:0@{i:x}" for i in range(count)]
    for i, name in enumerate(names + plain):
        publisher.put(name, bytes([i % 251 + 1]) * (64 + i % 7))
    answers = dict(AdminClient(settings.admin).query(names + plain + [f"{namespace}never-put"]))
    assert set(answers) == {*names, *plain, f"{namespace}never-put"}
    assert all(answers[name]["ok"] and answers[name]["values"][0]["size_"] == 64 + i % 7
               for i, name in enumerate(names + plain))
    assert not answers[f"{namespace}never-put"]["ok"]
