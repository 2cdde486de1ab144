"""Why a scan stops early, cleanly, between batches: Ctrl-C or SIGTERM, a lost master, a deadline.

Each sets the same `threading.Event` the scan core checks between batches, so every early stop
ends the same way: the records so far are merged and the report is written.
"""

from __future__ import annotations

import signal
import threading

from audit.connection import AdminClient
from audit.errors import AuditError
from audit.records import KeyRecord


class StopOnSignals:
    """SIGINT (Ctrl-C) or SIGTERM (systemd stop, Kubernetes, `timeout`): finish the current batch and
    write the report. A second signal does not wait: Ctrl-C raises KeyboardInterrupt, and SIGTERM
    falls back to its default action, which ends the process even inside a blocking read."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.event = threading.Event()
        self.received: str | None = None
        self._previous: dict = {}

    def __enter__(self) -> threading.Event:
        if threading.current_thread() is threading.main_thread():
            for signum in self.SIGNALS:
                self._previous[signum] = signal.getsignal(signum)
                signal.signal(signum, self._handle)
        return self.event

    def _handle(self, signum, frame) -> None:
        if self.received is not None:
            raise KeyboardInterrupt
        self.received = signal.Signals(signum).name
        self.event.set()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)

    def __exit__(self, *exc_info) -> None:
        for signum, previous in self._previous.items():
            if signum == signal.SIGTERM and self.received is not None:
                continue  # stopping already: a second SIGTERM while the report is written or clients close ends it
            signal.signal(signum, previous)


class MasterWatch:
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


class Deadline:
    """`--deadline`: stop cleanly between batches once the time is up."""

    def __init__(self, seconds: float | None, stop: threading.Event):
        self.reached = False
        self._timer = None if seconds is None else threading.Timer(seconds, self._expire, args=(stop,))
        if self._timer is not None:
            self._timer.daemon = True
            self._timer.start()

    def _expire(self, stop: threading.Event) -> None:
        self.reached = True
        stop.set()

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
