"""Offload files asked of the device ahead of the disk reader.

The disk reader maps each value (`audit.readers.mapped`) and the checks fault its pages in: the
kernel reads around each fault, the device idles while a batch is checked, and the checks wait
while it reads. A thread asks the kernel for the values the reader will map next
(`POSIX_FADV_WILLNEED`, in calls of at most 8 MiB, as much as the kernel reads for one), in the
reader's order, staying at most a window ahead of the batch being mapped: the device streams the
files as `cat` would, and what it reads ahead stays bounded by the window whatever the store's
size. Under `--max-bandwidth` the reader asks for none (the pace is the point). Measured in
docs/benchmarks.md ("The disk tier read ahead").
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable
from contextlib import suppress
from pathlib import Path

CALL_BYTES = 8 << 20  # the kernel reads at most the device's read-ahead (here 8 MiB) a WILLNEED
WINDOW_BYTES = 512 << 20
MEMORY_SHARE = 8  # and at most an eighth of the host's available memory


def window_bytes() -> int:
    """How far ahead to read: WINDOW_BYTES, or an eighth of the memory available now if less."""
    try:
        with open("/proc/meminfo") as meminfo:
            available = next(int(line.split()[1]) << 10 for line in meminfo if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return WINDOW_BYTES
    return min(WINDOW_BYTES, available // MEMORY_SHARE)


def calls(extents: Iterable[tuple[Path, int, int]]) -> list[tuple[Path, int, int]]:
    """(file, offset, length) extents in reading order, as WILLNEED calls: extents that follow one
    another in a file joined, then cut at CALL_BYTES."""
    joined: list[list] = []
    for path, offset, length in extents:
        if joined and joined[-1][0] == path and joined[-1][1] + joined[-1][2] == offset:
            joined[-1][2] += length
        elif length > 0:
            joined.append([path, offset, length])
    return [(path, start, min(CALL_BYTES, offset + length - start))
            for path, offset, length in joined for start in range(offset, offset + length, CALL_BYTES)]


class ReadAhead:
    """One plan of extents asked for in order by a thread of its own; `reached(position)` (bytes of
    the plan before the batch being mapped) lets it go on, `close()` ends it."""

    def __init__(self, extents: Iterable[tuple[Path, int, int]], window: int):
        self.window = window
        self._calls = calls(extents)
        self._reached = 0
        self._closed = False
        self._moved = threading.Condition()
        self._thread = threading.Thread(target=self._ask, name="read-ahead", daemon=True)
        self._thread.start()

    def reached(self, position: int) -> None:
        with self._moved:
            self._reached = max(self._reached, position)
            self._moved.notify()

    def _ask(self) -> None:
        asked, opened = 0, None
        try:
            for path, offset, length in self._calls:
                with self._moved:
                    while not self._closed and asked + length > self._reached + self.window:
                        self._moved.wait()
                    if self._closed:
                        return
                if opened is None or opened[0] != path:
                    if opened is not None:
                        os.close(opened[1])
                    try:
                        opened = path, os.open(path, os.O_RDONLY)
                    except OSError:  # gone since it was indexed: the reader says so
                        opened = None
                if opened is not None:
                    with suppress(OSError):  # only a hint: the reader reads it all the same
                        os.posix_fadvise(opened[1], offset, length, os.POSIX_FADV_WILLNEED)
                asked += length
        finally:
            if opened is not None:
                os.close(opened[1])

    def close(self) -> None:
        with self._moved:
            self._closed = True
            self._moved.notify()
        self._thread.join()
