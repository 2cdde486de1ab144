"""Progress on stderr (keys, bytes, GB/s, ETA): shown on a terminal, or when asked for."""

from __future__ import annotations

import sys


class ScanProgress:
    """One line: a bar by bytes, keys done of total, bytes, rate, ETA."""

    def __init__(self, enabled: bool | None = None):
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self._progress = None
        self._task = None
        self._keys_done = 0

    def start(self, total_keys: int, total_bytes: int) -> None:
        if not self.enabled:
            return
        # rich is imported only where a bar is shown: a cron run pays none of it
        from rich.console import Console
        from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                                   TransferSpeedColumn)

        self._progress = Progress(
            TextColumn("scan"), BarColumn(),
            TextColumn("{task.fields[keys_done]}/{task.fields[keys_total]} keys"),
            DownloadColumn(binary_units=True), TransferSpeedColumn(), TimeRemainingColumn(),
            console=Console(stderr=True))
        self._progress.start()
        self._task = self._progress.add_task("scan", total=total_bytes, keys_done=0, keys_total=total_keys)

    def advance(self, keys: int, nbytes: int) -> None:
        if self._progress is None:
            return
        self._keys_done += keys
        self._progress.update(self._task, advance=nbytes, keys_done=self._keys_done)

    def stop(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
