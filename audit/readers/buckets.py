"""Mooncake's SSD tier on a holder's disk (the bucket backend, FACTS §11), read as files.

A holder that offloads writes each bucket as two files in its `MOONCAKE_OFFLOAD_FILE_STORAGE_PATH`:
`<id>.bucket`, its records back to back with no header, each `[tenant \\0 key][value]`, and
`<id>.meta`, a protobuf `BucketMetadata {1: data_size, 2: repeated key, 3: repeated {1: offset,
2: key_size, 3: data_size}}` (fields left at 0 are omitted). The `.meta` is written once the bucket
is complete, so a `.bucket` without one is still being written and is left alone. Mooncake's
`remove` leaves these files in place, so a directory can hold values the master no longer lists.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import NamedTuple

from audit.errors import AuditError


class StoredValue(NamedTuple):
    """Where one key's value lies in a bucket file: `offset` is its record's (the stored key
    first, `key_size` bytes long, then `size` bytes of value)."""

    path: Path
    offset: int
    key_size: int
    size: int
    stored_key: bytes  # `tenant \0 key`, as the record begins

    @property
    def value_offset(self) -> int:
        return self.offset + self.key_size


def _varint(data: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if at >= len(data):
            raise ValueError("truncated varint")
        byte = data[at]
        value |= (byte & 0x7F) << shift
        at += 1
        if not byte & 0x80:
            return value, at
        shift += 7


def _fields(data: bytes) -> Iterator[tuple[int, int | bytes]]:
    """(field number, value) of a protobuf message holding varints and length-delimited fields only."""
    at = 0
    while at < len(data):
        tag, at = _varint(data, at)
        number, wire = tag >> 3, tag & 7
        if wire == 0:
            value, at = _varint(data, at)
            yield number, value
        elif wire == 2:
            length, at = _varint(data, at)
            if at + length > len(data):
                raise ValueError("truncated field")
            yield number, data[at:at + length]
            at += length
        else:
            raise ValueError(f"unexpected wire type {wire}")


def bucket_values(meta: Path) -> list[StoredValue]:
    """The values a bucket holds, in its order, from its `.meta` file."""
    keys: list[bytes] = []
    places: list[tuple[int, int, int]] = []
    for number, value in _fields(meta.read_bytes()):
        if number == 2 and isinstance(value, bytes):
            keys.append(value)
        elif number == 3 and isinstance(value, bytes):
            place = dict(_fields(value))
            places.append((int(place.get(1, 0)), int(place.get(2, 0)), int(place.get(3, 0))))
    if len(keys) != len(places):
        raise ValueError(f"{len(keys)} keys but {len(places)} places")
    bucket = meta.with_suffix(".bucket")
    return [StoredValue(bucket, offset, key_size, size, key)
            for key, (offset, key_size, size) in zip(keys, places)]


def stored_key(tenant: str, key: str) -> bytes:
    return tenant.encode() + b"\0" + key.encode("utf-8", "surrogateescape")


def index_directories(directories: Iterable[Path]) -> dict[bytes, StoredValue]:
    """Every complete bucket's values in `directories`, by stored key (`stored_key`). A key that
    several buckets hold (removed or evicted, then put again) maps to the newest bucket's."""
    metas = []
    for directory in map(Path, directories):
        if not directory.is_dir():
            raise AuditError(f"offload directory {directory} does not exist")
        for meta in directory.glob("*.meta"):
            try:
                if meta.with_suffix(".bucket").exists():
                    metas.append((meta.stat().st_mtime_ns, meta))
            except FileNotFoundError:  # evicted from the disk meanwhile
                continue
    index: dict[bytes, StoredValue] = {}
    for _, meta in sorted(metas):
        try:
            values = bucket_values(meta)
        except FileNotFoundError:
            continue
        except (OSError, ValueError) as error:
            raise AuditError(f"cannot read offload metadata {meta}: {error}") from None
        index.update((value.stored_key, value) for value in values)
    return index
