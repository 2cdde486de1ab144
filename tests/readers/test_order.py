"""The order raw reads go in, and the runs they merge into: plain functions, checked on arrays
and reads made up here (the real engine reading them is in test_peek.py)."""

from __future__ import annotations

import numpy as np

from audit.readers.engine import RawRead, merged
from audit.readers.order import holder_order, in_reading_order
from audit.records import KeyInfo
from audit.sources.keytable import KeyTable


def test_exact_neighbours_at_both_ends_merge_into_one_read():
    reads = [RawRead("h", 1000 + 256 * i, 50_000 + 256 * i, 256) for i in (3, 0, 2, 1)]  # any order given
    assert merged(reads) == [RawRead("h", 1000, 50_000, 1024)]


def test_a_gap_at_either_end_starts_a_new_read():
    reads = [RawRead("h", 0, 100, 64), RawRead("h", 64, 164, 64),   # neighbours
             RawRead("h", 128, 260, 64),                             # remote gap of 32, local none
             RawRead("h", 256, 324, 64),                             # local gap, remote none
             RawRead("h", 320, 388, 64)]                             # neighbour of the one before
    assert merged(reads) == [RawRead("h", 0, 100, 128), RawRead("h", 128, 260, 64), RawRead("h", 256, 324, 128)]
    assert merged([]) == []


def _order(endpoint, address, size, capacity=1 << 20, max_keys=1000):
    return holder_order(np.array(endpoint, np.int64), np.array(address, np.uint64), np.array(size, np.int64),
                        capacity, max_keys).tolist()


def test_one_holders_keys_go_by_address_unplaced_keys_last_in_order_given():
    assert _order([0, 0, -1, 0, -1], [300, 100, 0, 200, 0], [100] * 5) == [1, 3, 0, 2, 4]


def test_holders_take_turns_a_share_of_a_batch_each():
    # two holders, 6 keys each, batches of 4 keys: each batch reads 2 neighbours from each holder
    endpoint = [0, 1] * 6
    address = [1000 - 10 * (i // 2) for i in range(12)]  # listed in descending address
    order = _order(endpoint, address, [10] * 12, max_keys=4)
    holders = [endpoint[i] for i in order]
    assert holders == [0, 0, 1, 1] * 3
    for start in range(0, 12, 2):
        pair = [address[i] for i in order[start:start + 2]]
        assert pair[1] == pair[0] + 10  # neighbours, ascending
    # a share is bounded by bytes too: 64 B slots, a batch of 128 B, so one key per holder per turn
    assert [endpoint[i] for i in _order(endpoint, address, [10] * 12, capacity=128, max_keys=1000)] == [0, 1] * 6


def test_a_table_view_and_a_list_give_the_same_order():
    table = KeyTable()
    keys = [KeyInfo(f"k{i}", 256, replicas=[{"tier": "memory", "endpoint": f"h{i % 2}", "address": 10_000 - 256 * i,
                                             "size": 256}]) for i in range(10)]
    keys.append(KeyInfo("aside", 256, replicas=[{"tier": "disk", "size": 256}]))
    for key in keys:
        table.append(key)
    view = table.subset([10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0])
    from_view = [key.name for key in in_reading_order(view, 1 << 20)]
    assert from_view == [key.name for key in in_reading_order(list(view), 1 << 20)]
    assert from_view == ["k8", "k6", "k4", "k2", "k0", "k9", "k7", "k5", "k3", "k1", "aside"]
