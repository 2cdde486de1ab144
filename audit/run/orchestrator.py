"""One command's flow: list keys, select, read and check them, merge the records, hand the
report to a sink and the metrics to Prometheus.

Ctrl-C, SIGTERM, a lost master or a deadline stop the scan between batches (`audit.run.stops`); the
report, the checkpoint and the metrics are still written, marked interrupted (exit 3).
"""

from __future__ import annotations

import os
import re
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from audit.connection import AdminClient, Settings, open_store
from audit.run.device import Placement
from audit.errors import AuditError
from audit.readers.buffers import ALIGNMENT
from audit.readers.lease import LeaseReader
from audit.layouts import summarize
from audit.judge.chunks import ChunkIndex
from audit.judge.merge import merge_records
from audit.judge.plan import CheckPlan
from audit.run.progress import ScanProgress
from audit.records import KeyInfo, KeyRecord, Report, Verdict
from audit.run.checkpoint import Checkpoint
from audit.forensics.evidence import EvidenceStore
from audit.report.metrics import export_metrics
from audit.run.scan import scan_keys
from audit.sources.selection import select_keys
from audit.sources.listing import AdminListing, KeyFilter
from audit.run.statedir import StateDir
from audit.run.stops import Deadline, MasterWatch, StopOnSignals
from audit.readers.throttle import ThrottledReader


@dataclass
class ScanOptions:
    prefix: str = ""
    match: str | None = None
    buffer_mb: int = 256
    plan: CheckPlan = field(default_factory=CheckPlan)
    placement: Placement = field(default_factory=lambda: Placement("cpu", "numpy"))
    # Cron-friendly bounds (see docs/cron.md)
    sample: int | float | None = None         # keys, or a fraction of the listing
    seed: int = 0
    state_dir: Path | None = None             # lock + keys seen before (sampled runs read every new key)
    deadline_s: float | None = None
    max_bandwidth: float | None = None        # bytes per second
    checkpoint: Path | None = None
    resume: bool = False
    prom_file: Path | None = None
    pushgateway: str | None = None
    evidence_dir: Path | None = None          # flagged keys' bytes and sidecars
    read_mode: str = "lease"                  # lease: batch_get_into; peek: lease-free raw reads (docs/read-modes.md)
    verify_writer_checksum: bool = False      # Mooncake verifies the writer's CRC-64 on read (docs/verdicts.md)
    ray: str | None = None                    # a Ray address: shards read by Ray tasks (docs/scale-out.md)
    shard_mb: int = 1024                      # bytes per Ray task

    def scope(self, settings: Settings) -> dict:
        """What a checkpoint belongs to: resuming another scan's checkpoint would mix reports."""
        return {"master": settings.master, "admin": settings.admin, "prefix": self.prefix, "match": self.match,
                "sample": self.sample, "seed": self.seed}

    def key_filter(self) -> KeyFilter:
        try:
            pattern = re.compile(self.match) if self.match else None
        except re.error as error:
            raise AuditError(f"--match is not a valid regular expression: {error}") from None
        return KeyFilter(self.prefix, pattern)


def _buffer_bytes(keys: list[KeyInfo], options: ScanOptions) -> int:
    """No more than the scan needs (a small scan should not register 256 MiB); under a bandwidth
    limit, batches of about a quarter second, so the pace is even."""
    total = sum(ALIGNMENT + (key.size or 0) for key in keys)
    half = min(options.buffer_mb << 19, max(total, ALIGNMENT))
    if options.max_bandwidth:
        largest = max((key.size or 0 for key in keys), default=0)
        half = min(half, max(int(options.max_bandwidth / 4), largest + ALIGNMENT))
    return 2 * half


def _verify_writer_checksum(options: ScanOptions) -> None:
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


def _plan_context(plan: CheckPlan, listed: set[str]) -> dict:
    context: dict = {}
    if plan.layouts:
        context["layouts"] = [summarize(layout) for layout in plan.layouts]
    if plan.tables is not None:
        context["block_tables"] = plan.tables.summary(listed)
    return context


def _select(keys: list[KeyInfo], options: ScanOptions, state: StateDir | None, context: dict) -> list[KeyInfo]:
    new = state.new_keys([key.name for key in keys]) if state is not None else set()
    selected = select_keys(keys, options.sample, options.seed, always=new if options.sample is not None else set())
    if options.sample is not None:
        context["sample"] = {"requested": options.sample, "seed": options.seed, "new_keys": len(new)}
    return selected


def _reader(settings: Settings, admin: AdminClient, store, keys: list[KeyInfo], options: ScanOptions):
    if options.read_mode == "lease":
        return LeaseReader(store, _buffer_bytes(keys, options), options.placement.buffer_type)
    if options.placement.device != "cpu":
        raise AuditError("--read-mode peek reads into host memory: use it with --device cpu")
    from audit.readers.peek import PeekReader

    return PeekReader(settings, admin, _buffer_bytes(keys, options))


def _confirm(records: list[KeyRecord], confirm) -> None:
    """A lease-free read may race a re-put: findings stand only if a second read sees the same bytes."""
    from audit.readers.confirm import apply_confirmation

    by_key = {record.key: record for record in records}
    for key, confirmation in confirm(list(by_key.values())).items():
        apply_confirmation(by_key[key], confirmation)


def _confirm_shared(records: list[KeyRecord], reader) -> None:
    """SHARED_CONTENT is known only across keys: confirm its members once the scan is done."""
    merge_records(records, context={}, keys_listed=len(records))  # marks SHARED_CONTENT (idempotent)
    pending = [r for r in records if Verdict.SHARED_CONTENT in r.verdicts and "confirmation" not in r.evidence]
    if pending:
        _confirm(pending, reader.confirm)


def _after_batch(confirm, checkpoint: Checkpoint | None, watch: MasterWatch):
    """What follows each checked batch, here and in a Ray task: findings read again (peek), the
    checkpoint, the master's health."""
    def after_batch(batch: list[KeyRecord]) -> None:
        findings = [record for record in batch if record.is_finding and record.xxh3 is not None]
        if confirm is not None and findings:
            _confirm(findings, confirm)
        if checkpoint is not None:
            checkpoint.append(batch)
        watch(batch)
    return after_batch


def _read_here(settings, admin, store, keys, checker, options: ScanOptions, stop: threading.Event,
               checkpoint: Checkpoint | None, evidence: EvidenceStore | None, emit, records: list[KeyRecord]):
    """This process reads every key; the reason it stopped early, if it did."""
    reader = base_reader = _reader(settings, admin, store, keys, options)
    if options.max_bandwidth:
        reader = ThrottledReader(reader, options.max_bandwidth, stop)
    try:
        reason = _read_all(keys, reader, checker, options, stop, MasterWatch(admin, stop), checkpoint, evidence,
                           emit, getattr(base_reader, "confirm", None))
        if hasattr(base_reader, "confirm"):
            _confirm_shared(records, base_reader)
    finally:
        reader.close()
    return reason


def _read_all(keys, reader, checker, options: ScanOptions, stop: threading.Event, watch: MasterWatch,
              checkpoint: Checkpoint | None, evidence: EvidenceStore | None, emit, confirm=None) -> str | None:
    """Scan `keys`, handing each record to `emit`; the reason the scan stopped early, if it did.
    `confirm` (peek reads): findings are read a second time before they are reported."""
    deadline = Deadline(options.deadline_s, stop)
    try:
        for record in scan_keys(keys, reader, checker, options.plan, stop=stop,
                                on_batch=_after_batch(confirm, checkpoint, watch), evidence=evidence):
            emit(record)
    finally:
        deadline.cancel()
    if watch.lost:
        return watch.lost
    if deadline.reached:
        return f"deadline of {options.deadline_s:g} s reached"
    return None


def run_scan(settings: Settings, options: ScanOptions, sink, progress: ScanProgress | None = None) -> Report:
    """List, select, read and check; merge; write the report and metrics. Raises AuditError only
    when nothing could be scanned (exit 2); later failures end in an incomplete report."""
    progress = progress or ScanProgress(enabled=False)
    key_filter = options.key_filter()
    checker = options.placement.checker()
    state = StateDir(options.state_dir) if options.state_dir is not None else None
    closers: list = []  # closing the store takes about a second: after the report is out
    exporting = options.prom_file is not None or options.pushgateway is not None
    try:
        signals = StopOnSignals()
        with signals:
            report = _scan(settings, options, sink, progress, key_filter, checker, state, signals, closers)
        sink.finish(report)
        if exporting:
            export_metrics(report, options.prom_file, options.pushgateway)
    except AuditError:
        if exporting:
            export_metrics(None, options.prom_file, options.pushgateway)
        raise
    finally:
        if state is not None:
            state.release()
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
    ray_scan = RayScan.connect(options.ray, settings)
    closers.append(ray_scan.close)
    return ray_scan


def _scan(settings, options, sink, progress, key_filter, checker, state, signals: StopOnSignals,
          closers: list) -> Report:
    stop = signals.event
    admin = AdminClient(settings.admin)
    admin.health()
    if options.verify_writer_checksum:
        _verify_writer_checksum(options)
    store = open_store(settings)
    closers.append(store.close)
    ray_scan = _connect_ray(settings, options, closers) if options.ray is not None else None
    context = {
        "started_at": _now(),
        "cluster": {"master": settings.master, "admin": settings.admin},
        "filters": {"prefix": options.prefix, "match": options.match},
        "read_mode": options.read_mode,
        **({"writer_checksum_verified": True} if options.verify_writer_checksum else {}),
        "device": options.placement.device,
        "checker": checker.name,
    }
    records: list[KeyRecord] = []
    chunks = None
    interrupted = False
    keys_listed = keys_selected = 0
    checkpoint = None
    evidence = EvidenceStore(options.evidence_dir) if options.evidence_dir is not None else None
    started = time.perf_counter()
    try:
        listing = AdminListing(admin, key_filter, size_of=store.get_size).list()
        keys_listed = len(listing.keys) + len(listing.vanished)
        chunks = ChunkIndex.of((key.name, key.size) for key in listing.keys)
        if options.plan.requests:  # the producer's dtypes and block sizes, from the sizes it wrote
            context["layout_inference"] = options.plan.fit_sizes(listing.keys)
        context.update(_plan_context(options.plan, {key.name for key in listing.keys}))
        keys = _select(listing.keys, options, state, context)
        records.extend(_vanished_before_sizing(listing.vanished if options.sample is None else []))
        keys_selected = len(keys) + len(records)
        if options.checkpoint is not None:
            checkpoint = Checkpoint(options.checkpoint, options.scope(settings), options.resume)
            records.extend(record for name, record in checkpoint.done.items())
            keys = [key for key in keys if key.name not in checkpoint.done]
            context["resumed_keys"] = len(checkpoint.done)
        progress.start(len(keys), sum(key.size or 0 for key in keys))

        def emit(record: KeyRecord) -> None:
            records.append(record)
            sink.record(record)
            progress.advance(1, record.size or 0)

        try:
            if ray_scan is not None:
                reason = ray_scan.read(keys, options, stop, checkpoint, emit, records, context)
            else:
                reason = _read_here(settings, admin, store, keys, checker, options, stop, checkpoint, evidence,
                                    emit, records)
        finally:
            progress.stop()
        interrupted = stop.is_set()
        reason = reason or (f"{signals.received} received" if signals.received else None)
        if reason:
            context["aborted"] = reason
    except AuditError as error:
        if not records:
            raise
        interrupted = True
        context["aborted"] = str(error)
    finally:
        duration_s = time.perf_counter() - started
        if checkpoint is not None:
            checkpoint.close()
        if state is not None:
            state.remember(record.key for record in records)
    context["finished_at"] = _now()
    report = merge_records(records, context=context, keys_listed=max(keys_listed, len(records)),
                           keys_selected=max(keys_selected, len(records)), interrupted=interrupted,
                           duration_s=duration_s, chunks=chunks)
    if evidence is not None:
        evidence.finish(report)
    return report
