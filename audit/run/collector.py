"""CPython's cyclic garbage collector, set for a process that scans.

A scan makes and drops millions of small objects per minute (key infos, replica rows, checks,
records), nearly none of them in a cycle. At CPython's default first threshold (700 net
allocations) the collector ran 6,110 times in a `check` of 200,000 keys and took 2.6 s of its
21 s, 43 of them full collections walking every object the process holds (docs/benchmarks.md).
Cycles are still collected, only after more allocations; what start-up made (modules, the CLI) is
frozen out of every collection.
"""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 50_000  # net allocations between collections of the youngest generation (CPython: 700)


def tune_for_scanning() -> None:
    """For the auditor's own processes (the CLI, its Ray workers); never inside a producer's."""
    gc.freeze()
    young, middle, oldest = gc.get_threshold()
    gc.set_threshold(max(YOUNG_THRESHOLD, young), middle, oldest)
