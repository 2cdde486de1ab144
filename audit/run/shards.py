"""Keys cut into shards for `--ray`: grouped by the host that holds their first replica, each
shard bounded in bytes and keys, so one Ray task reads one holder's bytes and a lost task loses
little.

Pure data: it knows the listing's replica endpoints (`/batch_query_keys`, lease-free), not Ray.
"""

from __future__ import annotations

from array import array
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

from audit.records import KeyInfo
from audit.sources.keytable import KeyTable, as_table

SHARD_MAX_KEYS = 20_000  # a shard of tiny values is still a few MB of key names and records


@dataclass(slots=True)
class Shard:
    """Rows of the listing's KeyTable: the shard's KeyInfo objects are made when its task is
    submitted, never all shards' at once."""

    index: int
    host: str | None          # the holder's host; None: no replica known (a key holding a comma)
    table: KeyTable
    rows: array = field(default_factory=lambda: array("q"))
    nbytes: int = 0

    def add(self, key: KeyInfo) -> None:
        self.rows.append(key.ordinal)
        self.nbytes += key.size or 0

    @property
    def keys(self) -> list[KeyInfo]:
        return [self.table.info(row) for row in self.rows]


def holder_host(key: KeyInfo) -> str | None:
    """The host part of the first replica's transfer endpoint (`host:port`, `[v6]:port`)."""
    endpoint = key.replicas[0].get("endpoint") if key.replicas else None
    if not endpoint:
        return None
    endpoint = str(endpoint)
    host = endpoint.rsplit(":", 1)[0] if ":" in endpoint else endpoint
    return host.strip("[]") or None


def plan_shards(keys: Sequence[KeyInfo], max_bytes: int, max_keys: int = SHARD_MAX_KEYS) -> list[Shard]:
    """Shards in listing order within a host, hosts interleaved: with fewer task slots than shards,
    every holder is read from the start instead of one after another."""
    keys = as_table(keys)
    by_host: dict[str | None, list[Shard]] = defaultdict(list)
    for key in keys:
        host = holder_host(key)
        shards = by_host[host]
        size = key.size or 0
        if not shards or (shards[-1].rows and (shards[-1].nbytes + size > max_bytes
                                               or len(shards[-1].rows) >= max_keys)):
            shards.append(Shard(0, host, keys))
        shards[-1].add(key)
    ordered: list[Shard] = []
    queues = list(by_host.values())
    for turn in range(max((len(queue) for queue in queues), default=0)):
        ordered.extend(queue[turn] for queue in queues if turn < len(queue))
    for index, shard in enumerate(ordered):
        shard.index = index
    return ordered
