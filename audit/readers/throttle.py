"""`--max-bandwidth`: a reader wrapper that paces fetches so the scan's average byte rate stays at
or below the limit (a scrubber must bound its own cost, like Ceph's and HDFS's)."""

from __future__ import annotations

import threading
import time


class ThrottledReader:
    def __init__(self, reader, bytes_per_s: float, stop: threading.Event | None = None):
        self.reader = reader
        self.bytes_per_s = bytes_per_s
        self.stop = stop
        self.mode = reader.mode
        self._started: float | None = None
        self._granted = 0

    @property
    def capacity(self) -> int:
        return self.reader.capacity

    def order(self, keys):
        return self.reader.order(keys)

    def fetch(self, slots, turn):
        """Start the batch only once every byte read so far, this batch's included, fits the budget."""
        now = time.monotonic()
        if self._started is None:
            self._started = now
        self._granted += sum(slot.key.size or 0 for slot in slots)
        ready_at = self._started + self._granted / self.bytes_per_s
        while now < ready_at and not (self.stop is not None and self.stop.is_set()):
            time.sleep(min(ready_at - now, 0.1))
            now = time.monotonic()
        return self.reader.fetch(slots, turn)

    def close(self) -> None:
        self.reader.close()
