"""Raw reads of replica bytes with Mooncake's TransferEngine: no master call, so no lease.

The engine reads `length` bytes at a holder's address into local registered memory. It knows
nothing about keys: whether those bytes still belong to a key is the caller's business
(`audit.readers.descriptors`). Reads to one holder go as one batch; holders are read in parallel.
Reads that lie side by side at both ends go as one transfer (`audit.readers.order` arranges them so).
"""

from __future__ import annotations

import socket
import time
from collections import defaultdict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

from audit.connection import Settings, local_address_towards, native_stderr_captured
from audit.errors import AuditError
from audit.listeners import accept_shortened
from audit.readers.buffers import MAX_KEYS_PER_BATCH

TRANSFER_FAIL = -800  # what `batch_get_into` answers for the same failure (FACTS §3)
PARALLEL_HOLDERS = 8
FAST_FAILURE_S = 1.0  # a batch failing sooner was refused, not timed out (MC_TRANSFER_TIMEOUT: 30 s, at least 5)


class RawRead(NamedTuple):
    """One raw read (a named tuple: one per key per batch)."""

    endpoint: str     # the holder's segment name (a replica's transport_endpoint_)
    local: int        # where the bytes land (inside registered memory)
    remote: int       # the replica's buffer_address_
    length: int


def merged(items: Sequence[RawRead]) -> list[RawRead]:
    """`items` (reads from one holder) with each run of exact neighbours made one read: a read that
    starts where the one before it ends, in the holder's memory and in ours. Only exact ones: the
    bytes between two slots may not be ours to write. A transfer costs the engine about the same CPU
    whatever its length, so a thousand 256 B neighbours read as one cost about a thousandth."""
    runs: list[RawRead] = []
    local = remote = length = None
    for item in sorted(items, key=lambda read: read.remote):
        if length is not None and item.remote == remote + length and item.local == local + length:
            length += item.length
            continue
        if length is not None:
            runs.append(RawRead(item.endpoint, local, remote, length))
        local, remote, length = item.local, item.remote, item.length
    if length is not None:
        runs.append(RawRead(items[0].endpoint, local, remote, length))
    return runs


def _unique_name(host: str) -> str:
    """`host:port` with a port no one listens on: the engine publishes its own segment descriptor
    under this name, and two auditors (or an auditor and a holder) must never share one."""
    with socket.socket() as probe:
        try:
            probe.bind((host, 0))
        except OSError:
            probe.bind(("", 0))
        return f"{host}:{probe.getsockname()[1]}"


def metadata_reachable(settings: Settings, timeout_s: float = 5.0) -> bool:
    """Whether an HTTP metadata server answers at all (any status): what starting a transfer engine
    would find out first, without starting one (a start and a close of its own). Raises
    AuditError when it does not answer; False for a metadata service that is not HTTP (etcd, a P2P
    handshake), which only a transfer engine can try."""
    import urllib.error
    import urllib.request

    if not settings.metadata.startswith(("http://", "https://")):
        return False
    try:
        urllib.request.urlopen(settings.metadata, timeout=timeout_s).close()
    except urllib.error.HTTPError:
        pass  # it answered
    except (OSError, ValueError) as error:
        reason = getattr(error, "reason", None) or error
        raise AuditError(f"cannot start a transfer engine against {settings.metadata}: "
                         f"{getattr(reason, 'strerror', None) or reason}") from None
    return True


class RawTransfer:
    """A TransferEngine of the auditor's own; `register_buffer`/`unregister_buffer` have the store's
    names so `audit.readers.lease.RegisteredBuffer` works with it."""

    def __init__(self, settings: Settings):
        try:
            from mooncake.engine import TransferEngine
        except ImportError as error:
            raise AuditError(f"the Mooncake transfer engine is not importable ({error})") from None
        host = settings.local_hostname or local_address_towards(settings.master)
        self.engine = TransferEngine()
        # the first lookup of its own name logs an ERROR; close() takes milliseconds, not 0-1 s
        with native_stderr_captured() as captured, accept_shortened():
            rc = self.engine.initialize(_unique_name(host), settings.metadata, settings.protocol,
                                        settings.device_name)
        if rc != 0:
            last = captured.last_line()
            raise AuditError(f"cannot start a transfer engine against {settings.metadata} ({rc})"
                             + (f": {last}" if last else ""))
        self.pool = ThreadPoolExecutor(max_workers=PARALLEL_HOLDERS, thread_name_prefix="raw-read")

    def register_buffer(self, address: int, nbytes: int) -> int:
        return self.engine.register_memory(address, nbytes)

    def unregister_buffer(self, address: int) -> int:
        return self.engine.unregister_memory(address)

    def read(self, reads: Sequence[RawRead]) -> list[int]:
        """0 or TRANSFER_FAIL per read, in order. Holders are read in parallel; each one's reads go
        in batches of at most MAX_KEYS_PER_BATCH, one after another (its transfer queue is bounded)."""
        by_holder: dict[str, list[int]] = defaultdict(list)
        for index, item in enumerate(reads):
            by_holder[item.endpoint].append(index)
        codes = [TRANSFER_FAIL] * len(reads)

        def read_holder(indices: list[int]) -> None:
            for start in range(0, len(indices), MAX_KEYS_PER_BATCH):
                batch = indices[start: start + MAX_KEYS_PER_BATCH]
                for index, code in zip(batch, self._read_batch([reads[i] for i in batch])):
                    codes[index] = code

        list(self.pool.map(read_holder, by_holder.values()))
        return codes

    def _read_batch(self, items: list[RawRead]) -> list[int]:
        endpoint = items[0].endpoint
        runs = merged(items)
        started = time.monotonic()
        rc = self.engine.batch_transfer_sync_read(endpoint, [r.local for r in runs], [r.remote for r in runs],
                                                  [r.length for r in runs])
        if rc == 0:
            return [0] * len(items)
        # A failed batch does not say which read failed, nor which of a run's reads. One that waited
        # out MC_TRANSFER_TIMEOUT met a holder that does not answer (a probe would hang too); one
        # that failed fast met a refused connection (the probe fails at once) or an address the
        # holder rejects (the probe answers): only then are the reads retried one by one, unmerged,
        # since retries against a dead holder back off.
        if (len(items) == 1 or time.monotonic() - started > FAST_FAILURE_S
                or self.engine.send_probe(endpoint) != 0):
            return [TRANSFER_FAIL] * len(items)
        return [0 if self.engine.transfer_sync_read(endpoint, r.local, r.remote, r.length) == 0 else TRANSFER_FAIL
                for r in items]

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        self.engine = None  # the engine's destructor withdraws its segment descriptor
