"""One command's flow: list keys, select, read and check them, merge the records, hand the
report to a sink and the metrics to Prometheus.

Ctrl-C, SIGTERM, a lost master or a deadline stop the scan between batches (`audit.run.stops`); the
report, the checkpoint and the metrics are still written, marked interrupted (exit 3).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from datetime import datetime, timezone
from functools import partial

from audit.connection import AdminClient, Settings, open_store
from audit.connection import _reachable as reachable
from audit.readers.engine import metadata_reachable
from audit.errors import AuditError
from audit.layouts import summarize
from audit.judge.chunks import ChunkIndex
from audit.judge.duplicates import replication_from
from audit.judge.ledger import RecordLedger
from audit.judge.merge import merge_records
from audit.judge.plan import CheckPlan
from audit.judge.purged import PurgedKeys
from audit.readers.disk import DiskCopies, in_both_tiers, listed_on_disk
from audit.readers.offload_index import given_holders
from audit.run.progress import ScanProgress
from audit.records import KeyInfo, KeyRecord, Report, Verdict
from audit.run.checkpoint import Checkpoint
from audit.forensics.evidence import EvidenceStore
from audit.run.scan import scan_keys
from audit.sources.selection import select_keys
from audit.sources.keytable import KeyTable
from audit.sources.listing import AdminListing
from audit.run.statedir import StateDir
from audit.run.options import ScanOptions
from audit.run.phases import NoPhases, Phases
from audit.run.reading import after_batch_hook, confirm_shared, make_reader, read_samples, reader_memory_ahead
from audit.run.stops import Deadline, MasterWatch, StopOnSignals
from audit.run.other_keys import (OtherKeys, TenantClients, find_other_tenants_keys, read_other_keys, split_lease_only,
                                  take_census_after)
from audit.judge.coverage import replica_tiers
from audit.sources.census import Census
from audit.sources.tenants import tenant_key_tiers
from audit.readers.throttle import ThrottledReader


def enable_writer_checksum(options: ScanOptions) -> None:
    """Mooncake's client reads MOONCAKE_STORE_CHECKSUM once per process, at its first read: it
    verifies the CRC-64 a writer stored (when the writer had it on) on full-object lease reads."""
    if options.read_mode != "lease":
        raise AuditError("--verify-writer-checksum needs --read-mode lease: raw peek reads bypass Mooncake's check")
    os.environ["MOONCAKE_STORE_CHECKSUM"] = "1"


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _vanished_before_sizing(names: list[str]) -> list[KeyRecord]:
    return [KeyRecord(key=name, size=None, fields=None, verdicts=[Verdict.VANISHED],
                      error={"code": -704, "name": "OBJECT_NOT_FOUND", "message": "gone before sizing"})
            for name in names]


def _plan_context(plan: CheckPlan, listed: KeyTable) -> dict:
    context: dict = {}
    if plan.layouts:
        context["layouts"] = [summarize(layout) for layout in plan.layouts]
    if plan.tables is not None:
        context["block_tables"] = plan.tables.summary(set(listed.names()))
    if plan.manifests is not None:
        context["manifests"] = [manifest.summary() for manifest in plan.manifests.manifests]
    return context


def _select(keys: KeyTable, options: ScanOptions, state: StateDir | None, context: dict) -> KeyTable:
    new = state.new_keys(keys.names()) if state is not None and options.sample is not None else set()
    selected = select_keys(keys, options.sample, options.seed, always=new if options.sample is not None else set())
    if options.sample is not None:
        context["sample"] = {"requested": options.sample, "seed": options.seed, "new_keys": len(new)}
    return selected


def _by_disk_tier(keys: KeyTable) -> tuple[dict[str, KeyInfo], dict[str, KeyInfo]]:
    """The keys with a memory replica and a disk copy on a holder's SSD (`local_disk`), by name
    (read from memory, their disk copies are compared with what was read), and every key listed
    with a disk copy, by name (the others' copies on disk are ones no master lists)."""
    _, unusual = keys.unusual()
    on_disk = {key.name: key for key in unusual if listed_on_disk(key)}
    return {name: key for name, key in on_disk.items() if in_both_tiers(key)}, on_disk


def _tenant_holds(other: OtherKeys, tenants: list[str]) -> Callable[[str, str], bool | None]:
    """Whether the run's look-ups found an audited tenant holding a key a key source named (True),
    not holding it (False: named, found in no tenant searched), or did not look (None)."""
    held = {(tenant, key.name) for tenant, keys in other.groups if tenant is not None for key in keys}
    not_held = {(tenant, record.key) for record in other.records if Verdict.VANISHED in record.verdicts
                for tenant in ([record.tenant] if record.tenant is not None else tenants)}
    return lambda tenant, name: True if (tenant, name) in held else False if (tenant, name) in not_held else None


def _resume(keys: KeyTable, done: dict[str, KeyRecord], records: RecordLedger) -> KeyTable:
    """The keys a checkpoint has not done yet; the done ones' records, with their listed rows."""
    rest = []
    for row in keys.rows():
        record = done.get(keys.name(row))
        if record is None:
            rest.append(row)
        elif record.ordinal is None:
            record.ordinal = row
    for record in done.values():
        records.add(record)
    return keys.subset(rest)


def _read_here(settings, admin, store, keys, checker, options: ScanOptions, stop: threading.Event,
               checkpoint: Checkpoint | None, evidence: EvidenceStore | None, emit, records: RecordLedger,
               phases: Phases, transfer=None, memory=None):
    """This process reads every key; the reason it stopped early, if it did. No key to read: no
    reader (a transfer engine, registered buffers), and no store client for it. `store` and
    `transfer` may be callables that set them up on first use; `memory`: the reader's host memory,
    touched ahead (`reader_memory_ahead`)."""
    if not len(keys):  # what setting them up would find out first: the master, the metadata server
        if options.read_mode == "lease":
            reachable(settings.master)
        elif not metadata_reachable(settings):
            transfer() if callable(transfer) else None
        return None
    store = store() if callable(store) else store
    transfer = transfer() if callable(transfer) and options.read_mode == "peek" else None
    with phases.phase("buffer registration"):
        reader = base_reader = make_reader(settings, admin, store, keys, options, transfer, memory)
    if options.max_bandwidth:
        reader = ThrottledReader(reader, options.max_bandwidth, stop)
    first = len(records)
    try:
        try:
            reason = _read_all(keys, reader, checker, options, stop, MasterWatch(admin, stop), checkpoint, evidence,
                               emit, getattr(base_reader, "confirm", None), phases)
        finally:
            records.sort_from(first)  # read in the reader's order (peek: by holder), reported in the listing's
        if hasattr(base_reader, "confirm"):
            with phases.phase("confirming shared content (peek)"):
                confirm_shared(records, base_reader)
    finally:
        with phases.phase("reader close (buffers)"):
            reader.close()
    return reason


def _read_all(keys, reader, checker, options: ScanOptions, stop: threading.Event, watch: MasterWatch,
              checkpoint: Checkpoint | None, evidence: EvidenceStore | None, emit, confirm=None,
              phases: Phases | None = None) -> str | None:
    """Scan `keys`, handing each record to `emit`; the reason the scan stopped early, if it did.
    `confirm` (peek reads): findings are read a second time before they are reported."""
    phases = phases or NoPhases()
    deadline = Deadline(options.deadline_s, stop)
    try:
        with phases.phase("reading and judging (wall)"):
            for record in scan_keys(keys, reader, checker, options.plan, stop=stop,
                                    on_batch=after_batch_hook(confirm, checkpoint, watch), evidence=evidence,
                                    phases=phases):
                emit(record)
    finally:
        deadline.cancel()
    if watch.lost:
        return watch.lost
    if deadline.reached:
        return f"deadline of {options.deadline_s:g} s reached"
    return None


def run_scan(settings: Settings, options: ScanOptions, sink, progress: ScanProgress | None = None,
             phases: Phases | None = None) -> Report:
    """List, select, read and check; merge; write the report and metrics. Raises AuditError only
    when nothing could be scanned (exit 2); later failures end in an incomplete report. `phases`
    (`--verbose`): the seconds of each phase of the run are added to it."""
    progress = progress or ScanProgress(enabled=False)
    phases = phases or NoPhases()
    key_filter = options.key_filter()
    checker = options.placement.checker()
    state = StateDir(options.state_dir) if options.state_dir is not None else None
    closers: list = []  # the store and the transfer engine, closed after the report is out
    exporting = options.prom_file is not None or options.pushgateway is not None
    if exporting:  # prometheus_client only where metrics are asked for
        from audit.report.metrics import export_metrics
    try:
        signals = StopOnSignals()
        with signals:
            report = _scan(settings, options, sink, progress, key_filter, checker, state, signals, closers, phases)
        with phases.phase("report"):
            sink.finish(report)
        if exporting:
            with phases.phase("metrics"):
                export_metrics(report, options.prom_file, options.pushgateway)
    except AuditError:
        if exporting:
            export_metrics(None, options.prom_file, options.pushgateway)
        raise
    finally:
        if state is not None:
            state.release()
        with phases.phase("close"):
            for close in closers:
                close()
    return report


def _connect_ray(settings: Settings, options: ScanOptions, closers: list):
    """Before listing: a missing Ray or an unreachable Ray cluster is a reason not to run (exit 2)."""
    try:
        from audit.run.distributed import RayScan
    except ModuleNotFoundError as error:
        if error.name != "ray":
            raise
        raise AuditError("--ray needs Ray, which is not installed: pip install 'mooncake-audit[ray]'") from None
    if options.evidence_dir is not None:
        raise AuditError("--evidence writes bytes on the machine that read them: run it without --ray")
    if given_holders(options.offload_dirs):
        raise AuditError("--offload-dir DIR=ENDPOINT names one holder's directory, and each host's Ray task reads DIR "
                         "of its own holder: give DIR alone with --ray")
    ray_scan = RayScan.connect(options.ray, settings)
    closers.append(ray_scan.close)
    return ray_scan


class _TransferWhenNeeded:
    """Peek reads' transfer engine, started on first use and shared by the sample reads that choose
    a reading and the scan; closed with the store, after the report is out."""

    def __init__(self, settings: Settings, closers: list, phases: Phases | None = None):
        self.settings = settings
        self.closers = closers
        self.phases = phases or NoPhases()
        self._transfer = None

    def __call__(self):
        if self._transfer is None:
            from audit.readers.engine import RawTransfer

            with self.phases.phase("transfer engine start"):
                self._transfer = RawTransfer(self.settings)
            self.closers.append(self._transfer.close)
        return self._transfer


class _StoreWhenNeeded:
    """The Mooncake store client, set up on first use: peek reads never need it (only a key the admin
    API cannot size does), and lease reads need it only once the keys are listed. A master it cannot
    reach still fails before any read."""

    def __init__(self, settings: Settings, closers: list, phases: Phases | None = None):
        self.settings = settings
        self.closers = closers
        self.phases = phases or NoPhases()
        self._store = None

    def client(self):
        if self._store is None:
            with self.phases.phase("store client setup"):
                self._store = open_store(self.settings)
            self.closers.append(self._store.close)
        return self._store


def _scan(settings, options, sink, progress, key_filter, checker, state, signals: StopOnSignals,
          closers: list, phases: Phases) -> Report:
    stop = signals.event
    connecting = time.perf_counter()
    admin = AdminClient(settings.admin)
    admin.health()
    if options.verify_writer_checksum:
        enable_writer_checksum(options)
    store = _StoreWhenNeeded(settings, closers, phases)
    transfer = _TransferWhenNeeded(settings, closers, phases)
    ray_scan = _connect_ray(settings, options, closers) if options.ray is not None else None
    phases.add("connect (admin health, Ray)", time.perf_counter() - connecting)
    context = {
        "started_at": _now(),
        "cluster": {"master": settings.master, "admin": settings.admin},
        "filters": {"prefix": options.prefix, "match": options.match},
        "read_mode": options.read_mode,
        **({"writer_checksum_verified": True} if options.verify_writer_checksum else {}),
        "device": options.placement.device,
        "checker": checker.name,
    }
    records = RecordLedger()  # until the listing's table takes over
    chunks = None
    interrupted = False
    keys_listed = keys_selected = 0
    checkpoint = None
    evidence = EvidenceStore(options.evidence_dir) if options.evidence_dir is not None else None
    started = time.perf_counter()
    clients = TenantClients(settings, store.client, closers)
    census = None
    purged = PurgedKeys(options.purge_logs) if options.purge_logs else None
    try:
        with phases.phase("listing (key counts, /get_all_keys, sizing)"):
            census = Census.before_listing(admin)
            listing = AdminListing(admin, key_filter, size_of=lambda key: store.client().get_size(key)).list()
            take_census_after(census, admin, listing)
        other = find_other_tenants_keys(census, options, options.plan, listing, key_filter, clients)
        keys_listed = len(listing.keys) + len(listing.vanished)
        records = RecordLedger(listing.keys)
        memory = reader_memory_ahead(listing.keys, options) if ray_scan is None else None
        with phases.phase("chunk index"):
            chunks = ChunkIndex.of_table(listing.keys).settle()
        if options.plan.requests or options.plan.manifests:  # the producer's layouts: its manifest, or its sizes
            with phases.phase("layout fit to the sizes"):
                context["layout_inference"] = options.plan.fit_sizes(listing.keys)
        if options.plan.readings:  # sizes that fit several readings: let a sample's bytes choose
            with phases.phase("readings chosen by sample bytes"):
                samples = options.plan.reading_samples(listing.keys)
                lease = store.client() if options.read_mode == "lease" else None
                read_samples(settings, admin, lease, samples, options, options.plan.add_sample, transfer, memory)
                options.plan.decide_readings()
        planning_rest = time.perf_counter()
        context.update(_plan_context(options.plan, listing.keys))
        keys = _select(listing.keys, options, state, context)
        census.not_sampled = len(listing.keys) - len(keys) if options.sample is not None else 0
        census.tiers = replica_tiers(keys, every_memory_replica=options.read_mode == "peek")
        for record in _vanished_before_sizing(listing.vanished if options.sample is None else []):
            records.add(record)
        keys_selected = len(keys) + len(records)
        if options.checkpoint is not None:
            checkpoint = Checkpoint(options.checkpoint, options.scope(settings), options.resume)
            keys = _resume(keys, checkpoint.done, records)
            context["resumed_keys"] = len(checkpoint.done)
        for record in other.records:
            records.add(record)
        keys_selected += len(other.keys) + len(other.records)
        disk_copies = DiskCopies(admin, options.offload_dirs) if options.offload_dirs else None
        in_both_tiers, disk_listed = _by_disk_tier(keys) if disk_copies is not None else ({}, {})
        keys, lease_only = split_lease_only(keys, options, on_ray=ray_scan is not None)
        other.groups.insert(0, (None, lease_only))
        progress.start(len(keys) + len(other.keys), keys.total_size() + sum(key.size or 0 for key in other.keys))
        phases.add("planning (selection, coverage tiers, checkpoint)", time.perf_counter() - planning_rest)

        def emit(record: KeyRecord) -> None:
            if disk_copies is not None and record.tenant is not None:  # an audited tenant's key
                disk_copies.tenant_copy(record, partial(tenant_key_tiers, clients.client(record.tenant)))
                disk_copies.superseded_copies(record)
            elif disk_copies is not None:
                if (both := in_both_tiers.get(record.key)) is not None:
                    disk_copies.compare(record, both)
                elif record.key not in disk_listed:
                    disk_copies.unlisted_copy(record)
                disk_copies.superseded_copies(record, disk_listed.get(record.key))
            if purged is not None:
                purged.judge(record)
            records.add(record)
            sink.record(record)
            progress.advance(1, record.size or 0)

        try:
            if ray_scan is not None:
                reason = ray_scan.read(keys, options, stop, checkpoint, emit, records, context)
            else:
                reason = _read_here(settings, admin, store.client if options.read_mode == "lease" else None,
                                    keys, checker, options, stop, checkpoint, evidence, emit, records, phases,
                                    transfer, memory)
            with phases.phase("reading other tenants' and lease-only keys"):
                reason = reason or read_other_keys(other, clients, admin, checker, options, stop,
                                                   MasterWatch(admin, stop), evidence, emit, started)
        finally:
            progress.stop()
        if disk_copies is not None:
            with phases.phase("offload directories (values no master lists)"):
                listed = {*listing.keys.names(), *listing.vanished}
                context["offload"] = disk_copies.summary(disk_copies.unlisted(
                    listed, key_filter, _tenant_holds(other, census.audited_tenants)))
                disk_tier = census.tiers.get("local_disk")
                if disk_tier:  # the copies compared were read after all
                    disk_tier["not_read"] = max(disk_tier["not_read"] - disk_copies.compared, 0)
        interrupted = stop.is_set()
        reason = reason or (f"{signals.received} received" if signals.received else None)
        if reason:
            context["aborted"] = reason
    except AuditError as error:
        if not len(records):
            raise
        interrupted = True
        context["aborted"] = str(error)
    finally:
        duration_s = time.perf_counter() - started
        if checkpoint is not None:
            checkpoint.close()
        if state is not None:
            with phases.phase("state dir (keys seen)"):
                state.remember(records.name_hashes())
    context["finished_at"] = _now()
    if options.plan.bindings is not None and options.plan.bindings.directories:
        context["binding"] = options.plan.bindings.summary(in_tasks=ray_scan is not None)
    with phases.phase("merge (cross-key verdicts, summary)"):
        report = merge_records(records, context=context, keys_listed=max(keys_listed, len(records)),
                               keys_selected=max(keys_selected, len(records)), interrupted=interrupted,
                               duration_s=duration_s, chunks=chunks, census=census,
                               replication=replication_from({r.name: r.config for r in options.plan.requests}),
                               fail_on=options.fail_on)
    if evidence is not None:
        evidence.finish(report)
    return report
