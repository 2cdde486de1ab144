"""A MooncakeDistributedStore subclass that records what a vLLM process puts and loads.

It overrides only what it must see: ``setup`` (to learn the tenant), ``register_buffer`` /
``unregister_buffer`` (to learn the buffers), the two zero-copy puts vLLM's connector can use,
``batch_put_from_multi_buffers`` and ``batch_put_from``, its zero-copy get
``batch_get_into_multi_buffers`` (and ``batch_get_into``), and, under the load guard,
``batch_is_exist``. Everything else is the base class's own method, untouched. Arguments and results
pass through unchanged, except under the guards: the put guard keeps keys read from vLLM's null block
out of the store and reports them as failed puts; the load guard reports a value it refuses as a
failed get (`audit.recorder.guard`) and a key it refused as absent from then on. Building one also
hooks the producer's manifest (`audit.recorder.manifest`) and the connector's receiving thread
(`audit.recorder.loads`: which request each load serves).
"""

from __future__ import annotations

import os
import socket
import time
from contextlib import contextmanager

from audit.recorder.binding import StateBinder
from audit.recorder.cachebytes import CacheBytes
from audit.recorder.blocks import KeyBlocks, RegisteredRegions
from audit.recorder.loads import current_request, hook_receiving_thread, note_refusal
from audit.recorder.manifest import hook_store_worker
from audit.recorder.records import DEFAULT_TENANT, NULL_BLOCK_REASON, RecordWriter, key_lines, load_lines, logger

# The result reported for a withheld key. vLLM's connector treats any negative result as a failed
# put: it logs "batch_put failed", keeps the request's saved offset (so the chunk is retried and
# withheld again, never stored) and consumers miss the key and recompute. Mooncake's INVALID_PARAMS
# (-600) says what happened; NO_AVAILABLE_HANDLE (-200) would instead make the connector pause the
# request's later saves as if the store were full.
WITHHELD_RESULT = -600
# The result a refused load reports: Mooncake's OBJECT_NOT_FOUND. vLLM's connector fails the load
# of any negative result (`audit.recorder.loads` makes it fail the whole request), and for the
# consumer a refused key is as good as absent.
REFUSED_RESULT = -704
UNCHECKED = "UNCHECKED"  # the guard itself failed on a value: refused, never denied for good
SETUP_TENANT_POSITION = 10  # setup()'s 11th positional argument is tenant_id (the dict form has the key)

_withholding_logged = False  # the guard's first withheld key is logged; the records hold every one


def recording_store_class(base: type, writer: RecordWriter, *, guard: bool = False,
                          loads: RecordWriter | None = None, load_guard=None) -> type:
    """`base` (MooncakeDistributedStore or a stand-in) whose puts append block records to `writer`
    and whose loads append load records to `loads`.

    With `guard`, keys with any segment at the null block are withheld (see WITHHELD_RESULT). With
    `load_guard` (a callable making an `audit.recorder.guard.LoadGuard`), loaded values it refuses
    are failed (REFUSED_RESULT), and a refused key is absent for ``batch_is_exist``.
    """
    host = socket.gethostname()

    class RecordingStore(base):
        __doc__ = f"{base.__name__} recording block ids of published keys (mooncake-audit)."
        audit_writer = writer
        audit_guard = guard
        audit_tenant = DEFAULT_TENANT

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.audit_regions = RegisteredRegions()
            # the connector's worker builds its store: describe it later, see which request loads
            hook_store_worker(writer.directory)
            hook_receiving_thread(required=load_guard is not None)
            self.audit_load_guard = load_guard() if load_guard is not None else None
            self.audit_put_binder: StateBinder | None = None  # set once the caches are described
            self.audit_put_memory = CacheBytes()  # the caches puts read from (host or GPU memory)

        def audit_describe(self, document: dict, kv_caches: dict) -> None:
            """The process's own manifest (`audit.recorder.manifest`): the load guard's regions, and
            with the put guard, what its layer-0 binding reads, and where (host or GPU memory)."""
            if self.audit_load_guard is not None:
                self.audit_load_guard.describe(document, kv_caches)
            if guard:
                self.audit_put_memory = CacheBytes(kv_caches)
                self.audit_put_binder = StateBinder(writer.directory)
                self.audit_put_binder.describe(document)

        def setup(self, *args, **kwargs):
            result = super().setup(*args, **kwargs)
            self.audit_tenant = _tenant_of(args, kwargs)
            return result

        def register_buffer(self, buffer_ptr, size):
            result = super().register_buffer(buffer_ptr, size)
            # Kept even when registration fails: the connector still publishes from that memory.
            self.audit_regions.add(buffer_ptr, size)
            return result

        def unregister_buffer(self, buffer_ptr):
            result = super().unregister_buffer(buffer_ptr)
            self.audit_regions.remove(buffer_ptr)
            return result

        def batch_put_from_multi_buffers(self, keys, all_buffer_ptrs, all_sizes, *args, **kwargs):
            return self._audit_put(super().batch_put_from_multi_buffers, keys, all_buffer_ptrs, all_sizes,
                                   all_buffer_ptrs, all_sizes, args, kwargs)

        def batch_put_from(self, keys, buffer_ptrs, sizes, *args, **kwargs):
            return self._audit_put(super().batch_put_from, keys, buffer_ptrs, sizes,
                                   [[ptr] for ptr in buffer_ptrs], [[size] for size in sizes], args, kwargs)

        def batch_get_into_multi_buffers(self, keys, all_buffer_ptrs, all_sizes, *args, **kwargs):
            return self._audit_load(super().batch_get_into_multi_buffers, keys, all_buffer_ptrs, all_sizes,
                                    all_buffer_ptrs, all_sizes, args, kwargs)

        def batch_get_into(self, keys, buffer_ptrs, sizes, *args, **kwargs):
            return self._audit_load(super().batch_get_into, keys, buffer_ptrs, sizes,
                                    [[ptr] for ptr in buffer_ptrs], [[size] for size in sizes], args, kwargs)

        def batch_is_exist(self, keys, *args, **kwargs):
            results = super().batch_is_exist(keys, *args, **kwargs)
            if self.audit_load_guard is None:
                return results
            refused = self.audit_load_guard.known(keys)
            if not refused:
                return results
            results = list(results)
            for index in refused:
                results[index] = 0
            return results

        def _audit_load(self, get, keys, ptrs, sizes, segment_ptrs, segment_sizes, args, kwargs):
            """Load through `get`, check what landed under the load guard, record one line per key."""
            guard_ = self.audit_load_guard
            refused = guard_.known(keys) if guard_ is not None else {}
            try:
                results = _get_except(get, refused, keys, ptrs, sizes, args, kwargs)
            except Exception as error:
                self._audit_record_loads(keys, segment_sizes, [None] * len(keys), refused,
                                         f"{type(error).__name__}: {error}")
                raise
            if guard_ is not None:
                try:
                    found = guard_.check(keys, segment_ptrs, segment_sizes, results)
                except Exception:
                    # a value the guard cannot judge is not handed to the model unjudged (nor denied later)
                    logger.exception("mooncake-audit load guard: cannot check loaded values; the batch is refused")
                    found = {i: UNCHECKED for i, rc in enumerate(results) if rc is not None and rc >= 0}
                refused = {**refused, **found}
                if refused:
                    results = list(results)
                    for index, reason in refused.items():
                        results[index] = REFUSED_RESULT
                        if index in found and reason != UNCHECKED:
                            guard_.deny.deny(keys[index], reason)
                    _log_refusals(keys, refused, current_request()[1])
                    guard_.refusals += len(refused)
                    note_refusal()
            self._audit_record_loads(keys, segment_sizes, results, refused)
            return results

        def _audit_record_loads(self, keys, segment_sizes, results, refused, error: str | None = None) -> None:
            if loads is None:
                return
            try:
                asked = [sum(sizes) for sizes in segment_sizes]
                loads.write(load_lines(keys, asked, results, refused, current_request(), time.time(), os.getpid(),
                                       host, error, tenant=self.audit_tenant))
            except Exception:
                logger.exception("mooncake-audit: cannot record a load")

        def _audit_put(self, put, keys, ptrs, sizes, segment_ptrs, segment_sizes, args, kwargs):
            """Publish through `put` and record one line per key; recording never fails the put."""
            try:
                blocks = self.audit_regions.resolve(segment_ptrs, segment_sizes)
            except Exception:  # a recorder bug must not cost the producer its puts
                logger.exception("mooncake-audit: cannot derive block ids; this put is not recorded")
                return put(keys, ptrs, sizes, *args, **kwargs)
            withheld = ({index: NULL_BLOCK_REASON for index, key_blocks in enumerate(blocks) if key_blocks.null_backed}
                        if guard else {})
            if self.audit_put_binder is not None:
                withheld.update(self._audit_bind_puts(keys, segment_ptrs, segment_sizes, withheld))
            try:
                results = _put_except(put, withheld, keys, ptrs, sizes, args, kwargs)
            except Exception as error:
                self._audit_record(keys, blocks, [None] * len(keys), segment_sizes, withheld,
                                   f"{type(error).__name__}: {error}")
                raise
            self._audit_record(keys, blocks, results, segment_sizes, withheld)
            return results

        def _audit_bind_puts(self, keys, segment_ptrs, segment_sizes, withheld) -> dict[int, str]:
            """The put guard's layer-0 binding: keys whose state is not of this request's tokens or
            of these weights. A binding that fails publishes, logged."""
            try:
                return self.audit_put_binder.refusals(
                    keys, [index for index in range(len(keys)) if index not in withheld],
                    lambda wanted: self.audit_put_memory.of_segments(segment_ptrs, segment_sizes, wanted))
            except Exception:
                logger.exception("mooncake-audit guard: cannot bind this put at layer 0; it is published")
                return {}

        def _audit_record(self, keys, blocks: list[KeyBlocks], results, segment_sizes, withheld,
                          error: str | None = None) -> None:
            try:
                writer.write(key_lines(keys, blocks, results, segment_sizes, withheld, time.time(),
                                       os.getpid(), error, tenant=self.audit_tenant))
            except Exception:
                logger.exception("mooncake-audit: cannot record a put")

    RecordingStore.__name__ = RecordingStore.__qualname__ = f"Recording{base.__name__}"
    return RecordingStore


def _tenant_of(args: tuple, kwargs: dict) -> str:
    """The tenant a ``setup`` call joins: its ``tenant_id``, positional, keyword or in the dict form."""
    if args and isinstance(args[0], dict):
        tenant = args[0].get("tenant_id")
    elif len(args) > SETUP_TENANT_POSITION:
        tenant = args[SETUP_TENANT_POSITION]
    else:
        tenant = kwargs.get("tenant_id")
    return str(tenant) if tenant else DEFAULT_TENANT


def _put_except(put, withheld: dict[int, str], keys, ptrs, sizes, args, kwargs) -> list[int]:
    """`put`'s results for all keys; the `withheld` ones are not passed to it and get WITHHELD_RESULT."""
    if not withheld:
        return put(keys, ptrs, sizes, *args, **kwargs)
    global _withholding_logged
    if not _withholding_logged:
        _withholding_logged = True
        first = min(withheld)
        logger.warning("mooncake-audit guard: withholding %d key(s), first %s (%s); later ones are only recorded",
                       len(withheld), keys[first], withheld[first])
    kept = [index for index in range(len(keys)) if index not in withheld]
    with _group_ids_of(kept, len(keys), args, kwargs):
        return _call_for(kept, put, WITHHELD_RESULT, keys, ptrs, sizes, args, kwargs)


def _get_except(get, refused: dict[int, str], keys, ptrs, sizes, args, kwargs) -> list[int]:
    """`get`'s results for all keys; the `refused` ones are not asked for and get REFUSED_RESULT."""
    if not refused:
        return list(get(keys, ptrs, sizes, *args, **kwargs))
    kept = [index for index in range(len(keys)) if index not in refused]
    return _call_for(kept, get, REFUSED_RESULT, keys, ptrs, sizes, args, kwargs)


def _call_for(kept: list[int], call, left_out: int, keys, ptrs, sizes, args, kwargs) -> list[int]:
    """`call` on the `kept` keys only (never with none); every other key's result is `left_out`."""
    results = [left_out] * len(keys)
    if kept:
        answered = call([keys[i] for i in kept], [ptrs[i] for i in kept], [sizes[i] for i in kept], *args, **kwargs)
        for index, result in zip(kept, answered):
            results[index] = result
    return results


def _log_refusals(keys, refused: dict[int, str], request_id: str | None) -> None:
    """Every refusal under vLLM's logger: a refused load costs a recompute, an operator should see why."""
    for index, reason in refused.items():
        logger.warning("mooncake-audit load guard: refused %s (%s) for request %s", keys[index], reason, request_id)


@contextmanager
def _group_ids_of(kept: list[int], count: int, args, kwargs):
    """With `enable_group_semantics` the connector's ReplicateConfig carries one group id per key,
    and Mooncake rejects a batch whose id count differs from its key count (INVALID_PARAMS: the
    good keys would never be stored). So for the put, the config holds the kept keys' ids only;
    the caller's ids are put back after it."""
    configs = [value for value in (*args, *kwargs.values())
               if isinstance(getattr(value, "group_ids", None), list) and len(value.group_ids) == count]
    saved = [config.group_ids for config in configs]
    try:
        for config, ids in zip(configs, saved):
            config.group_ids = [ids[i] for i in kept]
        yield
    finally:
        for config, ids in zip(configs, saved):
            config.group_ids = ids

