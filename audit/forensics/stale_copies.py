"""`purge --stale-disk-copies`: take out of the holders' offload directories the SSD copies that a
report names as listed for no key (`offload.latent`) and unlike the bytes in memory, keeping the key.

Mooncake's bucket backend offloads a key once: a key removed and put again keeps its first value's
copy in its bucket, which the master does not list and a restart of the holder registers again in
place of the bytes in memory; put again on another holder of the host, the key is offloaded there
and the first holder's copy stays beside the new one (docs/read-modes.md). Each copy named is
taken out alone, where the report found it, and only while it still holds the bytes the report
named and either its key's current copy still lies beside it (the one the master lists, or
the newest), or the master lists the key's disk copy on another holder than this copy's
(`directory_owners`: a key put again on another host), or the master lists no disk copy of the
key (an audited tenant's key: as its tenant's client describes it, which grants a lease and keeps
the key, and names no holder); its bytes are saved first
(`audit.forensics.disk_copies.quarantine`). A copy holding the bytes in memory is left: after a
restart it serves the same value.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path

import xxhash

from audit.connection import AdminClient, Settings, open_store
from audit.errors import AuditError
from audit.forensics.disk_copies import DEFAULT_TENANT, quarantine, value_bytes
from audit.forensics.purge import PurgeOutcome
from audit.judge.crossref import read_report
from audit.readers.buckets import StoredValue, stored_key
from audit.readers.descriptors import query_answers
from audit.readers.disk import holder_of
from audit.readers.offload_index import OffloadIndex, copies_holding, index_directories
from audit.sources.tenants import tenant_key_tiers


def stale_copies_of_report(path: Path) -> list[dict]:
    """The report's copies listed for no key that are unlike the bytes in memory."""
    summary, _, _ = read_report(path)
    latent = (summary.get("offload") or {}).get("latent")
    if latent is None:
        raise AuditError(f"{path} reports no offload directory: scan with --offload-dir first")
    if latent["copies"] > len(latent["named"]):
        raise AuditError(f"{path} names {len(latent['named'])} of its {latent['copies']} copies: scan again after "
                         f"taking these out")
    return [row for row in latent["named"] if row["xxh3"] != row["memory_xxh3"]]


def take_out_stale_copies(settings: Settings, rows: Iterable[dict], offload_dirs: tuple[Path, ...], *,
                          execute: bool, evidence_dir: Path | None,
                          on_outcome: Callable[[PurgeOutcome], None]) -> list[PurgeOutcome]:
    """Each named copy: `would-take-out` (a dry run), `taken-out` (with its `disk_copies` row),
    `listed` (the master lists a disk copy of the key now, on this copy's holder or one it cannot
    tell from it, and the key's current copy does not lie beside this one), `gone` (no directory
    here holds the copy where the report found it), or `changed` (it holds other bytes than the
    report named)."""
    if not offload_dirs:
        raise AuditError("--stale-disk-copies needs --offload-dir (the holder's MOONCAKE_OFFLOAD_FILE_STORAGE_PATH)")
    admin = AdminClient(settings.admin)
    holders = _Holders(admin, offload_dirs)
    tenants: dict[str, object] = {}
    outcomes = []
    try:
        for row in rows:
            key, place, tenant = row["key"], (row["file"], row["offset"]), row.get("tenant") or DEFAULT_TENANT
            if tenant == DEFAULT_TENANT:
                listed_at = partial(_listed_at, admin)
            else:
                if tenant not in tenants:
                    tenants[tenant] = open_store(settings, tenant=tenant)
                listed_at = partial(_tenant_listed_at, tenants[tenant])
            outcome = PurgeOutcome(key, _action(row, tenant, listed_at, holders.of, offload_dirs), row["xxh3"])
            if outcome.action == "take-out":
                outcome.action = "would-take-out"
                if execute:
                    outcome.disk_copies = quarantine(offload_dirs, [key], evidence_dir, {place}, tenant).get(key, [])
                    outcome.action = "taken-out" if outcome.disk_copies else "gone"
            outcomes.append(outcome)
            on_outcome(outcome)
    finally:
        for client in tenants.values():
            client.close()
    return outcomes


class _Holders:
    """Each offload directory's holder (`holder_of`), the directories indexed once a copy's is asked."""

    def __init__(self, admin: AdminClient, offload_dirs: tuple[Path, ...]):
        self.admin, self.offload_dirs = admin, offload_dirs
        self.index: OffloadIndex | None = None

    def of(self, copy: StoredValue) -> str | None:
        if self.index is None:
            self.index = index_directories(self.offload_dirs)
        return holder_of(self.admin, self.index, copy)


def _listed_at(admin: AdminClient, key: str) -> set[str]:
    """The holders (offload endpoints) the master lists the key's disk copies on; empty: none."""
    return {str(replica.get("transport_endpoint"))
            for replica in (query_answers(admin, [key]).get(key) or {}).get("local_disk_values") or []}


def _tenant_listed_at(client, key: str) -> set[str] | None:
    """Asked through the tenant's client, the only way to another tenant's key: a lease, which
    leaves the key in place (this purge keeps it). None: listed on disk, on a holder not named."""
    return None if "local_disk" in (tenant_key_tiers(client, key) or set()) else set()


def _action(row: dict, tenant: str, listed_at: Callable[[str], set[str] | None],
            holder_of: Callable[[StoredValue], str | None], offload_dirs: tuple[Path, ...]) -> str:
    copies = {(str(value.path), value.value_offset): value
              for values in copies_holding(offload_dirs, {stored_key(tenant, row["key"])}).values()
              for value in values}
    copy = copies.get((row["file"], row["offset"]))
    if copy is None:
        return "gone"
    if xxhash.xxh3_64_hexdigest(value_bytes(copy)) != row["xxh3"]:
        return "changed"
    current = row.get("current_copy")
    if current is not None and (current.get("file"), current.get("offset")) in copies:
        return "take-out"  # the key's current copy stays: the one listed, or the newest
    holders = listed_at(row["key"])
    if holders == set():
        return "take-out"  # no disk copy of the key listed
    on_another_holder = holders is not None and holder_of(copy) not in {*holders, None}
    return "take-out" if on_another_holder else "listed"
