"""The values a holder's offload directory holds, whichever backend wrote them: the bucket
backend's `.bucket`/`.meta` pairs (`audit.readers.buckets`) and the file-per-key backend's
KVEntry files (`audit.readers.key_files`), by stored key (`tenant \\0 key`)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from audit.errors import AuditError
from audit.readers.buckets import StoredValue, bucket_values
from audit.readers.key_files import key_files


def _offload_directories(directories: Iterable[Path]) -> list[Path]:
    found = list(map(Path, directories))
    for directory in found:
        if not directory.is_dir():
            raise AuditError(f"offload directory {directory} does not exist")
    return found


def _bucket_values(meta: Path) -> list[StoredValue]:
    try:
        return bucket_values(meta)
    except FileNotFoundError:  # evicted from the disk meanwhile
        return []
    except (OSError, ValueError) as error:
        raise AuditError(f"cannot read offload metadata {meta}: {error}") from None


def index_directories(directories: Iterable[Path]) -> dict[bytes, StoredValue]:
    """Every complete bucket's values and every key file in `directories`, by stored key
    (`stored_key`). A key that several buckets hold (removed or evicted, then put again) maps to
    the newest bucket's."""
    metas = []
    index: dict[bytes, StoredValue] = {}
    for directory in _offload_directories(directories):
        for meta in directory.glob("*.meta"):
            try:
                if meta.with_suffix(".bucket").exists():
                    metas.append((meta.stat().st_mtime_ns, meta))
            except FileNotFoundError:  # evicted from the disk meanwhile
                continue
        index.update((value.stored_key, value) for value in key_files(directory))
    for _, meta in sorted(metas):
        index.update((value.stored_key, value) for value in _bucket_values(meta))
    return index


def copies_holding(directories: Iterable[Path], stored_keys: set[bytes]) -> dict[Path, list[StoredValue]]:
    """Every copy in `directories` of one of `stored_keys`, all of them, not only the newest (a
    restarted holder registers each): by `.meta` path for buckets, by the file's path for key files."""
    found: dict[Path, list[StoredValue]] = {}
    for directory in _offload_directories(directories):
        for meta in sorted(directory.glob("*.meta")):
            values = [value for value in _bucket_values(meta) if value.stored_key in stored_keys]
            if values:
                found[meta] = values
        for value in key_files(directory):
            if value.stored_key in stored_keys:
                found[value.path] = [value]
    return found
