"""What the load guard refuses without reading the bytes: keys refused before, and keys the put
records say were published from vLLM's null block.

A refused key must stay refused: with ``kv_load_failure_policy="recompute"`` the scheduler
reschedules the request, looks the prefix up again (``batch_is_exist``, on TP rank 0 only) and
would load the same key for ever (18,636 gets in 150 s, issue #29). So every refusal is appended to
this process's ``denied-*`` file, and every process whose recorder writes into the same directory
(the engine's TP ranks; other engines of the host) reads the others' files back before it answers a
lookup. Both sets are bounded: the oldest entries go first.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from pathlib import Path

from audit.recordfiles import AppendedLines
from audit.blocktables import NULL_BLOCK_ID
from audit.recorder.records import RecordWriter, logger

DENIED_STEM = "denied"
DEFAULT_CAPACITY = 1 << 16
PUT_RECORDS_POLL_S = 0.5  # another engine's puts: read at most this often


class RecordTail:
    """New whole lines of the files matching `pattern` in `directories`."""

    def __init__(self, directories: list[Path], pattern: str):
        self.directories = directories
        self.pattern = pattern
        self._appended = AppendedLines()

    def lines(self) -> list[str]:
        paths: list[Path] = []
        for directory in self.directories:
            try:
                paths += sorted(directory.glob(self.pattern))
            except OSError:
                continue
        return [line for new in self._appended.read(paths, skip_unreadable=True)
                for line in new.data.decode("utf-8", "replace").splitlines()]


class _Bounded:
    """A set of keys with a reason each, forgetting its oldest past `capacity`."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._items: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, key: str, reason: str) -> None:
        with self._lock:
            self._items[key] = reason
            self._items.move_to_end(key)
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def get(self, key: str) -> str | None:
        return self._items.get(key)

    def __len__(self) -> int:
        return len(self._items)


class DenyList:
    """Keys refused by any guard writing into `directory`, and null-backed keys of the put records
    there and in `put_directories`."""

    def __init__(self, directory: Path, writer: RecordWriter, put_directories: list[Path] = (),
                 capacity: int = DEFAULT_CAPACITY):
        self.writer = writer
        self.denied = _Bounded(capacity)
        self.null_backed = _Bounded(capacity)
        self._first_put = _Bounded(capacity * 4)  # a key's first stored put decides its source
        self._denied_tail = RecordTail([Path(directory)], f"{DENIED_STEM}-*.jsonl")
        self._put_tail = RecordTail([Path(directory), *map(Path, put_directories)], "blocks-*.jsonl")
        self._puts_read_at = 0.0
        self._lock = threading.Lock()

    def deny(self, key: str, reason: str) -> None:
        """Refuse `key` from now on, in this process and (through its file) in every other."""
        self.denied.add(key, reason)
        self.writer.write([json.dumps({"key": key, "time": time.time(), "reason": reason}, separators=(",", ":"))])

    def reason(self, key: str) -> str | None:
        """Why `key` is refused without a read ("DENIED", "NULL_BACKED"), or None."""
        if self.denied.get(key) is not None:
            return "DENIED"
        return self.null_backed.get(key)

    def refresh(self) -> None:
        """Read what other processes appended: refusals always, put records every PUT_RECORDS_POLL_S."""
        with self._lock:
            for line in self._denied_tail.lines():
                record = _json(line)
                if record and isinstance(record.get("key"), str):
                    self.denied.add(record["key"], str(record.get("reason") or "DENIED"))
            now = time.monotonic()
            if now - self._puts_read_at >= PUT_RECORDS_POLL_S:
                self._puts_read_at = now
                for line in self._put_tail.lines():
                    self._put(line)

    def _put(self, line: str) -> None:
        if '"rc":0' not in line:
            return  # failed and raised puts stored nothing
        record = _json(line)
        key = record.get("key") if record else None
        if not isinstance(key, str) or record.get("rc") != 0 or record.get("withheld"):
            return
        if self._first_put.get(key) is not None:
            return  # a later put of a stored key changes nothing (FACTS §7)
        block_ids = record.get("block_ids")
        null = isinstance(block_ids, list) and NULL_BLOCK_ID in block_ids
        self._first_put.add(key, "null" if null else "real")
        if null:
            self.null_backed.add(key, "NULL_BACKED")


def _json(line: str) -> dict | None:
    try:
        record = json.loads(line)
    except ValueError:
        logger.debug("mooncake-audit guard: unreadable record line skipped")
        return None
    return record if isinstance(record, dict) else None
