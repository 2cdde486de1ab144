"""The listing's fast path and the incremental listing `watch` uses give the table the full listing
gives: same rows, names, sizes and replicas, in listing order."""

from __future__ import annotations

from audit.records import KeyInfo
from audit.sources.keytable import KeyTable
from audit.sources.listing import AdminListing, KnownKeys, _key_info, _listed_row


def _memory(size, address, endpoint="h:1"):
    return {"size_": size, "buffer_address_": address, "transport_endpoint_": endpoint, "protocol_": "tcp"}


# Every shape of answer the table treats apart: one memory replica (the columns), two, another tier,
# a size the replica does not give, an address that is not a number, no replica, a refusal.
ANSWERS = {
    "one": {"ok": True, "error": None, "values": [_memory(256, 4096)], "disk_values": None},
    "one-other-holder": {"ok": True, "values": [_memory(256, 8192, "h:2")]},
    "two": {"ok": True, "values": [_memory(10, 64), _memory(10, 128, "h:2")]},
    "memory-and-disk": {"ok": True, "values": [_memory(7, 64)],
                        "disk_values": [{"size_": 7, "transport_endpoint_": None, "buffer_address_": None}]},
    "disk-only": {"ok": True, "values": [], "disk_values": [{"size_": 7}]},
    "size-none": {"ok": True, "values": [{"size_": None, "buffer_address_": 64, "transport_endpoint_": "h:1"}]},
    "address-text": {"ok": True, "values": [_memory(5, "64")]},
    "endpoint-none": {"ok": True, "values": [_memory(5, 64, None)]},
    "empty-value": {"ok": True, "values": [_memory(0, 64)]},
    "no-replica": {"ok": True, "values": []},
    "refused": {"ok": False, "error": "INVALID_KEY"},
    "gone": {"ok": False, "error": "OBJECT_NOT_FOUND"},
}


def _rows(table: KeyTable) -> list[tuple]:
    return [(k.name, k.size, k.replicas, k.ordinal) for k in table]


def test_the_fast_path_keeps_what_the_general_path_keeps():
    for name, answer in ANSWERS.items():
        general, fast = KeyTable(), KeyTable()
        info = _key_info(name, answer)
        if info is not None:
            general.append(info)
        row = _listed_row(answer)
        if row is not None:
            fast.append_listed(name, *row)
        elif info is not None:
            fast.append(info)
        assert _rows(fast) == _rows(general), name
        assert [general.listed_replica(r) for r in range(len(general))] == \
            [fast.listed_replica(r) for r in range(len(fast))], name
        assert general._aside == fast._aside and general._endpoints == fast._endpoints, name


class _Admin:
    """A master whose answers are `ANSWERS`; counts the names it is asked to size."""

    def __init__(self, names):
        self.names = list(names)
        self.asked: list[str] = []

    def all_keys_body(self):
        return "".join(f"{name}\n" for name in self.names).encode()

    def query(self, names):
        names = list(names)
        self.asked += names
        listed = set(self.names)
        return [(name, ANSWERS[name.split("#")[0]] if name in listed else ANSWERS["gone"]) for name in names]


def test_a_listing_knowing_every_name_asks_none_and_gives_the_same_table():
    names = [f"{shape}#{i}" for i in range(3) for shape in ANSWERS]
    admin = _Admin(names)
    sizes = {f"refused#{i}": 9 for i in range(3)}
    listing = AdminListing(admin, size_of=lambda name: sizes.get(name, -704))
    full = listing.list(index=True)
    assert set(names) <= set(admin.asked) and full.sized == len(admin.asked)  # and rejoinings of unknown lines
    admin.asked.clear()
    again = listing.list(known=KnownKeys(full), index=True)
    assert _rows(again.keys) == _rows(full.keys) and again.rows_by_name == full.rows_by_name
    assert again.vanished == full.vanished and again.through_client == 0
    # only names the last listing did not hold: lines no key answers for, and their rejoinings
    assert admin.asked and set(admin.asked).isdisjoint(full.rows_by_name)
    assert {line for line in admin.asked if "\n" not in line} == set(full.vanished)
    assert sorted({name.split("#")[0] for name in full.vanished}) == ["gone", "no-replica"]
    assert again.sized == len(admin.asked)


def test_new_names_are_sized_known_ones_taken_gone_ones_dropped_in_listing_order():
    admin = _Admin([f"one#{i}" for i in range(6)])
    listing = AdminListing(admin)
    first = listing.list(index=True)
    admin.names = ["one#0", "two#new", "one#2", "one#4", "one#5", "one#new"]  # 1 and 3 gone, two new
    admin.asked.clear()
    incremental = listing.list(known=KnownKeys(first), index=True)
    assert admin.asked == ["two#new", "one#new"]
    assert _rows(incremental.keys) == _rows(listing.list(index=True).keys)
    assert list(incremental.rows_by_name) == admin.names


def test_repeated_lines_are_always_asked():
    """A line whose text another line repeats may be part of a key holding a newline: the listing
    asks it whatever the last one said, so the rejoining sees exactly what a full listing sees."""
    admin = _Admin(["one#0", "one#1", "one#0"])
    listing = AdminListing(admin)
    first = listing.list(index=True)
    admin.asked.clear()
    again = listing.list(known=KnownKeys(first), index=True)
    assert admin.asked == ["one#0", "one#0"] and _rows(again.keys) == _rows(first.keys)


def test_size_names_gives_the_key_infos_it_gave_before():
    admin = _Admin(list(ANSWERS))
    infos = AdminListing(admin).size_names(list(ANSWERS))
    expected = {name: _key_info(name, answer) for name, answer in ANSWERS.items()}
    assert infos == {name: info for name, info in expected.items() if info is not None}
    assert all(isinstance(info, KeyInfo) for info in infos.values())


def test_a_real_listing_knowing_its_keys_gives_the_full_listing(publisher, settings, namespace):
    from audit.connection import AdminClient
    from audit.sources.listing import KeyFilter

    for i in range(40):
        publisher.put(f"{namespace}k{i:02d}", bytes([i + 1]) * (100 + i))
    admin = AdminClient(settings.admin)
    listing = AdminListing(admin, KeyFilter(namespace))
    full = listing.list(index=True)
    again = listing.list(known=KnownKeys(full), index=True)
    assert len(full.keys) == 40 and again.sized == 0
    assert _rows(again.keys) == _rows(full.keys)
    publisher.put(f"{namespace}late", b"\x09" * 77)
    after = listing.list(known=KnownKeys(full), index=True)
    assert after.sized == 1 and _rows(after.keys) == _rows(listing.list(index=True).keys)
