"""One command's flow: list keys, scan them, merge the records, hand the report to a sink.

Ctrl-C (SIGINT) stops between batches and still writes the report (marked interrupted); a
second Ctrl-C aborts at once. A master lost mid-scan stops the scan the same way.
"""

from __future__ import annotations

import re
import signal
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone

from audit.connection import AdminClient, Settings, open_store
from audit.device import Placement
from audit.errors import AuditError
from audit.fetch import ALIGNMENT, LeaseReader
from audit.layouts import summarize
from audit.merge import merge_records
from audit.plan import CheckPlan
from audit.progress import ScanProgress
from audit.records import KeyInfo, KeyRecord, Report, Verdict
from audit.scan import scan_keys
from audit.sources import AdminListing, KeyFilter


@dataclass
class ScanOptions:
    prefix: str = ""
    match: str | None = None
    buffer_mb: int = 256
    plan: CheckPlan = field(default_factory=CheckPlan)
    placement: Placement = field(default_factory=lambda: Placement("cpu", "numpy"))

    def key_filter(self) -> KeyFilter:
        try:
            pattern = re.compile(self.match) if self.match else None
        except re.error as error:
            raise AuditError(f"--match is not a valid regular expression: {error}") from None
        return KeyFilter(self.prefix, pattern)


class _StopOnSigint:
    """First Ctrl-C: finish the current batch and write the report. Second: abort."""

    def __init__(self):
        self.event = threading.Event()
        self._previous = None

    def __enter__(self) -> threading.Event:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.getsignal(signal.SIGINT)
            signal.signal(signal.SIGINT, self._handle)
        return self.event

    def _handle(self, signum, frame) -> None:
        if self.event.is_set():
            raise KeyboardInterrupt
        self.event.set()

    def __exit__(self, *exc_info) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


class _MasterWatch:
    """Stops the scan when a whole batch failed and the master no longer answers: without it,
    every remaining batch would wait out its RPC timeouts against a dead master."""

    def __init__(self, admin: AdminClient, stop: threading.Event):
        self.admin = admin
        self.stop = stop
        self.lost: str | None = None

    def __call__(self, records: list[KeyRecord]) -> None:
        if not records or any(record.error is None or record.error["code"] == -704 for record in records):
            return
        try:
            self.admin.health()
        except AuditError as error:
            self.lost = f"master lost mid-scan ({error})"
            self.stop.set()


def _buffer_bytes(keys: list[KeyInfo], limit: int) -> int:
    """No more than the scan needs: a small scan should not allocate and register 256 MiB."""
    total = sum(ALIGNMENT + (key.size or 0) for key in keys)
    return min(limit, 2 * max(total, ALIGNMENT))


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _vanished_before_sizing(names: list[str]) -> list[KeyRecord]:
    return [KeyRecord(key=name, size=None, fields={}, verdicts=[Verdict.VANISHED],
                      error={"code": -704, "name": "OBJECT_NOT_FOUND", "message": "gone before sizing"})
            for name in names]


def _plan_context(plan: CheckPlan, listed: set[str]) -> dict:
    context: dict = {}
    if plan.layouts:
        context["layouts"] = [summarize(layout) for layout in plan.layouts]
    if plan.tables is not None:
        context["block_tables"] = plan.tables.summary(listed)
    return context


def run_scan(settings: Settings, options: ScanOptions, sink, progress: ScanProgress | None = None) -> Report:
    progress = progress or ScanProgress(enabled=False)
    key_filter = options.key_filter()
    admin = AdminClient(settings.admin)
    admin.health()
    checker = options.placement.checker()
    store = open_store(settings)
    context = {
        "started_at": _now(),
        "cluster": {"master": settings.master, "admin": settings.admin},
        "filters": {"prefix": options.prefix, "match": options.match},
        "read_mode": "lease",
        "device": options.placement.device,
        "checker": checker.name,
    }
    records: list[KeyRecord] = []
    interrupted = False
    keys_listed = 0
    started = time.perf_counter()
    try:
        listing = AdminListing(admin, key_filter, size_of=store.get_size).list()
        records.extend(_vanished_before_sizing(listing.vanished))
        keys = listing.keys
        keys_listed = len(keys) + len(listing.vanished)
        context.update(_plan_context(options.plan, {key.name for key in keys}))
        reader = LeaseReader(store, _buffer_bytes(keys, options.buffer_mb << 20), options.placement.buffer_type)
        progress.start(len(keys), sum(key.size or 0 for key in keys))
        try:
            with _StopOnSigint() as stop:
                watch = _MasterWatch(admin, stop)
                for record in scan_keys(keys, reader, checker, options.plan, stop=stop, on_batch=watch):
                    records.append(record)
                    sink.record(record)
                    progress.advance(1, record.size or 0)
                interrupted = stop.is_set()
                if watch.lost:
                    context["aborted"] = watch.lost
        finally:
            progress.stop()
            reader.close()
    except AuditError as error:
        if not records:
            raise
        interrupted = True
        context["aborted"] = str(error)
    finally:
        duration_s = time.perf_counter() - started
        store.close()
    context["finished_at"] = _now()
    report = merge_records(records, context=context, keys_listed=max(keys_listed, len(records)),
                           interrupted=interrupted, duration_s=duration_s)
    sink.finish(report)
    return report
