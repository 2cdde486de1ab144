"""`watch`: run control for a continuous scrubber over the same scan core as `scan` and `check`.

Each round lists the store, reads the keys never verified (new ones first), then the keys whose last
verification is older than the period (oldest first, as much as the bandwidth allows in one interval,
only inside the window), merges the round's records for cross-key verdicts, and commits the verdicts to
SQLite. Unreachable keys keep their old stamp and are read again next round; a lost master is retried
with backoff; SIGTERM or SIGINT ends the round in flight between batches and flushes the state.
Between rounds, with block tables, the recorder's files are tailed in short slices, and the keys new
records name are read and judged at once in a record round, without a listing (docs/watch.md).
On a tiered store, peek reads with offload directories (`--offload-dir`) read disk-only keys from
the holder's files, lease-free, and a key held in both tiers has its disk copy compared with its
memory copy when it is read or its copies change (`audit.run.watch_copies`); with purge logs (`--purged`), a purged key listed again with its
purged bytes is flagged PURGED_RETURNED.
"""

from __future__ import annotations

import json
import re
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import numpy as np

from audit.blocktables import BlockTableTail
from audit.connection import AdminClient, Settings, open_store
from audit.errors import AuditError
from audit.judge.chunks import CHUNK_VERDICTS, ChunkIndex, clear_chunk_verdicts
from audit.judge.merge import merge_records
from audit.judge.purged import PurgedKeys
from audit.readers.disk import DiskReader
from audit.readers.throttle import ThrottledReader
from audit.records import KeyInfo, KeyRecord, Verdict
from audit.report.coverage import current_copy_place
from audit.report.inert import printable
from audit.report.watch_metrics import MetricsServer, WatchMetrics
from audit.run.options import ScanOptions
from audit.run.orchestrator import enable_writer_checksum
from audit.run.reading import after_batch_hook, buffer_bytes, confirm_shared, make_reader, read_samples
from audit.run.scan import scan_keys
from audit.run.stops import MasterWatch, StopOnSignals
from audit.run.watch_copies import DiskCopyWatch
from audit.run.watch_state import FINDINGS_FILE, WatchState
from audit.sources.keytable import KeyTable
from audit.sources.listing import AdminListing, KnownKeys, Listing

LISTING_SHARE = 0.1      # the listing may take at most this share of the time: the interval stretches
LISTINGS_MEDIAN = 5      # ... judged on the median of this many last listings that knew the one before (the
                         # next round's kind), so one slow one stretches nothing and a full one is not counted
MAX_BACKOFF_S = 60.0
SLICE_S = 0.25           # between rounds, the record files are looked at this often
PENDING_S = 30.0         # a key a record names that the store does not hold yet is looked for this long
READ_AHEAD_SHARE = 0.25  # keys are re-read at most this share of the period before it runs out
MASTER_CLIENT_TTL_S = 10.0  # Mooncake's default --client_ttl: a dead holder's keys stay listed, unreadable, this long
FULL_LISTING_EVERY = 10  # one listing in this many sizes every key; the others size only names not listed before


def stretched_interval(interval_s: float, listings_s, share: float = LISTING_SHARE) -> float:
    """--interval, stretched so that the median of the last listings' seconds stays under `share` of it."""
    return max(interval_s, statistics.median(listings_s) / share) if listings_s else interval_s


def read_ahead_s(period_s: float, interval_s: float, backlog_bytes: int, bandwidth: float | None) -> float:
    """How long before its period runs out a key is re-read: two intervals and the master's client
    TTL (a key whose holder dies just before the round that would read it stays listed, unreadable,
    for the TTL and is dropped by the next listing, all within its period), plus the seconds the bytes
    already inside the read-ahead margin need at the bandwidth cap; at most READ_AHEAD_SHARE of the
    period. Keys verified together then fall due over time, not at once."""
    lead = 2 * interval_s + MASTER_CLIENT_TTL_S + (backlog_bytes / bandwidth if bandwidth else 0.0)
    return min(lead, READ_AHEAD_SHARE * period_s)


def parse_duration(text: str) -> float:
    """`90`, `30s`, `15m`, `24h`, `7d`: seconds."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", text)
    if match is None or float(match.group(1)) <= 0:
        raise AuditError(f"--period must be a positive duration such as 3600, 30m, 24h or 7d, not {text!r}")
    return float(match.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[match.group(2)]


def parse_window(text: str) -> tuple[int, int]:
    """`HH:MM-HH:MM` (local time; may wrap midnight): minutes of the day, start and end."""
    match = re.fullmatch(r"(\d{1,2}):(\d{2})-(\d{1,2}):(\d{2})", text.strip())
    if match is None or int(match.group(1)) > 23 or int(match.group(3)) > 23 or int(match.group(2)) > 59 \
            or int(match.group(4)) > 59:
        raise AuditError(f"--window must be HH:MM-HH:MM, not {text!r}")
    h1, m1, h2, m2 = map(int, match.groups())
    return h1 * 60 + m1, h2 * 60 + m2


def in_window(window: tuple[int, int] | None, moment: datetime) -> bool:
    if window is None:
        return True
    start, end = window
    minute = moment.hour * 60 + moment.minute
    return start <= minute < end if start <= end else (minute >= start or minute < end)


@dataclass
class WatchOptions:
    state_dir: Path
    interval_s: float = 5.0  # a key is found within about one interval of its put (docs/watch.md)
    period_s: float = 86400.0
    window: tuple[int, int] | None = None
    listen: str = "127.0.0.1:9310"
    block_tables: tuple[Path, ...] = ()
    lenient: bool = False
    listing_share: float = LISTING_SHARE
    scan: ScanOptions = field(default_factory=ScanOptions)


class _RecordFeed:
    """The recorder's block-table records, tailed: each poll reads only what was appended since the last
    (audit.blocktables.BlockTableTail). The first poll replaces the tables read at startup, and names only
    the keys those did not name; later polls name every key a new record names."""

    def __init__(self, options: WatchOptions):
        self.tail = BlockTableTail(options.block_tables, lenient=options.lenient) if options.block_tables else None
        self._started = False

    def poll(self, plan) -> set[str]:
        if self.tail is None:
            return set()
        named = self.tail.poll()
        if not self._started:
            before = set(plan.tables.entries) if plan.tables is not None else set()
            plan.tables = self.tail.tables
            self._started = True
            return named - before
        return named


class Watcher:
    def __init__(self, settings: Settings, options: WatchOptions, log: Callable[[str], None]):
        self.settings = settings
        self.options = options
        self.log = log
        self.scan = options.scan
        self.key_filter = self.scan.key_filter()
        self.checker = self.scan.placement.checker()
        self.admin = AdminClient(settings.admin)
        self.metrics = WatchMetrics()
        self.feed = _RecordFeed(options)
        self.purged = PurgedKeys(self.scan.purge_logs) if self.scan.purge_logs else None
        self.disk_copies = DiskCopyWatch(self.admin, self.scan.offload_dirs) if self.scan.offload_dirs else None
        self._store = None
        self._fitted_sizes: set[int | None] = set()
        self._reader = None
        self._reader_bytes = 0
        self._listings_s: deque[float] = deque(maxlen=LISTINGS_MEDIAN)  # listings that knew the last one
        self._pending: dict[str, float] = {}     # named by a record, not in the store yet: until when to look
        self._chunks_unjudged: set[str] = set()  # judged in a record round: chunk verdicts wait for a listing
        self._listing: Listing | None = None     # the last listing: its keys need not be sized again
        self._listings_since_full = 0
        self._last_listing_full = True
        if self.scan.verify_writer_checksum:
            enable_writer_checksum(self.scan)

    def run(self) -> str:
        """Until SIGTERM or SIGINT; the signal's name."""
        state = WatchState(self.options.state_dir)
        server = None
        signals = StopOnSignals()
        try:
            server = MetricsServer(self.metrics, self.options.listen,
                                   stale_after_s=max(10 * self.options.interval_s, 300.0))
            with signals as stop:
                self._loop(state, stop, signals, server)
        finally:
            if server is not None:
                server.close()
            state.close()
            self._close_reader()
            if self._store is not None:
                self._store.close()
        return signals.received or "stopped"

    def _loop(self, state: WatchState, stop: threading.Event, signals: StopOnSignals, server) -> None:
        backoff = 1.0
        interval = self.options.interval_s
        while not stop.is_set():
            started = time.monotonic()
            try:
                listing_s = self._round(state, stop, signals, interval)
            except AuditError as error:
                server.alive()  # the loop is alive, backing off: /healthz is about the process, not the master
                self._close_reader()  # its transfer engine may not survive a master restart
                self.log(f"watch: {error}; retrying in {backoff:g} s")
                stop.wait(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF_S)
                continue
            backoff = 1.0
            server.alive()
            interval = self._next_interval(listing_s)
            self.metrics.interval.set(interval)
            self.metrics.interval_stretched.set(int(interval > self.options.interval_s))
            self._wait(state, stop, signals, server, started + interval)

    def _next_interval(self, listing_s: float) -> float:
        """The interval to the next round: stretched on the median of the last listings that took the
        one before from it, as the next round's will (all but one in FULL_LISTING_EVERY). A listing that
        sized every key (a watcher's first, and one in FULL_LISTING_EVERY) costs several times more and
        is not counted: the first one alone would stretch the interval after start-up to ten times its
        seconds, and after the second round to ten times the mean of the two (29 s, then 16 s at 100,000
        keys), so that the first keys put after start-up waited that long however cheap the listings."""
        if not self._last_listing_full:
            self._listings_s.append(listing_s)
            self.metrics.listing_seconds_median.set(statistics.median(self._listings_s))
        return stretched_interval(self.options.interval_s, self._listings_s, self.options.listing_share)

    def _wait(self, state: WatchState, stop: threading.Event, signals: StopOnSignals, server, until: float) -> None:
        """Until the next round, in short slices: a key a new record names is read at once, without a listing."""
        while not stop.is_set():
            left = until - time.monotonic()
            if left <= 0:
                return
            stop.wait(min(left, SLICE_S) if self.feed.tail is not None else left)
            if stop.is_set() or self.feed.tail is None:
                continue
            try:
                self._record_round(state, stop, signals, self.feed.poll(self.scan.plan))
            except AuditError as error:
                self.log(f"watch: {error}")
                return  # the next round finds out whether the master is gone, and backs off
            server.alive()

    def _record_round(self, state: WatchState, stop: threading.Event, signals: StopOnSignals,
                      named: set[str]) -> None:
        """Read and judge the keys new records name (and those named earlier the store did not hold yet),
        sized lease-free as the listing sizes them; their chunk verdicts wait for the next listing."""
        now = time.time()
        self._look_for(named, now)
        self._pending = {name: until for name, until in self._pending.items() if until > now}
        if not self._pending:
            self.metrics.record_keys_pending.set(0)
            return
        found = AdminListing(self.admin, self.key_filter).size_names(list(self._pending))
        for name in found:
            del self._pending[name]
        self.metrics.record_keys_pending.set(len(self._pending))
        if not found:
            return
        keys = list(found.values())
        state.add_new({key.name: key.size for key in keys}, now)
        state.unverify(set(found))  # a key verified before: the new record is new evidence
        self._fit_layouts(self.admin, keys)
        records, earlier, lost, read_at = self._read(state, self.admin, keys, stop, keys_listed=len(keys),
                                                     chunks=None)
        clear_chunk_verdicts(records + earlier)  # only the listing knows a chunk's other members:
        self._commit(state, records, earlier, read_at)
        self._chunks_unjudged |= {record.key for record in records + earlier}  # the next round judges them
        self.metrics.record_rounds.inc()
        self.metrics.record_keys.inc(len(keys))
        self.metrics.show_state(state.counts(time.time() - self.options.period_s), time.time())
        if lost and signals.received is None:
            stop.clear()
            raise AuditError(lost)

    def _round(self, state: WatchState, stop: threading.Event, signals: StopOnSignals, interval: float) -> float:
        """One listing and the reads it calls for; the listing's seconds."""
        admin = self.admin
        try:
            admin.health()
        except AuditError:
            self.metrics.master_up.set(0)
            raise
        self.metrics.master_up.set(1)
        known = state.known()  # before the listing: keys a record round enters meanwhile are not forgotten
        previous = self._listing
        listed_at = time.perf_counter()
        listing = self._list(state, stop, signals)
        listing_s = time.perf_counter() - listed_at
        self.metrics.listing_seconds.set(listing_s)
        self.metrics.listings.inc()
        self.metrics.keys_listed.set(len(listing.keys))
        now = time.time()
        table, listed = listing.keys, listing.rows_by_name  # name -> row: no KeyInfo per listed key
        state.add_new({name: table.size(row) for name, row in listed.items() if name not in known}, now)
        state.forget(known - listed.keys())
        if self.disk_copies is not None:
            state.unverify(self.disk_copies.changed(table, listed, state))  # read again: copies changed
        named = self.feed.poll(self.scan.plan)
        state.unverify(named)  # a key named by a new record: judged again now
        self._pending = {name: until for name, until in self._pending.items() if name not in listed}
        self._look_for(named - listed.keys(), now)
        self._fit_layouts(admin, table)
        new = [table.info(listed[name]) for name in state.never_verified() if name in listed]
        due = []
        if in_window(self.options.window, datetime.now()):
            budget = None if self.scan.max_bandwidth is None else self.scan.max_bandwidth * interval
            ahead = read_ahead_s(self.options.period_s, interval,
                                 state.bytes_before(now - (1 - READ_AHEAD_SHARE) * self.options.period_s),
                                 self.scan.max_bandwidth)
            self.metrics.read_ahead.set(ahead)
            due = [table.info(listed[name]) for name in state.due(now - self.options.period_s + ahead, budget)
                   if name in listed]
        keys = self._sized_again(state, new + due, listing, previous)
        read = {key.name for key in keys}
        unjudged = [table.info(listed[name]) for name in self._chunks_unjudged if name in listed and name not in read]
        self._chunks_unjudged.clear()
        records, earlier, lost, read_at = self._read(state, admin, keys, stop, keys_listed=len(listing.keys),
                                            chunks=ChunkIndex.of_table(table) if keys or unjudged else None,
                                            unjudged=unjudged)
        self._commit(state, records, earlier, read_at)  # what was judged before a lost master stands
        if lost and signals.received is None:
            stop.clear()  # the master, not an operator, stopped the round: retry with backoff
            raise AuditError(lost)
        self.metrics.rounds.inc()
        self.metrics.last_round.set(time.time())
        self.metrics.show_state(state.counts(time.time() - self.options.period_s), time.time())
        return listing_s

    def _sized_again(self, state: WatchState, keys: list[KeyInfo], listing: Listing,
                     previous: Listing | None) -> list[KeyInfo]:
        """The keys to read, each as sized by the master now: a key the listing took from the last
        one (not sized this round) is sized again, so that it is read at its size and replicas of
        now, as a listing sizing every key would give them; one the master no longer answers for is
        gone, and forgotten, as that listing would have left it out."""
        if previous is None or self._last_listing_full or not keys:
            return keys
        stale = [key.name for key in keys if key.name in previous.rows_by_name]
        if not stale:
            return keys
        fresh = AdminListing(self.admin, self.key_filter).size_names(stale)
        state.forget(set(stale) - fresh.keys())
        return [fresh.get(key.name) if key.name in previous.rows_by_name else key
                for key in keys if key.name not in previous.rows_by_name or key.name in fresh]

    def _listing_of_store(self) -> tuple[Listing, bool]:
        """Every key of the store, by name, and whether every key was sized. The names the last
        listing held are not sized again (their sizes and replicas are taken from it), except in one
        listing of FULL_LISTING_EVERY: a listing of a store that changes little then costs about one
        `/get_all_keys`, and what it takes from the last one is never older than that many rounds."""
        full = self._listing is None or self._listings_since_full + 1 >= FULL_LISTING_EVERY
        known = None if full else KnownKeys(self._listing)
        return AdminListing(self.admin, self.key_filter).list(known=known, index=True), full

    def _keep_listing(self, listing: Listing, full: bool) -> Listing:
        self._listings_since_full = 0 if full else self._listings_since_full + 1
        self._last_listing_full = full
        self._listing = listing
        self.metrics.keys_sized.set(listing.sized)
        return listing

    def _list(self, state: WatchState, stop: threading.Event, signals: StopOnSignals):
        """The listing; with block tables it runs on a thread (the admin client keeps a connection per
        thread) while record rounds go on in slices, so that a listing of a large store delays no
        record-fed key."""
        if self.feed.tail is None:
            return self._keep_listing(*self._listing_of_store())
        outcome: dict = {}

        def work():
            try:
                outcome["listing"] = self._listing_of_store()  # (listing, full)
            except BaseException as error:  # noqa: BLE001 (raised again on the watcher's thread)
                outcome["error"] = error

        thread = threading.Thread(target=work, name="listing", daemon=True)
        thread.start()
        tailing = True
        while thread.is_alive():
            thread.join(SLICE_S)
            if tailing and thread.is_alive() and not stop.is_set():
                try:
                    self._record_round(state, stop, signals, self.feed.poll(self.scan.plan))
                except AuditError as error:
                    self.log(f"watch: {error}")
                    tailing = False  # the listing's end decides whether the master is gone
        if "error" in outcome:
            raise outcome["error"]
        return self._keep_listing(*outcome["listing"])

    def _fit_layouts(self, admin: AdminClient, keys: list[KeyInfo]) -> None:
        """As `scan` does before reading, again whenever a size not seen before is listed."""
        plan = self.scan.plan
        if isinstance(keys, KeyTable):  # a listing: its size column, not a KeyInfo per key
            sizes = {None if size < 0 else size for size in np.unique(keys.size_array()).tolist()}
        else:
            sizes = {key.size for key in keys}
        if not (plan.requests or plan.manifests) or sizes <= self._fitted_sizes:
            return
        plan.fit_sizes(keys)
        if plan.readings:
            samples = plan.reading_samples(keys)
            read_samples(self.settings, admin, self._lease_store(), samples, self.scan, plan.add_sample)
            plan.decide_readings()
        self._fitted_sizes |= sizes

    def _lease_store(self):
        """The store client lease reads need, set up once; None for peek reads."""
        if self.scan.read_mode != "lease":
            return None
        if self._store is None:
            self._store = open_store(self.settings)
        return self._store

    def _reader_for(self, admin: AdminClient, keys: list[KeyInfo]):
        """One reader for the life of the watcher (a transfer engine and registered buffers are slow to
        set up), replaced by a larger one only when a round needs more room."""
        needed = buffer_bytes(keys, self.scan)
        if self._reader is None or self._reader_bytes < needed:
            self._close_reader()
            self._reader = make_reader(self.settings, admin, self._lease_store(), keys, self.scan)
            self._reader_bytes = needed
        return self._reader

    def _close_reader(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None

    def _look_for(self, names: set[str], now: float) -> None:
        """Keys new records name, not read yet: looked for in the store on the next slices, for PENDING_S."""
        for name in filter(self.key_filter, names):
            self._pending.setdefault(name, now + PENDING_S)

    def _read(self, state: WatchState, admin: AdminClient, keys: list[KeyInfo], stop: threading.Event,
              keys_listed: int, chunks: ChunkIndex | None,
              unjudged: list[KeyInfo] = ()) -> tuple[list[KeyRecord], list[KeyRecord], str | None, dict[str, float]]:
        """The round's records, cross-key verdicts included; the earlier rounds' keys whose bytes they
        share, and the `unjudged` keys (judged in a record round) whose chunk verdicts the listing settles
        now (verdicts revised, not read); why the master stopped the round, if it did; when each key
        was read (its batch came back), which is when it was verified, however long the round runs on."""
        rejudged = self._chunk_rejudge(state, unjudged, chunks) if unjudged else []
        if not keys:
            self.metrics.bytes_per_second.set(0)
            return [], rejudged, None, {}
        watch = MasterWatch(admin, stop)
        started = time.perf_counter()
        records, read_at = [], {}
        by_name = {key.name: key for key in keys}
        disk, on_disk, keys = self._disk_reading(admin, keys)
        if on_disk:
            try:
                self._scan(on_disk, disk, stop, watch, records, read_at)
            finally:
                disk.close()
        if keys and not stop.is_set():
            self._scan(keys, self._reader_for(admin, keys), stop, watch, records, read_at)
        if self.disk_copies is not None:
            for row in self.disk_copies.compare(records, by_name):
                if "current_copy" in row:
                    self.log(f"watch: on disk beside its key's current copy: {printable(row['key'], 200)} "
                             f"({row['file']} at {row['offset']}; current: {printable(current_copy_place(row['current_copy']), 200)}), unlike the "
                             f"bytes in memory: served again if its holder restarts once the key has left the store")
                else:
                    self.log(f"watch: on disk but not listed for its key: {printable(row['key'], 200)} ({row['file']} "
                             f"at {row['offset']}), unlike the bytes in memory: a restart of its holder registers it "
                             f"again in their place")
            latent = self.disk_copies.rows()
            self.metrics.disk_copies_latent.set(len(latent))
            self.metrics.disk_copies_latent_unlike.set(sum(row["xxh3"] != row["memory_xxh3"] for row in latent))
        earlier = state.same_content(records)
        if hasattr(self._reader, "confirm") and not watch.lost:  # a peek reader's second read (disk-only: leased)
            confirm_shared(records + earlier, self._reader)
        if self.purged is not None:
            for record in records:
                self.purged.judge(record)
        elapsed = time.perf_counter() - started
        read_bytes = sum(record.size or 0 for record in records if record.xxh3 is not None)
        self.metrics.bytes_scanned.inc(read_bytes)
        self.metrics.bytes_per_second.set(read_bytes / elapsed if elapsed > 0 else 0)
        merge_records(records + earlier, context={}, keys_listed=keys_listed, chunks=chunks)  # cross-key verdicts
        return records, earlier + rejudged, watch.lost, read_at

    def _disk_reading(self, admin: AdminClient,
                      keys: list[KeyInfo]) -> tuple[DiskReader | None, list[KeyInfo], list[KeyInfo]]:
        """A disk reader of the offload directories, indexed afresh each round (peek reads only), the
        disk-only keys they hold, which it reads, and the rest."""
        if self.scan.read_mode != "peek" or not self.scan.offload_dirs:
            return None, [], keys
        disk = DiskReader(admin, self.scan.offload_dirs, buffer_bytes(keys, self.scan),
                          read_ahead=not self.scan.max_bandwidth)
        return disk, *disk.split(keys)

    def _scan(self, keys: list[KeyInfo], base, stop: threading.Event, watch: MasterWatch,
              records: list[KeyRecord], read_at: dict[str, float]) -> None:
        """`keys` read through `base` (paced by --max-bandwidth), findings confirmed by its second read."""
        reader = ThrottledReader(base, self.scan.max_bandwidth, stop) if self.scan.max_bandwidth else base
        hook = after_batch_hook(getattr(base, "confirm", None), None, watch)
        for record in scan_keys(keys, reader, self.checker, self.scan.plan, stop=stop, on_batch=hook):
            records.append(record)
            read_at[record.key] = time.time()

    @staticmethod
    def _chunk_rejudge(state: WatchState, keys: list[KeyInfo], chunks: ChunkIndex | None) -> list[KeyRecord]:
        """The stored verdicts of `keys`, with the chunk verdicts the listing's `chunks` gives them."""
        stored = state.stored(key.name for key in keys)
        probes = [KeyRecord(key=r.key, size=r.size, fields=None, xxh3=None, verdicts=[]) for r in stored]
        merge_records(probes, context={}, keys_listed=len(probes), chunks=chunks)  # no digests: chunks only
        for record, probe in zip(stored, probes):
            kept = [v for v in record.verdicts if v not in CHUNK_VERDICTS or v == "IDENTITY_SUSPECT"]
            record.verdicts = kept + [v for v in probe.verdicts if v in CHUNK_VERDICTS and v not in kept]
            record.evidence.update({k: v for k, v in probe.evidence.items() if k not in record.evidence})
        return stored

    def _commit(self, state: WatchState, records: list[KeyRecord], earlier: list[KeyRecord],
                read_at: dict[str, float]) -> None:
        now = time.time()
        vanished = {r.key for r in records if Verdict.VANISHED in r.verdicts}
        raced = {r.key for r in records if Verdict.MOVED in r.verdicts}  # read again next round
        unreachable = [r for r in records if r.is_incomplete]
        judged = [r for r in records if not r.is_incomplete and r.key not in vanished | raced]
        self.metrics.keys_unreachable.set(len(unreachable))
        state.forget(vanished)
        first_seen = state.first_seen(r.key for r in judged)
        for seen in first_seen.values():
            self.metrics.first_seen_to_verified.observe(max(now - seen, 0.0))
        state.verified(judged, now, self._append_findings, read_at=read_at)
        state.verified(earlier, now, self._append_findings, restamp=False)

    def _append_findings(self, records: list[KeyRecord]) -> None:
        """One JSON line per new finding, for log shippers (at least once: see WatchState.verified)."""
        stamp = datetime.now().astimezone().isoformat(timespec="seconds")
        try:
            with open(self.options.state_dir / FINDINGS_FILE, "a", encoding="utf-8") as handle:
                handle.writelines(json.dumps({"detected_at": stamp, **record.to_json()}) + "\n" for record in records)
        except OSError as error:
            raise AuditError(f"cannot append to {self.options.state_dir / FINDINGS_FILE}: {error.strerror}") from None
