"""One command's flow: list keys, scan them, merge the records, hand the report to a sink.

Ctrl-C (SIGINT) stops between batches and still writes the report (marked interrupted); a
second Ctrl-C aborts at once.
"""

from __future__ import annotations

import re
import signal
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone

from audit.checks.host import HostChecker
from audit.connection import AdminClient, Settings, open_store
from audit.errors import AuditError
from audit.fetch import ALIGNMENT, LeaseReader
from audit.merge import merge_records
from audit.progress import ScanProgress
from audit.records import KeyRecord, Report
from audit.scan import scan_keys
from audit.sources import AdminListing, KeyFilter


@dataclass
class ScanOptions:
    prefix: str = ""
    match: str | None = None
    buffer_mb: int = 256

    def key_filter(self) -> KeyFilter:
        try:
            pattern = re.compile(self.match) if self.match else None
        except re.error as error:
            raise AuditError(f"--match is not a valid regular expression: {error}") from None
        return KeyFilter(self.prefix, pattern)


@dataclass
class _StopOnSigint:
    event: threading.Event = field(default_factory=threading.Event)

    def __enter__(self):
        if threading.current_thread() is not threading.main_thread():
            self._previous = None
            return self.event
        self._previous = signal.getsignal(signal.SIGINT)

        def handler(signum, frame):
            if self.event.is_set():
                raise KeyboardInterrupt
            self.event.set()

        signal.signal(signal.SIGINT, handler)
        return self.event

    def __exit__(self, *exc_info):
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


def _buffer_bytes(keys: list, limit: int) -> int:
    """No more than the scan needs: a small scan should not allocate and register 256 MiB."""
    total = sum(ALIGNMENT + (key.size or 0) for key in keys)
    return min(limit, 2 * max(total, ALIGNMENT))


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def run_scan(settings: Settings, options: ScanOptions, sink, progress: ScanProgress | None = None) -> Report:
    progress = progress or ScanProgress(enabled=False)
    key_filter = options.key_filter()
    admin = AdminClient(settings.admin)
    admin.health()
    store = open_store(settings)
    context = {
        "started_at": _now(),
        "cluster": {"master": settings.master, "admin": settings.admin},
        "filters": {"prefix": options.prefix, "match": options.match},
        "read_mode": "lease",
        "checker": "numpy",
    }
    records: list[KeyRecord] = []
    interrupted = False
    started = time.perf_counter()
    try:
        listing = AdminListing(admin, key_filter, size_of=store.get_size).list()
        records.extend(_vanished_records(listing.vanished))
        keys = listing.keys
        reader = LeaseReader(store, _buffer_bytes(keys, options.buffer_mb << 20))
        progress.start(len(keys), sum(key.size or 0 for key in keys))
        try:
            with _StopOnSigint() as stop:
                watch = _MasterWatch(admin, stop)
                for record in scan_keys(keys, reader, HostChecker(), stop=stop, on_batch=watch):
                    records.append(record)
                    sink.record(record)
                    progress.advance(1, record.size or 0)
                interrupted = stop.is_set()
                if watch.lost:
                    context["aborted"] = watch.lost
        finally:
            duration_s = time.perf_counter() - started
            progress.stop()
            reader.close()
        keys_listed = len(keys) + len(listing.vanished)
    except AuditError:
        if not records:
            raise
        interrupted, keys_listed = True, len(records)
        duration_s = time.perf_counter() - started
    finally:
        store.close()
    context["finished_at"] = _now()
    report = merge_records(records, context=context, keys_listed=keys_listed, interrupted=interrupted,
                           duration_s=duration_s)
    sink.finish(report)
    return report


def _vanished_records(names: list[str]) -> list[KeyRecord]:
    from audit.records import Verdict

    return [KeyRecord(key=name, size=None, fields={}, verdicts=[Verdict.VANISHED],
                      error={"code": -704, "name": "OBJECT_NOT_FOUND", "message": "gone before sizing"})
            for name in names]
