"""What the master says it holds, asked beside the listing, so that a run can tell what it did not see.

`master_key_count` counts every key of every tenant, and a put from its start; `/get_all_keys`
lists the default tenant's readable keys only. The count is read just before the listing and
just after it: a key put meanwhile raises only the second reading, a key removed meanwhile lowers
only the second, so the smaller of the two is what the listing is held against (`keys_held`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from audit.connection import AdminClient


@dataclass(frozen=True)
class Tenant:
    name: str
    charged_bytes: int


@dataclass
class Census:
    keys_before_listing: int | None = None
    keys_after_listing: int | None = None
    tenants: list[Tenant] | None = None     # None: the master runs without tenants
    listed: int = 0                         # keys the listing showed, before --prefix/--match
    outside_filter: int = 0                 # of those, left out by --prefix/--match
    through_client: int = 0                 # keys the admin API could not answer for, sized by the client
    audited_tenants: list[str] = field(default_factory=list)  # other tenants read through their own client
    named: dict[str, int] = field(default_factory=dict)       # per audited tenant: named keys it holds
    named_outside_filter: int = 0           # names of audited tenants left out by --prefix/--match
    not_sampled: int = 0                    # keys in scope that --sample left out
    tiers: dict | None = None               # per replica tier, of the keys selected (judge.coverage.replica_tiers)

    @classmethod
    def before_listing(cls, admin: AdminClient) -> Census:
        quotas = admin.tenant_quotas()
        tenants = None if quotas is None else [
            Tenant(str(row.get("tenant_id")), int(row.get("charged_bytes") or 0)) for row in quotas]
        return cls(keys_before_listing=admin.key_count(), tenants=tenants)

    @property
    def keys_held(self) -> int | None:
        readings = [n for n in (self.keys_before_listing, self.keys_after_listing) if n is not None]
        return min(readings) if readings else None

    def tenant_names(self) -> list[str]:
        return [tenant.name for tenant in self.tenants or []]
