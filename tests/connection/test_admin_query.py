"""`/batch_query_keys` asked the two ways the admin client builds its query strings: vLLM-style
keys joined as they are, and keys that need percent-encoding, on a real master."""

from __future__ import annotations

import http.server
import json
import threading
import urllib.parse

import pytest

from audit import connection
from audit.connection import QUERY_URL_BUDGET, AdminClient, _query_strings
from audit.errors import AuditError

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


class _StandIn(http.server.BaseHTTPRequestHandler):
    """A stand-in for the master's admin port, for what a real master does not say: when each call
    arrives. Answers every key as one 64-byte memory replica; `failing` calls answer 500."""

    protocol_version = "HTTP/1.1"  # kept alive, as the master's
    arrived: list[int]             # per call, in order: how many answers the caller had finished with
    finished = 0
    failing: set[int] = set()
    seen = threading.Condition()

    def do_GET(self):
        keys = urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query)["keys"][0].split(",")
        with self.seen:
            call = len(self.arrived)
            self.arrived.append(type(self).finished)
            self.seen.notify_all()
        body = json.dumps({"success": True, "data": {key: {"ok": True, "values": [
            {"size_": 64, "transport_endpoint_": "127.0.0.1:1", "buffer_address_": 4096}]} for key in keys}}).encode()
        self.send_response(500 if call in self.failing else 200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        """Quiet: the test reads what arrived, not the server's log."""


@pytest.fixture
def stand_in(monkeypatch):
    monkeypatch.setattr(connection, "QUERY_KEYS_PER_CALL", 10)
    handler = type("Handler", (_StandIn,), {"arrived": [], "finished": 0, "failing": set()})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield handler, f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    server.server_close()


def test_the_next_call_is_asked_while_the_caller_still_uses_the_last_answer(stand_in):
    handler, url = stand_in
    keys = [f"k{i}" for i in range(30)]
    answered = []
    for key, answer in AdminClient(url).query(keys):
        answered.append((key, answer["values"][0]["size_"]))
        if len(answered) % 10 == 0:  # the last key of a call: wait (2 s at most) for the next call to arrive
            with handler.seen:
                handler.seen.wait_for(lambda: len(handler.arrived) > len(answered) // 10, timeout=2)
            handler.finished += 1
    assert answered == [(key, 64) for key in keys]
    assert handler.arrived == [0, 0, 1]  # asked one call at a time, it would be [0, 1, 2]


def test_a_call_asked_ahead_that_fails_fails_the_query_where_its_answers_would_be(stand_in):
    handler, url = stand_in
    handler.failing.add(1)
    answered = []
    with pytest.raises(AuditError, match="answered 500"):
        for key, _ in AdminClient(url).query([f"k{i}" for i in range(30)]):
            answered.append(key)
    assert answered == [f"k{i}" for i in range(10)]  # the first call's answers, then the error
