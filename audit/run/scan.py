"""The scan core: a set of keys in, one record per key out.

Fetching and checking overlap: while batch i is checked, batch i+1 is already being read into the
other buffer. The function knows nothing about listing or output, so a coordinator (Ray, say)
can hand each machine its share of keys and merge the records with `audit.judge.merge`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

from audit.readers.buffers import FetchedBatch, plan_batches
from audit.judge.key import judge_read
from audit.judge.plan import CheckPlan
from audit.readers.replicas import judge_replicas
from audit.records import KeyInfo, KeyRecord


def check_batch(batch: FetchedBatch, checker, plan: CheckPlan, evidence=None) -> list[KeyRecord]:
    """Judge every key of a fetched batch; values read whole are checked in one checker call.
    `evidence` (an EvidenceStore) sees each value while its bytes are still in the buffer."""
    try:
        layouts = [plan.layout_for(slot.key) for slot in batch.slots]
        readable = [i for i, (slot, code) in enumerate(zip(batch.slots, batch.results))
                    if code >= 0 and code == slot.key.size]
        items = []
        for i in readable:
            slot, layout = batch.slots[i], layouts[i]
            fits = layout if layout is not None and layout.size == slot.key.size else None
            items.append((slot.offset, slot.key.size, fits))
        checks = dict(zip(readable, checker.check_values(batch.buffer.array, items)))
        records = [judge_read(slot.key, code, checks.get(i), layout=layouts[i], table=plan.table_entry(slot.key),
                              keep_regions=plan.keep_regions)
                   for i, (slot, code) in enumerate(zip(batch.slots, batch.results))]
        if batch.replicas is not None:  # a peek read: every replica's digest
            for record, rows in zip(records, batch.replicas):
                judge_replicas(record, rows)
        if evidence is not None:
            for i in readable:
                slot = batch.slots[i]
                evidence.consider(slot.key, records[i], batch.view(slot, slot.key.size))
        return records
    finally:
        batch.release()


def scan_keys(keys: Sequence[KeyInfo], reader, checker, plan: CheckPlan | None = None, *,
              stop: threading.Event | None = None,
              on_batch: Callable[[list[KeyRecord]], None] | None = None, evidence=None) -> Iterator[KeyRecord]:
    """Read and check `keys`; yields each key's record as soon as its batch is checked.

    `stop` ends the scan cleanly between batches (keys not reached get no record).
    """
    plan = plan or CheckPlan()
    batches = list(plan_batches(keys, reader.capacity))
    if not batches:
        return
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="fetch") as pool:
        pending = pool.submit(reader.fetch, batches[0], 0)
        for turn in range(len(batches)):
            fetched = pending.result()
            stopping = stop is not None and stop.is_set()
            if turn + 1 < len(batches) and not stopping:
                pending = pool.submit(reader.fetch, batches[turn + 1], turn + 1)
            records = check_batch(fetched, checker, plan, evidence)
            if on_batch is not None:
                on_batch(records)
            yield from records
            if stopping:
                return
