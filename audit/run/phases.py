"""Where a whole process's seconds go: `scan --verbose` and `check --verbose` print one line per phase
on stderr (docs/benchmarks.md, "Phases of a whole process").

A phase is timed with `time.perf_counter` at the orchestrator's boundaries; a phase entered several
times (the store client set up late, buffers registered per reader) adds up. The reading phase is
also split by what the main thread did meanwhile: waiting for a fetch, checking and judging a batch,
what follows each batch. The start of the process comes from the kernel (`/proc/self/stat`), so the
interpreter's own start-up and the imports before the first line of the CLI are counted too.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager


def process_age_s() -> float | None:
    """Seconds since this process started, as the kernel counts it (10 ms steps); None off Linux."""
    try:
        with open("/proc/self/stat", "rb") as handle:
            fields = handle.read().rsplit(b")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22, starttime, in clock ticks after boot
        return max(time.clock_gettime(time.CLOCK_BOOTTIME) - started, 0.0)
    except (OSError, ValueError, IndexError, AttributeError):
        return None


class Phases:
    """Seconds per named phase, in the order first entered; sub-phases (`within`) print indented."""

    def __init__(self, cli_started: float | None = None):
        now = time.perf_counter()
        age = process_age_s()
        self.process_started = None if age is None else now - age  # on the perf_counter clock
        self.created = now
        self._seconds: dict[str, float] = {}
        self._within: dict[str, str] = {}
        self._rest: dict[str, str] = {}
        if cli_started is not None:
            if self.process_started is not None and cli_started >= self.process_started:
                self.add("interpreter start-up", cli_started - self.process_started)
            self.add("imports, option parsing", now - cli_started)
        elif self.process_started is not None:
            self.add("start-up, imports, option parsing", now - self.process_started)

    def add(self, name: str, seconds: float, within: str | None = None) -> None:
        self._seconds[name] = self._seconds.get(name, 0.0) + seconds
        if within is not None:
            self._within[name] = within

    @contextmanager
    def phase(self, name: str, within: str | None = None) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - started, within)

    def rest(self, parent: str, label: str) -> None:
        """Name what `parent` spent beyond its sub-phases (printed as one more sub-phase)."""
        self._rest[parent] = label

    def seconds(self) -> dict[str, float]:
        return dict(self._seconds)

    def lines(self) -> list[str]:
        """One line per phase (sub-phases under their phase), then the total since the process
        started (or since this object was made)."""
        now = time.perf_counter()
        start = self.process_started if self.process_started is not None else self.created
        total = now - start
        top = [name for name in self._seconds if self._within.get(name) not in self._seconds]
        rows: list[tuple[str, float]] = []
        for name in top:
            rows.append((name, self._seconds[name]))
            children = [child for child, parent in self._within.items() if parent == name]
            for child in children:
                rows.append(("  " + child, self._seconds[child]))
            if children and name in self._rest:
                rows.append(("  " + self._rest[name],
                             max(self._seconds[name] - sum(self._seconds[c] for c in children), 0.0)))
        width = max([len(label) for label, _ in rows] + [32])
        lines = [f"{label:<{width}} {seconds:8.3f} s" for label, seconds in rows]
        accounted = sum(self._seconds[name] for name in top)
        lines.append(f"{'other (between phases)':<{width}} {max(total - accounted, 0.0):8.3f} s")
        origin = "process start" if self.process_started is not None else "the command's start"
        lines.append(f"{'total since ' + origin:<{width}} {total:8.3f} s (interpreter exit not included)")
        return lines


class NoPhases(Phases):
    """What a run without --verbose times: nothing (the same calls, no bookkeeping)."""

    def __init__(self):
        self._seconds = {}
        self._within = {}
        self._rest = {}
        self.process_started = None
        self.created = time.perf_counter()

    def add(self, name: str, seconds: float, within: str | None = None) -> None:
        return None

    def rest(self, parent: str, label: str) -> None:
        return None
