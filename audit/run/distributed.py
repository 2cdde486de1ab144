"""`--ray`: one scan across many machines, each Ray task reading what its own holders hold.

The driver lists and sizes once, as without Ray, and cuts the keys into shards by holder
(`audit.run.shards`). Each shard is one Ray task, placed softly on the Ray node whose IP is the
holder's host (any node when none runs there). A task runs the same scan core as one process
(`audit.run.scan.scan_keys`) with its own store client and registered buffers, and streams its
records back in chunks; the driver feeds them to the same sinks, checkpoint and progress, and
`audit.judge.merge` decides the cross-key verdicts over all of them. Ray schedules, and retries a
task whose worker or node died once; a shard lost twice is reported UNREACHABLE, key by key.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field, replace

import numpy as np
import ray
from ray.exceptions import RayError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from audit.connection import AdminClient, Settings, open_store
from audit.errors import TASK_LOST, AuditError
from audit.judge.plan import CheckPlan
from audit.readers.buffers import ALIGNMENT
from audit.readers.disk import DiskReader, on_disk_only
from audit.readers.lease import LeaseReader
from audit.readers.throttle import ThrottledReader
from audit.judge.ledger import RecordLedger
from audit.records import KeyInfo, KeyRecord, Verdict
from audit.run.checkpoint import Checkpoint
from audit.run.collector import tune_for_scanning
from audit.run.options import ScanOptions
from audit.run.reading import after_batch_hook, buffer_bytes, confirm_shared, make_reader
from audit.run.scan import scan_keys
from audit.run.shards import Shard, plan_shards
from audit.run.stops import Deadline, MasterWatch

CHUNK_KEYS = 1000                 # records per streamed chunk: a few MB at most, even with --all
LOCAL_OBJECT_STORE = 128 << 20    # `--ray local`: records are small; Ray's default takes 30% of RAM
WAIT_S = 0.5                      # how often the driver looks at Ctrl-C while waiting for chunks


@dataclass(slots=True)
class Chunk:
    """Records of one shard, and where they were read: `worker` changes when Ray retried the task."""

    records: list[KeyRecord]
    node: str
    worker: int
    stopped: str | None = None    # the last chunk of a shard that stopped early: "deadline" or why


_client: tuple[tuple[str, Settings], object] | None = None  # this worker process's (scan, settings) and client


def _store(settings: Settings, scan: str):
    """One Mooncake client per Ray worker process for all the shards of one scan that it reads: a
    client's setup and close are a fixed cost of every shard otherwise (docs/scale-out.md). An
    earlier scan's client is closed first (its master may have restarted since); the last one ends
    with the worker process."""
    global _client
    if _client is None or _client[0] != (scan, settings):
        if _client is not None:
            _client[1].close()
            _client = None
        _client = ((scan, settings), open_store(settings))
    return _client[1]


@ray.remote(num_cpus=1, max_retries=1)
def scan_shard(scan: str, settings: Settings, options: ScanOptions, plan: CheckPlan, keys: list[KeyInfo],
               deadline_at: float | None):
    """One shard, read on this Ray worker by a store client of its own. Starts with an empty chunk
    (where it runs: a retry on another worker shows in its later chunks) and always ends with one,
    so a retry yields as many chunks as the first attempt (Ray replays them by index)."""
    tune_for_scanning()
    node, worker = ray.util.get_node_ip_address(), os.getpid()
    yield Chunk([], node, worker)
    remaining = None if deadline_at is None else deadline_at - time.time()
    if remaining is not None and remaining <= 0:
        yield Chunk([], node, worker, "deadline")
        return
    stop = threading.Event()
    admin = AdminClient(settings.admin)
    watch = MasterWatch(admin, stop)
    deadline = Deadline(remaining, stop)
    try:
        chunk: list[KeyRecord] = []
        for group, base_reader in _shard_readers(settings, admin, scan, keys, options):
            reader = ThrottledReader(base_reader, options.max_bandwidth, stop) if options.max_bandwidth else base_reader
            try:
                for record in scan_keys(group, reader, options.placement.checker(), plan, stop=stop,
                                        on_batch=after_batch_hook(getattr(base_reader, "confirm", None), None, watch)):
                    chunk.append(record)
                    if len(chunk) == CHUNK_KEYS:
                        yield Chunk(chunk, node, worker)
                        chunk = []
            finally:
                reader.close()
        yield Chunk(chunk, node, worker, watch.lost or ("deadline" if deadline.reached else None))
    finally:
        deadline.cancel()


def _shard_readers(settings: Settings, admin: AdminClient, scan: str, keys: list[KeyInfo], options: ScanOptions):
    """The shard's keys in groups, each with its reader, made when its turn comes: in peek mode the
    disk-only keys this host's offload directories hold (`--offload-dir`) from their files, lease-free;
    those no directory here holds through the store client, with a lease, as the driver would read
    them; the rest as the read mode says."""
    if options.read_mode == "peek" and options.offload_dirs and any(map(on_disk_only, keys)):
        on_disk, keys = [key for key in keys if on_disk_only(key)], [key for key in keys if not on_disk_only(key)]
        disk = DiskReader(admin, options.offload_dirs, buffer_bytes(on_disk, options), read_ahead=not options.max_bandwidth)
        held, elsewhere = disk.split(on_disk)
        yield held, disk
        if elsewhere:
            yield elsewhere, LeaseReader(_store(settings, scan), buffer_bytes(elsewhere, options),
                                         options.placement.buffer_type)
    if keys:
        yield keys, make_reader(settings, admin, _store(settings, scan), keys, options)


@dataclass(frozen=True, slots=True)
class Node:
    id: str
    ip: str


@dataclass
class _Task:
    """The driver's view of one shard in flight: which of its keys (its rows, in listing order)
    still owe a record, a flag per key."""

    shard: Shard
    target: Node | None
    pending: np.ndarray
    workers: set[int] = field(default_factory=set)
    node: str | None = None

    rows: np.ndarray | None = None  # the shard's rows, sorted, for looking a record's row up

    @classmethod
    def of(cls, shard: Shard, target: Node | None) -> _Task:
        rows = np.sort(np.array(shard.rows, dtype=np.int64))
        return cls(shard, target, np.ones(len(rows), dtype=bool), rows=rows)

    def owed(self, record: KeyRecord) -> bool:
        """Whether the record is one this task still owed (then it is owed no more)."""
        rows = self.rows
        at = int(np.searchsorted(rows, record.ordinal)) if record.ordinal is not None else len(rows)
        if at >= len(rows) or rows[at] != record.ordinal or not self.pending[at]:
            return False
        self.pending[at] = False
        return True

    def unreported(self) -> list[KeyInfo]:
        return [self.shard.table.info(int(self.rows[i])) for i in np.flatnonzero(self.pending)]


class RayScan:
    """The driver's side: a Ray connection, the holders' nodes, and the read of all shards."""

    def __init__(self, address: str, settings: Settings, owned: bool):
        self.address = address
        self.settings = settings
        self.owned = owned

    @classmethod
    def connect(cls, address: str, settings: Settings) -> RayScan:
        """`local` starts a Ray instance of this process's own (stopped with it); `auto`, a GCS
        `host:port` or a `ray://` address joins a running cluster. A process already connected
        (an embedding driver, the tests) keeps its connection."""
        if ray.is_initialized():
            return cls(address, settings, owned=False)
        quiet = {"log_to_driver": False, "logging_level": "WARNING"}
        if address not in ("auto", "local"):
            _reachable(address)
        try:
            if address == "local":
                ray.init(address="local", include_dashboard=False, object_store_memory=LOCAL_OBJECT_STORE, **quiet)
            else:
                ray.init(address=address, **quiet)
        except (ConnectionError, RuntimeError, ValueError) as error:
            raise AuditError(f"cannot connect to Ray at {address}: {str(error).splitlines()[0]}") from None
        return cls(address, settings, owned=True)

    def close(self) -> None:
        if self.owned:
            ray.shutdown()

    def read(self, keys: list[KeyInfo], options: ScanOptions, stop: threading.Event,
             checkpoint: Checkpoint | None, emit, records: RecordLedger, context: dict) -> str | None:
        """Every shard read by a Ray task; records handed to `emit` as chunks arrive. The reason the
        scan stopped early, if it did (a deadline, a lost master)."""
        shards = plan_shards(keys, options.shard_mb << 20)
        nodes = {node["NodeManagerAddress"]: Node(node["NodeID"], node["NodeManagerAddress"])
                 for node in ray.nodes() if node["Alive"]}
        slots = max(1, min(len(shards), int(ray.cluster_resources().get("CPU", 1))))
        running = self._submit(shards, nodes, options, slots)
        stats = _Stats(self.address, len(nodes), len(shards), slots)
        first = len(records)
        reasons: list[str] = []
        cancelled = False
        while running:
            if stop.is_set() and not cancelled:  # Ctrl-C or SIGTERM: what was read stays, the rest is not reached
                for generator in running:
                    ray.cancel(generator)
                cancelled = True
            ready, _ = ray.wait(list(running), num_returns=1, timeout=WAIT_S)
            for generator in ready:
                task = running[generator]
                try:
                    chunk = ray.get(next(generator))
                except StopIteration:
                    del running[generator]
                    stats.finished(task)
                    continue
                except RayError as error:
                    del running[generator]
                    if not cancelled:
                        lost = _lost_records(task, error)
                        stats.lost(task, len(lost))
                        self._hand_on(lost, checkpoint, emit)
                    continue
                fresh = [record for record in chunk.records if task.owed(record)]
                stats.took(task, chunk, fresh)
                self._hand_on(fresh, checkpoint, emit)
                if chunk.stopped and chunk.stopped not in reasons:
                    reasons.append(chunk.stopped)
        context["ray"] = stats.summary()
        # Listing order, as one process has it: shared-content groups are numbered in record order.
        records.sort_from(first)
        if options.read_mode == "peek":
            self._confirm_shared(records)
        if reasons:
            stop.set()
            return "; ".join(f"deadline of {options.deadline_s:g} s reached" if reason == "deadline" else reason
                             for reason in reasons)
        return None

    def _submit(self, shards: list[Shard], nodes: dict[str, Node], options: ScanOptions, slots: int) -> dict:
        """One Ray task per shard, all at once: Ray queues them and places each near its holder."""
        driver = ray.get_runtime_context().get_node_id()
        here = next((node for node in nodes.values() if node.id == driver), None)
        # Global bounds split across the tasks that run at once; the plan travels once, by reference.
        task_options = replace(options, plan=CheckPlan(), max_bandwidth=(options.max_bandwidth / slots
                                                                         if options.max_bandwidth else None))
        deadline_at = None if options.deadline_s is None else time.time() + options.deadline_s
        plan = ray.put(options.plan)
        settings = replace(self.settings, local_hostname=None)  # each worker's own address towards the master
        scan = uuid.uuid4().hex
        running = {}
        for shard in shards:
            target = _node_for(shard.host, nodes, here)
            strategy = NodeAffinitySchedulingStrategy(target.id, soft=True) if target is not None else "DEFAULT"
            generator = scan_shard.options(scheduling_strategy=strategy).remote(
                scan, settings, task_options, plan, shard.keys, deadline_at)
            running[generator] = _Task.of(shard, target)
        return running

    @staticmethod
    def _hand_on(records: list[KeyRecord], checkpoint: Checkpoint | None, emit) -> None:
        if checkpoint is not None and records:
            checkpoint.append(records)
        for record in records:
            emit(record)

    def _confirm_shared(self, records: RecordLedger) -> None:
        """SHARED_CONTENT spans shards, so its lease-free confirmation happens here, on the driver."""
        from audit.readers.peek import PeekReader

        reader = PeekReader(self.settings, AdminClient(self.settings.admin), 2 * ALIGNMENT)
        try:
            confirm_shared(records, reader)
        finally:
            reader.close()


def _reachable(address: str, timeout_s: float = 5.0) -> None:
    """Fail in seconds on a wrong address: `ray.init` keeps retrying an unreachable GCS for minutes."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except ValueError:
        raise AuditError(f"--ray must be auto, local, ray://HOST:PORT or HOST:PORT, not {address!r}") from None
    except OSError as error:
        raise AuditError(f"Ray at {address} unreachable: {error.strerror or error}") from None


def _node_for(host: str | None, nodes: dict[str, Node], here: Node | None) -> Node | None:
    """The Ray node on a holder's host; a loopback holder is on the driver's own machine."""
    if host is None:
        return None
    try:
        ip = socket.gethostbyname(host)
    except OSError:
        return None
    return here if ipaddress.ip_address(ip).is_loopback else nodes.get(ip)


def _lost_records(task: _Task, error: RayError) -> list[KeyRecord]:
    """The keys a dead task never reported: UNREACHABLE, so the run is incomplete, never silent."""
    reason = str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
    return [KeyRecord(key=key.name, size=key.size, fields=None, verdicts=[Verdict.UNREACHABLE], ordinal=key.ordinal,
                      error={"code": TASK_LOST, "name": "TASK_LOST", "message": f"Ray task lost: {reason}"})
            for key in task.unreported()]


class _Stats:
    """The report's `ray` entry: how many tasks ran where, and the bytes each node read from a
    holder on its own host (local) or across the network (remote)."""

    def __init__(self, address: str, nodes: int, shards: int, slots: int):
        self.head = {"address": address, "nodes": nodes, "shards": shards, "task_slots": slots}
        self.by_node: dict[str, dict] = {}
        self.retried = self.tasks_lost = self.keys_lost = 0

    def _node(self, ip: str) -> dict:
        return self.by_node.setdefault(ip, {"node": ip, "tasks": 0, "keys": 0, "bytes_local": 0, "bytes_remote": 0})

    def took(self, task: _Task, chunk: Chunk, records: list[KeyRecord]) -> None:
        task.workers.add(chunk.worker)
        task.node = chunk.node
        row = self._node(chunk.node)
        row["keys"] += len(records)
        nbytes = sum(record.size or 0 for record in records if record.xxh3 is not None)
        local = task.target is not None and task.target.ip == chunk.node
        row["bytes_local" if local else "bytes_remote"] += nbytes

    def finished(self, task: _Task) -> None:
        if task.node is not None:
            self._node(task.node)["tasks"] += 1
        self.retried += len(task.workers) > 1

    def lost(self, task: _Task, keys: int) -> None:
        self.tasks_lost += 1
        self.keys_lost += keys
        self.retried += len(task.workers) > 1

    def summary(self) -> dict:
        return {**self.head, "tasks_retried": self.retried, "tasks_lost": self.tasks_lost,
                "keys_lost": self.keys_lost, "by_node": sorted(self.by_node.values(), key=lambda row: row["node"])}
