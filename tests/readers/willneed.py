"""The read-ahead's WILLNEED calls as the kernel is asked them, for tests (`audit.readers.readahead`)."""

from __future__ import annotations

import os
import threading
import time

from audit.readers import readahead


class WillNeedCalls:
    """Each WILLNEED the read-ahead makes, as (file, offset, length), then made; every other advice as is."""

    def __init__(self, monkeypatch):
        self.calls: list[tuple[str, int, int]] = []
        self.made = threading.Condition()
        advise = os.posix_fadvise

        def recorded(descriptor, offset, length, advice):
            if advice == os.POSIX_FADV_WILLNEED:
                with self.made:
                    self.calls.append((os.readlink(f"/proc/self/fd/{descriptor}"), offset, length))
                    self.made.notify_all()
            return advise(descriptor, offset, length, advice)
        monkeypatch.setattr(readahead.os, "posix_fadvise", recorded)

    def settled(self, count: int, quiet_s: float = 0.3) -> list[tuple[str, int, int]]:
        """The calls, once there are `count` and no more came for `quiet_s`."""
        with self.made:
            assert self.made.wait_for(lambda: len(self.calls) >= count, timeout=10), self.calls
        time.sleep(quiet_s)
        with self.made:
            return list(self.calls)
