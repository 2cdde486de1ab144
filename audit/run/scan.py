"""The scan core: a set of keys in, one record per key out.

Fetching and checking overlap: while batch i is checked, batch i+1 is already being read into the
other buffer. The function knows nothing about listing or output, so a coordinator (Ray, say)
can hand each machine its share of keys and merge the records with `audit.judge.merge`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from audit.producers import SCREEN_BYTES, describe_themselves
from audit.readers.buffers import FetchedBatch, plan_batches
from audit.judge.binding import Values, bind_values
from audit.judge.key import judge_read, judge_readings
from audit.judge.plan import CheckPlan
from audit.judge.values import judge_reading, may_be_configured, model_configs, value_reading
from audit.readers.replicas import judge_replicas
from audit.records import KeyInfo, KeyRecord


def check_batch(batch: FetchedBatch, checker, plan: CheckPlan, evidence=None) -> list[KeyRecord]:
    """Judge every key of a fetched batch; values read whole are checked in one checker call,
    every reading of a value whose reading is undecided in the same pass over its bytes.
    `evidence` (an EvidenceStore) sees each value while its bytes are still in the buffer."""
    try:
        layouts = [plan.layout_for(slot.key) for slot in batch.slots]
        readable = [i for i, (slot, code) in enumerate(zip(batch.slots, batch.results))
                    if code >= 0 and code == slot.key.size]
        described = _described(batch, readable, plan)
        for i, (_, reading) in described.items():
            layouts[i] = reading.layout  # the value's own description, checked against its size
        readings = _open_readings(batch, plan, readable, layouts, described)
        checks, every_reading = _check(batch, checker, readable, layouts, readings)
        records = [judge_read(slot.key, code, checks.get(i), layout=layouts[i], table=plan.table_entry(slot.key),
                              keep_regions=plan.keep_regions)
                   for i, (slot, code) in enumerate(zip(batch.slots, batch.results))]
        for i, (fields, reading) in described.items():
            judge_reading(records[i], fields, reading, keep=plan.keep_regions)
        for i, layouts_of in readings.items():
            slot = batch.slots[i]
            records[i] = judge_readings(records[i], slot.key, batch.results[i], every_reading[i], layouts_of,
                                        plan.table_entry(slot.key))
        if plan.bindings is not None and plan.bindings.directories:  # the weights given: layer-0 binding
            placed = (batch.buffer.array, [slot.offset for slot in batch.slots])
            values = Values(readable, lambda i: batch.view(batch.slots[i], batch.slots[i].key.size), placed)
            bind_values(records, values, [readings.get(i) or ((layouts[i],) if layouts[i] is not None else ())
                                          for i in range(len(records))], plan.bindings)
            if plan.bindings.producers is not None:  # keys put by a producer that loaded other weights
                plan.bindings.producers.flag(records, plan.tables)
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


def _open_readings(batch: FetchedBatch, plan: CheckPlan, indexes: list[int], layouts: list,
                   described: dict) -> dict[int, tuple]:
    """The values at `indexes` whose reading is undecided (their group's, or their own value's):
    index -> every layout they may be read with, the one they are judged by first."""
    readings = {}
    if plan.readings:
        for i in indexes:
            if layouts[i] is not None and i not in described:
                readings[i] = plan.readings_of(layouts[i])
    for i, (_, reading) in described.items():
        readings[i] = (reading.layout, *reading.alternatives)
    return {i: layouts_of for i, layouts_of in readings.items()
            if len(layouts_of) > 1 and all(layout.size == batch.slots[i].key.size for layout in layouts_of)}


def _described(batch: FetchedBatch, indexes: list[int], plan: CheckPlan | None = None) -> dict:
    """The values at `indexes` that describe themselves (LMCache's), or that a model config of the
    plan's describes (LMCache's without a header): index -> (fields, reading). In host memory, the
    batch's first bytes are screened at once: most values are let go there, or by their key's name."""
    described = {}
    configs = model_configs(plan.requests) if plan is not None else {}
    array = batch.buffer.array
    if isinstance(array, np.ndarray) and indexes:
        offsets = np.array([batch.slots[i].offset for i in indexes], dtype=np.int64)
        sizes = np.array([batch.slots[i].key.size for i in indexes], dtype=np.int64)
        spans = np.arange(SCREEN_BYTES)
        within = spans[None, :] < sizes[:, None]
        first = np.where(within, array[np.minimum(offsets[:, None] + spans, len(array) - 1)], 0).astype(np.uint8)
        indexes = [i for i, screened in zip(indexes, describe_themselves(first, sizes))
                   if screened or configs and may_be_configured(batch.slots[i].key.name, configs)]
    for i in indexes:
        slot = batch.slots[i]
        if (found := value_reading(slot.key.name, batch.view(slot, slot.key.size), configs,
                                   slot.key.fields)) is not None:
            described[i] = found
    return described


def _check(batch: FetchedBatch, checker, indexes: list[int], layouts: list,
           readings: dict[int, tuple]) -> tuple[dict, dict]:
    """Check the values at `indexes`, each with its layout where the layout fits its size, and
    those in `readings` (index -> layouts) with every one of their layouts in the same pass:
    index -> its check, and index -> one check per layout of `readings`."""
    items = []
    for i in indexes:
        slot, layout = batch.slots[i], layouts[i]
        fits = layout if layout is not None and layout.size == slot.key.size else None
        items.append((slot.offset, slot.key.size, fits))
    if not readings:
        return dict(zip(indexes, checker.check_values(batch.buffer.array, items))), {}
    alone: dict[int, tuple] = {}  # one tuple per layout, so like values still run together
    items = [(offset, size, readings[i] if i in readings else
              alone.setdefault(id(fits), (fits,)) if fits is not None else ())
             for i, (offset, size, fits) in zip(indexes, items)]
    checked = dict(zip(indexes, checker.check_readings(batch.buffer.array, items)))
    return {i: checks[0] for i, checks in checked.items()}, {i: checked[i] for i in readings}


def scan_keys(keys: Sequence[KeyInfo], reader, checker, plan: CheckPlan | None = None, *,
              stop: threading.Event | None = None,
              on_batch: Callable[[list[KeyRecord]], None] | None = None, evidence=None,
              phases=None) -> Iterator[KeyRecord]:
    """Read and check `keys`, in the order the reader reads fastest (`reader.order`); yields each
    key's record once its batch is checked and `on_batch` has seen it.

    `on_batch` (findings read again on peek reads, the checkpoint, the master's health) runs for
    batch i once batch i+1 has been fetched and before batch i+2 is asked for: a second read of a
    finding then never waits behind a batch in flight on the same holder. `stop` ends the scan cleanly
    between batches (keys not reached get no record). `phases` (audit.run.phases.Phases): the main
    thread's seconds waiting for fetches, checking and judging, and in `on_batch` are added to it.
    """
    plan = plan or CheckPlan()
    batches = plan_batches(reader.order(keys), reader.capacity)  # planned as read: slots one batch ahead
    current = next(batches, None)
    if current is None:
        return
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="fetch") as pool:
        pending = pool.submit(reader.fetch, current, 0)
        turn = 0
        waited = checked = after = 0.0
        held: list[KeyRecord] | None = None  # the batch checked last: on_batch and yield still to come
        try:
            while pending is not None:
                started = time.perf_counter()
                try:
                    fetched, failure = pending.result(), None
                except Exception as error:  # noqa: BLE001 (raised below, once the batch before it is handed on)
                    fetched, failure = None, error
                fetched_at = time.perf_counter()
                waited += fetched_at - started
                if held is not None and on_batch is not None:
                    on_batch(held)
                    after += time.perf_counter() - fetched_at
                stopping = failure is not None or (stop is not None and stop.is_set())
                upcoming = None if stopping else next(batches, None)
                pending = None if upcoming is None else pool.submit(reader.fetch, upcoming, turn + 1)
                turn += 1
                if held is not None:
                    yield from held
                    held = None
                if failure is not None:
                    raise failure
                checking = time.perf_counter()
                held = check_batch(fetched, checker, plan, evidence)
                checked += time.perf_counter() - checking
                if stopping:
                    break
            if held is not None:
                finishing = time.perf_counter()
                if on_batch is not None:
                    on_batch(held)
                after += time.perf_counter() - finishing
                yield from held
        finally:
            if phases is not None:
                within = "reading and judging (wall)"
                phases.add("waiting for fetches (and planning batches)", waited, within)
                phases.add("checking and judging batches", checked, within)
                phases.add("after each batch (confirm findings, checkpoint, master)", after, within)
                phases.rest(within, "handing records on (ledger, sink, progress)")
