"""The cron check's state directory: a lock against overlapping runs, and the keys seen so far."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterable
from itertools import islice
from pathlib import Path

import numpy as np

from audit.errors import AuditError
from audit.sources.keytable import name_digest

LOCK_NAME = "lock"
SEEN_NAME = "seen-keys.npy"  # sorted XXH3-64 of key names: 8 bytes a key, a million keys in 8 MB
BLOCK = 65_536               # names hashed at a time


def _hashes(names: list[str]) -> np.ndarray:
    """Each name's `name_digest`, as the seen set keeps them."""
    return np.fromiter(map(name_digest, names), dtype=np.uint64, count=len(names))


class StateDir:
    """Holds an exclusive lock on the directory for the life of the run."""

    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            self.path.mkdir(parents=True, exist_ok=True, mode=0o700)
            self._lock = open(self.path / LOCK_NAME, "a+")
        except OSError as error:
            raise AuditError(f"cannot use state dir {self.path}: {error.strerror}") from None
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.seek(0)
            holder = self._lock.read().strip() or "unknown"
            self._lock.close()
            raise AuditError(f"another check is running on {self.path} (pid {holder}); not starting") from None
        self._lock.seek(0)
        self._lock.truncate()
        self._lock.write(str(os.getpid()))
        self._lock.flush()

    def new_keys(self, names: Iterable[str]) -> set[str]:
        """Names not seen by an earlier run (all of them on the first run), a block at a time."""
        seen = self._seen()
        new: set[str] = set()
        names = iter(names)
        while block := list(islice(names, BLOCK)):
            if seen.size == 0:
                new.update(block)
                continue
            known = np.isin(_hashes(block), seen)
            new.update(name for name, was_seen in zip(block, known) if not was_seen)
        return new

    def remember(self, hashes: np.ndarray) -> None:
        """Add names to the seen set by their XXH3-64 (`RecordLedger.name_hashes`): 8 bytes a name,
        never a set of names."""
        merged = np.unique(np.concatenate([self._seen(), np.asarray(hashes, dtype=np.uint64)]))
        temp = self.path / f".{SEEN_NAME}.{os.getpid()}"
        with open(temp, "wb") as handle:
            np.save(handle, merged)
        os.replace(temp, self.path / SEEN_NAME)

    def _seen(self) -> np.ndarray:
        try:
            return np.load(self.path / SEEN_NAME)
        except (OSError, ValueError):
            return np.zeros(0, dtype=np.uint64)

    def release(self) -> None:
        fcntl.flock(self._lock, fcntl.LOCK_UN)
        self._lock.close()
