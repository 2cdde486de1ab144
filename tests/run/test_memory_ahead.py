"""Host memory is touched ahead only for a reader that will read into it: a peek read of a store
whose keys are all on disk leaves it alone (the disk reader maps its values instead)."""

from __future__ import annotations

from audit.records import KeyInfo
from audit.run.reading import _any_memory_replica
from audit.sources.keytable import KeyTable

DISK = {"tier": "local_disk", "endpoint": "127.0.0.1:1", "size": 64}


def _memory(address: int) -> dict:
    return {"tier": "memory", "endpoint": "127.0.0.1:2", "address": address, "size": 64}


def test_a_store_on_disk_only_has_no_key_to_read_from_memory():
    keys = [KeyInfo(name=f"disk/{index}", size=64, replicas=[DISK]) for index in range(3)]
    assert not _any_memory_replica(keys) and not _any_memory_replica(KeyTable.of(keys))


def test_one_key_in_memory_among_disk_only_keys_is_enough():
    keys = [KeyInfo(name=f"disk/{index}", size=64, replicas=[DISK]) for index in range(3)]
    in_columns = KeyInfo(name="memory/one", size=64, replicas=[_memory(4096)])
    in_both = KeyInfo(name="memory/both", size=64, replicas=[_memory(8192), DISK])  # kept aside in a table
    for extra in (in_columns, in_both):
        assert _any_memory_replica([*keys, extra]) and _any_memory_replica(KeyTable.of([*keys, extra]))
