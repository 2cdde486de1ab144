"""The order raw reads go in: by holder and address, so that values lying side by side in a
holder's memory lie side by side in a batch, and `RawTransfer` reads each run of them as one
transfer. A raw read costs the transfer engine about 40 us of CPU whatever its length: a batch of
a thousand 256 B values is a thousand of them in listing order, and one in this order.

Holders take turns, each a share of a batch at a time (`run`), so that a batch still spans every
holder and reads them in parallel. Keys whose replica the listing did not place come last, in the
order given; where a key is read does not change what the report says about it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from audit.readers.buffers import ALIGNMENT, MAX_KEYS_PER_BATCH
from audit.records import KeyInfo
from audit.sources.keytable import KeyTable


def holder_order(endpoint: np.ndarray, address: np.ndarray, size: np.ndarray, capacity: int,
                 max_keys: int = MAX_KEYS_PER_BATCH) -> np.ndarray:
    """Indices of the keys in reading order. Per key: its holder's id (< 0: not known), its replica's
    address and size; `capacity` and `max_keys` bound a batch, as `plan_batches` packs them."""
    known = np.flatnonzero(endpoint >= 0)
    unplaced = np.flatnonzero(endpoint < 0)
    if not len(known):
        return unplaced
    by_place = known[np.lexsort((address[known], endpoint[known]))]
    holders = endpoint[by_place]
    starts = np.flatnonzero(np.r_[True, holders[1:] != holders[:-1]])
    run_keys = max(1, max_keys // len(starts))
    run_bytes = max(1, capacity // len(starts))
    group = np.repeat(np.arange(len(starts)), np.diff(np.r_[starts, len(by_place)]))
    rank = np.arange(len(by_place)) - starts[group]
    aligned = (size[by_place].clip(0) + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT
    filled = np.cumsum(aligned) - aligned  # bytes of the keys before it, over every holder
    before = filled - filled[starts][group]  # ... of its own holder
    turn = np.maximum(rank // run_keys, before // run_bytes)
    return np.concatenate([by_place[np.lexsort((rank, group, turn))], unplaced])


def _by_name(endpoints: list[str], holder: np.ndarray) -> np.ndarray:
    """Holder indices into `endpoints` as the endpoints' ranks in name order (-1 stays -1), so that
    holders take turns in the same order however the keys came."""
    rank = np.append(np.argsort(np.argsort(np.array(endpoints, dtype=object))), -1).astype(np.int64)
    return rank[holder]  # rank[-1]: -1


def _placed(keys: Sequence[KeyInfo]) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray]:
    """As `KeyTable.replica_columns` gives them: the holders' endpoints and (holder, address, size)
    per key, from the key's one memory replica of its own size; holder -1 for any other key."""
    ids: dict[str, int] = {}
    endpoint = np.full(len(keys), -1, dtype=np.int64)
    address = np.zeros(len(keys), dtype=np.uint64)
    size = np.zeros(len(keys), dtype=np.int64)
    for i, key in enumerate(keys):
        if len(key.replicas) != 1:
            continue
        only = key.replicas[0]
        where, at = only.get("endpoint"), only.get("address")
        if (only.get("tier") == "memory" and type(where) is str and type(at) is int
                and key.size is not None and only.get("size") == key.size):
            endpoint[i] = ids.setdefault(where, len(ids))
            address[i], size[i] = at, key.size
    return list(ids), endpoint, address, size


def in_reading_order(keys: Sequence[KeyInfo], capacity: int) -> Sequence[KeyInfo]:
    """`keys` in `holder_order`: a view of a KeyTable, a list otherwise."""
    table = isinstance(keys, KeyTable)
    keys = keys if table else list(keys)
    endpoints, holder, address, size = keys.replica_columns() if table else _placed(keys)
    order = holder_order(_by_name(endpoints, holder), address, size, capacity)
    if table:
        return keys.subset(np.frombuffer(keys.rows(), dtype=np.uint64)[order])
    return [keys[i] for i in order]
