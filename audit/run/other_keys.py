"""Keys the run's main reader cannot reach, found and read so that they are audited, not skipped:
other tenants' keys (named by key sources, read through a client of their tenant) and, where the
main reader reads lease-free, keys the admin API cannot describe (a comma in the name, a refused
query, no memory replica), read through the store client, with a lease; but for the disk-only
keys stored in a holder's offload directory on this host (`--offload-dir`), read from its files
in peek mode (`audit.readers.disk`), with none.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from audit.connection import AdminClient, Settings, open_store
from audit.errors import AuditError
from audit.judge.plan import CheckPlan
from audit.readers.disk import DiskReader, on_disk_only
from audit.readers.lease import LeaseReader
from audit.readers.throttle import ThrottledReader
from audit.records import KeyInfo, KeyRecord
from audit.sources.keytable import KeyTable
from audit.run.options import ScanOptions
from audit.run.reading import after_batch_hook, buffer_bytes
from audit.run.scan import scan_keys
from audit.run.stops import Deadline, MasterWatch
from audit.sources.census import Census
from audit.sources.listing import KeyFilter, Listing, admin_readable
from audit.sources.named import read_named_keys, recorded_keys
from audit.sources.tenants import find_tenant_keys, resolve_tenants


class TenantClients:
    """One store client per tenant, set up on first use; `None` is the run's own (default-tenant) client."""

    def __init__(self, settings: Settings, default: Callable, closers: list):
        self.settings = settings
        self.default = default
        self.closers = closers
        self._clients: dict[str, object] = {}

    def client(self, tenant: str | None):
        if tenant is None:
            return self.default()
        if tenant not in self._clients:
            self._clients[tenant] = open_store(self.settings, tenant=tenant)
            self.closers.append(self._clients[tenant].close)
        return self._clients[tenant]


@dataclass
class OtherKeys:
    """Groups of keys to read with a lease, each through its tenant's client, and the records of
    named keys no tenant holds."""

    groups: list[tuple[str | None, list[KeyInfo]]] = field(default_factory=list)
    records: list[KeyRecord] = field(default_factory=list)

    @property
    def keys(self) -> list[KeyInfo]:
        return [key for _, keys in self.groups for key in keys]


def take_census_after(census: Census, admin: AdminClient, listing: Listing) -> None:
    """The second key count, at once after the listing, and what the listing showed."""
    census.keys_after_listing = admin.key_count()
    census.listed = len(listing.keys) + len(listing.vanished) + listing.outside_filter
    census.outside_filter = listing.outside_filter
    census.through_client = listing.through_client


def find_other_tenants_keys(census: Census, options: ScanOptions, plan: CheckPlan, listing: Listing,
                            key_filter: KeyFilter, clients: TenantClients) -> OtherKeys:
    """`--tenant`: the keys the key sources name, looked up in each tenant asked for."""
    tenants = resolve_tenants(options.tenants, census)
    if options.key_files and not tenants:
        raise AuditError("--keys names other tenants' keys (the listing has the default tenant's): give --tenant")
    if not tenants:
        return OtherKeys()
    if options.checkpoint is not None:
        raise AuditError("--checkpoint does not cover other tenants' keys yet: run --tenant without it")
    named = read_named_keys(options.key_files) + recorded_keys(plan.tables)
    found, unplaced, census.named_outside_filter = find_tenant_keys(named, tenants, {key.name for key in listing.keys}, key_filter,
                                       lambda tenant, name: clients.client(tenant).get_size(name))
    census.audited_tenants = tenants
    census.named = {tenant.tenant: len(tenant.keys) for tenant in found}
    return OtherKeys(groups=[(tenant.tenant, tenant.keys) for tenant in found],
                     records=unplaced + [record for tenant in found for record in tenant.records])


def split_lease_only(keys: KeyTable, options: ScanOptions, on_ray: bool = False) -> tuple[KeyTable, list[KeyInfo]]:
    """Peek reads address a key by its memory replica's descriptor: the keys without one go to the
    store client (lease reads need no split). With `--ray` and `--offload-dir`, a disk-only key
    stays: the Ray task placed on its holder's host reads it from the offload directory there."""
    if options.read_mode != "peek":
        return keys, []
    if on_ray and options.offload_dirs:
        return keys.split(lambda key: admin_readable(key) or on_disk_only(key))
    return keys.split(admin_readable)  # a key with one memory replica in the table is admin-readable


def read_other_keys(other: OtherKeys, clients: TenantClients, admin: AdminClient, checker, options: ScanOptions,
                    stop: threading.Event, watch: MasterWatch, evidence, emit, started: float) -> str | None:
    """Read each group with a lease reader of its tenant (the default tenant's disk-only keys found in
    `--offload-dir` with a disk reader); the reason it stopped early, if it did. `started`: when the
    run's reading began, so that --deadline bounds the whole run."""
    remaining = None if options.deadline_s is None else max(options.deadline_s - (time.perf_counter() - started), 0)
    deadline = Deadline(remaining, stop)
    try:
        for tenant, keys in other.groups:
            if stop.is_set() or not keys:
                continue
            if tenant is None and options.read_mode == "peek" and options.offload_dirs:
                disk = DiskReader(admin, options.offload_dirs, buffer_bytes(keys, options),
                                  read_ahead=not options.max_bandwidth)
                on_disk, keys = disk.split(keys)
                _read_group(on_disk, disk, disk.confirm, tenant, checker, options, stop, watch, evidence, emit)
            if keys and not stop.is_set():
                reader = LeaseReader(clients.client(tenant), buffer_bytes(keys, options), options.placement.buffer_type)
                _read_group(keys, reader, None, tenant, checker, options, stop, watch, evidence, emit)
    finally:
        deadline.cancel()
    if watch.lost:
        return watch.lost
    return f"deadline of {options.deadline_s:g} s reached" if deadline.reached else None


def _read_group(keys, reader, confirm, tenant, checker, options: ScanOptions, stop, watch, evidence, emit) -> None:
    """One group of keys through `reader` (paced by --max-bandwidth); findings read again by `confirm`."""
    if not keys:
        return
    if options.max_bandwidth:
        reader = ThrottledReader(reader, options.max_bandwidth, stop)
    try:
        for record in scan_keys(keys, reader, checker, options.plan, stop=stop,
                                on_batch=after_batch_hook(confirm, None, watch), evidence=evidence):
            record.tenant = tenant
            emit(record)
    finally:
        reader.close()
