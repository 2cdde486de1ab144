"""Key sources: which keys to audit, with their sizes, taken without leasing anything.

The admin listing (`/get_all_keys`) splits a key that holds a newline into several lines; lines
that the lease-free query does not know are rejoined with their neighbours until they name a key.
A key the lease-free query cannot answer for (one holding a comma, which `/batch_query_keys` splits
on; one it refuses or describes with no replica) is sized by the store client instead (`size_of`),
and counted (`through_client`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from audit.connection import AdminClient
from audit.records import KeyInfo

REJOIN_SPAN = 8                   # a key may hold up to this many newlines and still be found
REJOIN_LIMIT = 1_000              # unknown lines beyond this are reported as vanished, not rejoined
TIERS = {"values": "memory", "disk_values": "disk", "local_disk_values": "local_disk", "nof_values": "nof"}


@dataclass(frozen=True)
class KeyFilter:
    prefix: str = ""
    pattern: re.Pattern | None = None

    def __call__(self, key: str) -> bool:
        return key.startswith(self.prefix) and (self.pattern is None or self.pattern.search(key) is not None)


@dataclass
class Listing:
    """The keys found, plus the names that vanished between listing and sizing."""

    keys: list[KeyInfo]
    vanished: list[str]
    listed_lines: int
    outside_filter: int = 0   # listed lines --prefix/--match leaves out (a key with newlines: one per line)
    through_client: int = 0   # keys the admin API could not answer for, sized by the store client


def _key_info(name: str, answer: dict) -> KeyInfo | None:
    """Memory replicas first (readers and shards go by the first), then the other tiers'."""
    replicas = [{"tier": tier, "endpoint": r.get("transport_endpoint_"), "address": r.get("buffer_address_"),
                 "size": r.get("size_")} for field, tier in TIERS.items() for r in answer.get(field) or []]
    if not answer.get("ok") or not replicas:
        return None
    return KeyInfo(name=name, size=int(replicas[0]["size"] or 0), replicas=replicas)


def admin_readable(key: KeyInfo) -> bool:
    """Whether a lease-free read can address the key: the admin API described a memory replica."""
    return any(replica.get("tier") == "memory" for replica in key.replicas)


class AdminListing:
    """Every key of the cluster (default tenant), filtered, sized lease-free."""

    def __init__(self, admin: AdminClient, key_filter: KeyFilter = KeyFilter(),
                 size_of: Callable[[str], int] | None = None):
        self.admin = admin
        self.key_filter = key_filter
        self.size_of = size_of
        self._through_client = 0

    def list(self) -> Listing:
        self._through_client = 0
        body = self.admin.all_keys_body().decode("utf-8", errors="surrogateescape")
        lines = body.split("\n")
        if lines and lines[-1] == "":
            lines.pop()
        found: dict[str, KeyInfo] = {}
        unknown: list[int] = []
        wanted = [i for i, line in enumerate(lines) if line and self.key_filter(line)]
        answers = self._query(lines[i] for i in wanted)
        for i in wanted:
            info = answers.get(lines[i])
            if info is None:
                unknown.append(i)
            else:
                found.setdefault(info.name, info)
        vanished = self._rejoin(lines, unknown, found)
        return Listing(keys=list(found.values()), vanished=vanished, listed_lines=len(lines),
                       outside_filter=sum(1 for line in lines if line) - len(wanted),
                       through_client=self._through_client)

    def _query(self, names: Iterable[str]) -> dict[str, KeyInfo]:
        plain, unanswered = [], []
        for name in names:
            (unanswered if "," in name else plain).append(name)
        infos: dict[str, KeyInfo] = {}
        for name, answer in self.admin.query(plain):
            if (info := _key_info(name, answer)) is not None:
                infos[name] = info
            elif answer.get("error") != "OBJECT_NOT_FOUND":
                unanswered.append(name)  # refused, or known without a replica: the client may still read it
        for name in unanswered:
            size = self.size_of(name) if self.size_of else -1
            if size >= 0:
                infos[name] = KeyInfo(name=name, size=size)
                self._through_client += 1
        return infos

    def _rejoin(self, lines: list[str], unknown: list[int], found: dict[str, KeyInfo]) -> list[str]:
        """Rejoin unknown lines with neighbours (keys holding newlines); the rest vanished."""
        if not unknown:
            return []
        candidates: dict[str, tuple[int, int]] = {}
        for i in unknown[:REJOIN_LIMIT]:
            for start in range(max(0, i - REJOIN_SPAN), i + 1):
                for stop in range(i + 1, min(len(lines), start + REJOIN_SPAN + 1) + 1):
                    if stop - start >= 2:
                        candidates.setdefault("\n".join(lines[start:stop]), (start, stop))
        answers = self._query(name for name in candidates if self.key_filter(name))
        covered: set[int] = set()
        for name, info in answers.items():
            found.setdefault(name, info)
            start, stop = candidates[name]
            covered.update(range(start, stop))
        return [lines[i] for i in unknown if i not in covered]
