"""Other tenants' keys: the names key sources give, looked up through a Mooncake client of each tenant.

The admin API answers for the default tenant only and no route lists another tenant's keys, so
these keys come from names (`audit.sources.named`) and every look-up and read goes through a
client that joined the tenant: `get_size` and `batch_get_into`, which grant the key a read lease
(no lease-free way reaches another tenant).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from audit.blocktables import DEFAULT_TENANT
from audit.errors import ERROR_NAMES, AuditError
from audit.records import KeyInfo, KeyRecord, Verdict
from audit.sources.census import Census
from audit.sources.listing import KeyFilter
from audit.sources.named import NamedKey

ALL = "all"
OBJECT_NOT_FOUND = -704


def resolve_tenants(requested: Sequence[str], census: Census) -> list[str]:
    """The other tenants `--tenant` asks for (`all`: every tenant the master has but the default)."""
    if not requested:
        return []
    if census.tenants is None:
        raise AuditError("--tenant: this master runs without tenants (/api/v1/tenant_quotas answered 409): "
                         "the listing already covers every key")
    known = census.tenant_names()
    chosen: list[str] = []
    for name in requested:
        for tenant in known if name == ALL else [name]:
            if tenant not in known:
                raise AuditError(f"--tenant {tenant}: the master has no such tenant (it has {', '.join(known)})")
            if tenant != DEFAULT_TENANT and tenant not in chosen:
                chosen.append(tenant)
    return chosen


@dataclass
class TenantKeys:
    """What one tenant holds of the names given: keys to read, and records for the rest."""

    tenant: str
    keys: list[KeyInfo] = field(default_factory=list)
    records: list[KeyRecord] = field(default_factory=list)  # VANISHED, or sizing failed


def _not_found(name: str, tenant: str | None, code: int, searched: list[str]) -> KeyRecord:
    verdict = Verdict.VANISHED if code == OBJECT_NOT_FOUND else Verdict.READ_ERROR
    return KeyRecord(key=name, size=None, fields=None, verdicts=[verdict], tenant=tenant,
                     evidence={"named_by_source": {"tenants_searched": searched}},
                     error={"code": code, "name": ERROR_NAMES.get(code, "UNKNOWN"), "message": "named by a key source"})


def find_tenant_keys(named: Sequence[NamedKey], tenants: Sequence[str], listed: set[str], key_filter: KeyFilter,
                     size_in: Callable[[str, str], int]) -> tuple[list[TenantKeys], list[KeyRecord], int]:
    """Per tenant, the named keys it holds; the records of names found nowhere; and how many names
    of the tenants given are outside the filter (counted, not looked up: a look-up grants a lease).

    A name whose source gives its tenant is looked for there; a name without one (a key list) in
    every tenant given, and it is VANISHED only if no tenant holds it and the listing does not show it.
    `size_in(tenant, name)`: the value's size, or a negative error code.
    """
    found = {tenant: TenantKeys(tenant) for tenant in tenants}
    unplaced: list[KeyRecord] = []
    outside_filter = 0
    for key in named:
        if key.tenant is not None and key.tenant not in found:
            continue  # a tenant not audited (the default's keys are listed)
        if not key_filter(key.name):
            outside_filter += 1
            continue
        searched = [key.tenant] if key.tenant is not None else list(tenants)
        codes = []
        for tenant in searched:
            size = size_in(tenant, key.name)
            if size >= 0:
                found[tenant].keys.append(KeyInfo(name=key.name, size=size, tenant=tenant))
            codes.append(size)
        if any(code >= 0 for code in codes) or (key.tenant is None and key.name in listed):
            continue
        failure = next((code for code in codes if code != OBJECT_NOT_FOUND), OBJECT_NOT_FOUND)
        record = _not_found(key.name, key.tenant, failure, searched)
        (found[key.tenant].records if key.tenant is not None else unplaced).append(record)
    return list(found.values()), unplaced, outside_filter


def tenant_key_tiers(client, name: str) -> set[str] | None:
    """The tiers holding `name` as its tenant's client describes it (`memory`, `local_disk`,
    `disk`); None when it holds none. Grants the key a lease, as every look-up through a tenant's
    client does."""
    try:
        replicas = client.get_replica_desc(name)
    except RuntimeError:
        return None
    tiers = {"memory" if replica.is_memory_replica() else "local_disk" if replica.is_local_disk_replica()
             else "disk" if replica.is_disk_replica() else "other" for replica in replicas}
    return tiers or None
