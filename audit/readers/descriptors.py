"""Where a key's bytes are, asked without leasing anything: `/batch_query_keys` descriptors.

A raw read is only as good as the descriptor it used, so a lease-free reader asks twice: once to
know where to read, once afterwards to know whether what it read still belonged to the key.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from audit.connection import AdminClient

GONE = None  # the master no longer knows the key (OBJECT_NOT_FOUND)


class Replica(NamedTuple):
    """One memory replica: the holder's segment (its transfer endpoint) and the bytes' address there.
    A named tuple: made, hashed and compared per key per batch, twice over on peek reads."""

    endpoint: str
    address: int
    size: int

    def to_json(self) -> dict:
        return {"endpoint": self.endpoint, "address": self.address, "size": self.size}


def _memory_replicas(answer: dict) -> list[Replica]:
    # Only memory replicas ("values") have an address a transfer engine can read; disk replicas do not.
    return [Replica(str(r["transport_endpoint_"]), int(r["buffer_address_"]), int(r["size_"]))
            for r in answer.get("values") or []]


def query_replicas(admin: AdminClient, names: Iterable[str]) -> dict[str, list[Replica] | None]:
    """Per key, its memory replicas in the master's order, or GONE.

    Keys holding a comma cannot be asked for (the master splits on it) and are left out of the
    answer; a key whose only replicas are on disk maps to an empty list.
    """
    askable = [name for name in names if "," not in name]
    found: dict[str, list[Replica] | None] = {}
    for name, answer in admin.query(askable):
        if answer.get("ok"):
            found[name] = _memory_replicas(answer)
        elif answer.get("error") == "OBJECT_NOT_FOUND":
            found[name] = GONE
        else:
            found[name] = []
    return found
