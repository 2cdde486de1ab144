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


def query_answers(admin: AdminClient, names: Iterable[str]) -> dict[str, dict]:
    """Per key, the master's answer as it gave it. Keys holding a comma cannot be asked for (the
    master splits on it) and are left out."""
    return dict(admin.query(name for name in names if "," not in name))


def replicas_of(answer: dict) -> list[Replica] | None:
    """An answer's memory replicas in the master's order, or GONE; a key whose only replicas are
    on disk, or that the master refused, has an empty list."""
    if answer.get("ok"):
        return _memory_replicas(answer)
    return GONE if answer.get("error") == "OBJECT_NOT_FOUND" else []


def names_only(answer: dict, replica: Replica) -> bool:
    """Whether `answer` gives the key exactly one memory replica, `replica`: what nearly every key
    read lease-free finds after the read, decided with no Replica made."""
    values = answer.get("values")
    if not answer.get("ok") or type(values) is not list or len(values) != 1:
        return False
    only = values[0]
    return (only.get("transport_endpoint_") == replica.endpoint and only.get("buffer_address_") == replica.address
            and only.get("size_") == replica.size)


def query_replicas(admin: AdminClient, names: Iterable[str]) -> dict[str, list[Replica] | None]:
    """Per key, its memory replicas in the master's order, or GONE (`replicas_of`); keys holding a
    comma are left out of the answer."""
    return {name: replicas_of(answer) for name, answer in query_answers(admin, names).items()}
