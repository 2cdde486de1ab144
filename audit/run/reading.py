"""How a run reads: the reader for its read mode, sized to the keys, and what follows each batch
(findings read again on peek reads, the checkpoint, the master's health); shared by this process's
scan and every Ray task."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from audit.connection import AdminClient, Settings
from audit.errors import AuditError
from audit.judge.duplicates import mark_duplicates
from audit.judge.ledger import RecordLedger
from audit.readers.buffers import ALIGNMENT, MAX_KEYS_PER_BATCH, HostMemoryAhead, RegisteredBuffer
from audit.readers.lease import LeaseReader
from audit.records import KeyInfo, KeyRecord, Verdict
from audit.run.checkpoint import Checkpoint
from audit.run.options import ScanOptions
from audit.run.stops import MasterWatch
from audit.sources.keytable import KeyTable
from audit.sources.listing import admin_readable


def buffer_bytes(keys: list[KeyInfo], options: ScanOptions) -> int:
    """No more than the scan needs (a small scan, or one of small values, should not register
    256 MiB); under a bandwidth limit, batches of about a quarter second, so the pace is even."""
    sizes = keys.size_array() if isinstance(keys, KeyTable) else np.array([k.size or 0 for k in keys], dtype=np.int64)
    sizes = sizes.clip(0)
    total = ALIGNMENT * len(sizes) + int(sizes.sum())
    largest = int(sizes.max()) if len(sizes) else 0
    # a batch holds at most MAX_KEYS_PER_BATCH keys: small values never fill 128 MiB, and a
    # registered buffer is resident whole (a million 256 B values: 640 KiB, not 256 MiB)
    half = min(options.buffer_mb << 19, max(total, ALIGNMENT), MAX_KEYS_PER_BATCH * (largest + ALIGNMENT))
    if options.max_bandwidth:
        half = min(half, max(int(options.max_bandwidth / 4), largest + ALIGNMENT))
    return 2 * half


def reader_memory_ahead(keys: list[KeyInfo], options: ScanOptions) -> HostMemoryAhead | None:
    """The host memory of the reader `make_reader` will make for `keys` (the keys listed), touched
    from now on in a thread. None where the run reads other keys or none into host memory: GPU
    buffers, no key, a sample or a resumed checkpoint (fewer keys, maybe smaller buffers), a peek read
    of a store with no key in memory (the disk reader maps its values instead)."""
    if (not len(keys) or options.placement.buffer_type is not RegisteredBuffer or options.sample is not None
            or options.resume or options.read_mode == "peek" and not _any_memory_replica(keys)):
        return None
    half = max(buffer_bytes(keys, options) // 2, ALIGNMENT)
    return HostMemoryAhead([half, half])


def _any_memory_replica(keys: KeyTable | list[KeyInfo]) -> bool:
    """Whether a peek read has a key to read from memory: on a store whose keys are all on disk,
    touching the buffers would only take a core from the disk reader (0.5 s for 1 GiB of keys)."""
    if isinstance(keys, KeyTable):
        if (keys.replica_columns()[1] >= 0).any():
            return True
        keys = keys.unusual()[1]
    return any(admin_readable(key) for key in keys)


def make_reader(settings: Settings, admin: AdminClient, store, keys: list[KeyInfo], options: ScanOptions,
                transfer=None, memory: HostMemoryAhead | None = None):
    """The reader of the run's read mode, its buffers sized to `keys`. `transfer` (peek reads): a
    RawTransfer to share, or a callable that gives one; without it the reader starts its own.
    `memory`: the buffers' host memory, touched ahead (`reader_memory_ahead`)."""
    buffer_type = options.placement.buffer_type if memory is None else memory.registered
    if options.read_mode == "lease":
        return LeaseReader(store, buffer_bytes(keys, options), buffer_type)
    if options.placement.device != "cpu":
        raise AuditError("--read-mode peek reads into host memory: use it with --device cpu")
    from audit.readers.peek import PeekReader

    return PeekReader(settings, admin, buffer_bytes(keys, options), transfer() if callable(transfer) else transfer,
                      buffer_type)


SAMPLE_BATCH_KEYS = 8  # samples read per batch: they are copied out at once, so a small buffer serves


def read_samples(settings: Settings, admin: AdminClient, store, keys: list[KeyInfo], options: ScanOptions,
                 consider: Callable[[KeyInfo, object], None], transfer=None,
                 memory: HostMemoryAhead | None = None) -> None:
    """Read a few keys (the samples that choose an ambiguous group's reading before the scan) and
    hand each value to `consider` (key, uint8 array in host memory) while it is in the reader's
    buffer, which holds a few of them, not all (16 per ambiguous group of 1.6 MB values would
    register and touch a few hundred MB). Keys that fail to read are left out. `memory`: the
    scan's reader's, touched ahead, which the samples borrow (`reader_memory_ahead`)."""
    from audit.readers.buffers import plan_batches

    largest = sorted(keys, key=lambda key: -(key.size or 0))[:SAMPLE_BATCH_KEYS]
    reader = make_reader(settings, admin, store, largest, options, transfer, memory)
    try:
        for turn, slots in enumerate(plan_batches(keys, reader.capacity)):
            batch = reader.fetch(slots, turn)
            try:
                for slot, code in zip(batch.slots, batch.results):
                    if code == slot.key.size:
                        view = batch.view(slot, code)
                        consider(slot.key, np.asarray(view.cpu() if hasattr(view, "cpu") else view))
            finally:
                batch.release()
    finally:
        reader.close()


def confirm_findings(records: list[KeyRecord], confirm) -> None:
    """A lease-free read may race a re-put: findings stand only if a second read sees the same bytes."""
    from audit.readers.confirm import apply_confirmation

    by_key = {record.key: record for record in records}
    for key, confirmation in confirm(list(by_key.values())).items():
        apply_confirmation(by_key[key], confirmation)


def confirm_shared(records: RecordLedger | list[KeyRecord], reader) -> None:
    """SHARED_CONTENT is known only across keys: confirm its members once the scan is done."""
    ledger = records if isinstance(records, RecordLedger) else RecordLedger.of(records)
    candidates = ledger.digest_groups()
    mark_duplicates(candidates)  # only SHARED_CONTENT: the full merge, chunk checks included, comes after
    pending = [r for r in candidates if Verdict.SHARED_CONTENT in r.verdicts and "confirmation" not in r.evidence]
    if pending:
        confirm_findings(pending, reader.confirm)


def after_batch_hook(confirm, checkpoint: Checkpoint | None, watch: MasterWatch):
    """What follows each checked batch, here and in a Ray task: findings read again (peek), the
    checkpoint, the master's health."""
    def after_batch(batch: list[KeyRecord]) -> None:
        findings = [record for record in batch if record.is_finding and record.xxh3 is not None]
        if confirm is not None and findings:
            confirm_findings(findings, confirm)
        if checkpoint is not None:
            checkpoint.append(batch)
        watch(batch)
    return after_batch
