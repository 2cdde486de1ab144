"""The producer side, for the demo, the simulator, tests and benchmarks: publishing values into
a cluster the way a producer would. The audit path never imports it; only `purge` removes keys.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from audit.connection import Settings, open_store
from audit.errors import AuditError


class Publisher:
    """A producer-side store client (mounts no segment; the holders keep the bytes), in the default
    tenant or in `tenant`."""

    def __init__(self, settings: Settings, tenant: str | None = None):
        self.store = open_store(settings, tenant=tenant)

    def put(self, key: str, value: bytes | np.ndarray) -> None:
        data = value.tobytes() if isinstance(value, np.ndarray) else value
        rc = self.store.put(key, data)
        if rc != 0:
            raise AuditError(f"publishing {key[:80]!r} failed ({rc})")

    def put_many(self, items: Iterable[tuple[str, bytes | np.ndarray]]) -> int:
        count = 0
        for key, value in items:
            self.put(key, value)
            count += 1
        return count

    def remove(self, key: str) -> int:
        return self.store.remove(key)

    def close(self) -> None:
        self.store.close()
