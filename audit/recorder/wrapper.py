"""A MooncakeDistributedStore subclass that records which block every published key was read from.

It overrides only what it must see: ``setup`` (to learn the tenant), ``register_buffer`` /
``unregister_buffer`` (to learn the buffers) and the two zero-copy puts vLLM's connector can use,
``batch_put_from_multi_buffers`` and ``batch_put_from``. Everything else is the base class's own
method, untouched. A put's arguments and result pass through unchanged, except under the guard,
which keeps keys read from vLLM's null block out of the store and reports them to the caller as
failed puts. Building one also hooks the producer's manifest (`audit.recorder.manifest`).
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager

from audit.recorder.blocks import KeyBlocks, RegisteredRegions
from audit.recorder.manifest import hook_store_worker
from audit.recorder.records import DEFAULT_TENANT, RecordWriter, key_lines, logger

# The result reported for a withheld key. vLLM's connector treats any negative result as a failed
# put: it logs "batch_put failed", keeps the request's saved offset (so the chunk is retried and
# withheld again, never stored) and consumers miss the key and recompute. Mooncake's INVALID_PARAMS
# (-600) says what happened; NO_AVAILABLE_HANDLE (-200) would instead make the connector pause the
# request's later saves as if the store were full.
WITHHELD_RESULT = -600
SETUP_TENANT_POSITION = 10  # setup()'s 11th positional argument is tenant_id (the dict form has the key)

_withholding_logged = False  # the guard's first withheld key is logged; the records hold every one


def recording_store_class(base: type, writer: RecordWriter, *, guard: bool = False) -> type:
    """`base` (MooncakeDistributedStore or a stand-in) whose puts append block records to `writer`.

    With `guard`, keys with any segment at the null block are withheld (see WITHHELD_RESULT).
    """

    class RecordingStore(base):
        __doc__ = f"{base.__name__} recording block ids of published keys (mooncake-audit)."
        audit_writer = writer
        audit_guard = guard
        audit_tenant = DEFAULT_TENANT

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.audit_regions = RegisteredRegions()
            hook_store_worker(writer.directory)  # the connector's worker builds its store: describe it later

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

        def _audit_put(self, put, keys, ptrs, sizes, segment_ptrs, segment_sizes, args, kwargs):
            """Publish through `put` and record one line per key; recording never fails the put."""
            try:
                blocks = self.audit_regions.resolve(segment_ptrs, segment_sizes)
            except Exception:  # a recorder bug must not cost the producer its puts
                logger.exception("mooncake-audit: cannot derive block ids; this put is not recorded")
                return put(keys, ptrs, sizes, *args, **kwargs)
            withheld = ({index for index, key_blocks in enumerate(blocks) if key_blocks.null_backed}
                        if guard else set())
            try:
                results = _put_except(put, withheld, keys, ptrs, sizes, args, kwargs)
            except Exception as error:
                self._audit_record(keys, blocks, [None] * len(keys), segment_sizes, withheld,
                                   f"{type(error).__name__}: {error}")
                raise
            self._audit_record(keys, blocks, results, segment_sizes, withheld)
            return results

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


def _put_except(put, withheld: set[int], keys, ptrs, sizes, args, kwargs) -> list[int]:
    """`put`'s results for all keys; the `withheld` ones are not passed to it and get WITHHELD_RESULT."""
    if not withheld:
        return put(keys, ptrs, sizes, *args, **kwargs)
    global _withholding_logged
    if not _withholding_logged:
        _withholding_logged = True
        logger.warning("mooncake-audit guard: withholding %d key(s) read from the null block, first %s; "
                       "later ones are only recorded", len(withheld), keys[min(withheld)])
    kept = [index for index in range(len(keys)) if index not in withheld]
    results = [WITHHELD_RESULT] * len(keys)
    if kept:
        with _group_ids_of(kept, len(keys), args, kwargs):
            stored = put([keys[i] for i in kept], [ptrs[i] for i in kept], [sizes[i] for i in kept], *args, **kwargs)
        for index, result in zip(kept, stored):
            results[index] = result
    return results


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

