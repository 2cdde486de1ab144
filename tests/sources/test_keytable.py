"""The compact listing: what goes into a KeyTable comes back out, key by key and in views."""

from __future__ import annotations

from audit.records import KeyInfo
from audit.sources.keytable import KeyTable
from audit.sources.listing import _Lines


def _memory(endpoint: str, address: int, size: int) -> dict:
    return {"tier": "memory", "endpoint": endpoint, "address": address, "size": size}


KEYS = [
    KeyInfo("a@tp_rank:0", 256, replicas=[_memory("10.0.0.1:1", 4096, 256)]),
    KeyInfo("key with\nnewline and \udcff byte", 10, replicas=[_memory("10.0.0.2:1", 64, 10),
                                                              _memory("10.0.0.3:1", 128, 10)]),
    KeyInfo("disk only", 7, replicas=[{"tier": "disk", "endpoint": None, "address": None, "size": 7}]),
    KeyInfo("sized by the client, no replica", 5),
    KeyInfo("b@tp_rank:1", 256, replicas=[_memory("10.0.0.1:1", 8192, 256)]),
]


def test_every_key_comes_back_as_it_went_in_with_its_row():
    table = KeyTable.of(KEYS)
    back = list(table)
    assert [(k.name, k.size, k.replicas) for k in back] == [(k.name, k.size, k.replicas) for k in KEYS]
    assert [k.ordinal for k in back] == list(range(len(KEYS)))
    assert back == [table.info(row) for row in range(len(KEYS))]  # every field, as one row at a time gives it
    assert [(row, name.decode("utf-8", "surrogateescape"), size) for row, name, size in table.encoded_rows()] == \
        [(row, table.name(row), -1 if table.size(row) is None else table.size(row)) for row in range(len(KEYS))]
    assert list(table.names()) == [key.name for key in KEYS] and list(table.subset([4, 0]).names()) == \
        ["b@tp_rank:1", "a@tp_rank:0"]
    assert table[-1].name == "b@tp_rank:1" and table.name(1) == KEYS[1].name
    assert table.listed_replica(0) == ("10.0.0.1:1", 4096, 256) and table.listed_replica(1) is None
    assert table.total_size() == 256 + 10 + 7 + 5 + 256


def test_views_keep_table_rows_and_split_asks_only_the_unusual_keys():
    table = KeyTable.of(KEYS)
    view = table.subset([4, 0])
    assert [k.name for k in view] == ["b@tp_rank:1", "a@tp_rank:0"] and [k.ordinal for k in view] == [4, 0]
    asked = []

    def memory(key: KeyInfo) -> bool:
        asked.append(key.name)
        return any(r.get("tier") == "memory" for r in key.replicas)

    readable, others = table.split(memory)
    assert [k.ordinal for k in readable] == [0, 1, 4]
    assert [k.name for k in others] == ["disk only", "sized by the client, no replica"]
    assert asked == [KEYS[1].name, "disk only", "sized by the client, no replica"]
    usual, unusual = table.unusual()
    assert usual == 2 and [k.ordinal for k in unusual] == [1, 2, 3]


def test_listing_lines_are_read_from_the_body_and_repeats_found():
    lines = _Lines(b"a\nb\n\nb\nlast")
    assert len(lines) == 5 and [lines[i] for i in range(5)] == ["a", "b", "", "b", "last"]
    assert lines.repeated() == {1, 3}
    assert len(_Lines(b"")) == 0 and len(_Lines(b"x\n")) == 1


def test_rows_copied_from_another_table_are_the_rows_appended_one_by_one():
    earlier = KeyTable.of(KEYS)
    copied, appended = KeyTable(), KeyTable()
    copied.append_listed("first", 3, "10.0.0.9:1", 1)  # an endpoint the earlier table does not know
    appended.append_listed("first", 3, "10.0.0.9:1", 1)
    rows = [4, 0]  # the rows whose replica the columns hold, in another order
    assert all(earlier.in_columns(row) for row in rows) and not earlier.in_columns(1)
    assert copied.extend_copied(earlier, rows, [earlier.name(row) for row in rows]) == range(1, 3)
    for row in rows:
        endpoint, address, size = earlier.listed_replica(row)
        appended.append_listed(earlier.name(row), size, endpoint, address)
    assert [(k.name, k.size, k.replicas, k.ordinal) for k in copied] == \
        [(k.name, k.size, k.replicas, k.ordinal) for k in appended]
    assert copied.extend_copied(earlier, [], []) == range(3, 3)


def test_a_block_of_lines_decoded_at_once_is_the_lines_one_by_one():
    body = "a\n\nkey \u00e9\n".encode() + b"bad \xff\xfe byte\nlast"
    lines = _Lines(body)
    one_by_one = [lines[i] for i in range(len(lines))]
    assert one_by_one == ["a", "", "key \u00e9", "bad \udcff\udcfe byte", "last"]
    assert lines.block(0, 2) + lines.block(2, 2) + lines.block(4, 2) == one_by_one
    assert lines.block(5, 2) == [] and lines.block(0, 100) == one_by_one
