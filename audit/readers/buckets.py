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


def _spans(data: bytes) -> Iterator[tuple[int, int | bytes, int, int]]:
    """(field number, value, start, end) of each field of a protobuf message holding varints and
    length-delimited fields only; `start:end` is the field's encoding, tag included."""
    at = 0
    while at < len(data):
        start = at
        tag, at = _varint(data, at)
        number, wire = tag >> 3, tag & 7
        if wire == 0:
            value, at = _varint(data, at)
            yield number, value, start, at
        elif wire == 2:
            length, at = _varint(data, at)
            if at + length > len(data):
                raise ValueError("truncated field")
            yield number, data[at:at + length], start, at + length
            at += length
        else:
            raise ValueError(f"unexpected wire type {wire}")


def _fields(data: bytes) -> Iterator[tuple[int, int | bytes]]:
    """(field number, value) of a protobuf message holding varints and length-delimited fields only."""
    for number, value, _, _ in _spans(data):
        yield number, value


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


def meta_without(meta: bytes, stored_keys: set[bytes]) -> tuple[bytes, int]:
    """A `.meta`'s bytes with the entries of `stored_keys` left out (the i-th key and the i-th
    place go together), every other byte as it was; and how many keys it still lists. A holder
    registers at start-up exactly the keys its `.meta` files list (Mooncake's
    `BucketStorageBackend::Init`), at the offsets they give: the bucket file itself is not touched,
    so the other keys' values stay where their places say."""
    spans = list(_spans(meta))
    key_spans = [index for index, (number, *_) in enumerate(spans) if number == 2]
    place_spans = [index for index, (number, *_) in enumerate(spans) if number == 3]
    if len(key_spans) != len(place_spans):
        raise ValueError(f"{len(key_spans)} keys but {len(place_spans)} places")
    dropped = {span for key, place in zip(key_spans, place_spans) if spans[key][1] in stored_keys
               for span in (key, place)}
    kept = b"".join(meta[start:end] for index, (_, _, start, end) in enumerate(spans) if index not in dropped)
    return kept, len(key_spans) - len(dropped) // 2


def buckets_holding(directories: Iterable[Path], stored_keys: set[bytes]) -> dict[Path, list[StoredValue]]:
    """Every complete bucket of `directories` that lists one of `stored_keys`, by `.meta` path, with
    those keys' values: all of them, not only the newest (a restarted holder registers each)."""
    found: dict[Path, list[StoredValue]] = {}
    for directory in map(Path, directories):
        if not directory.is_dir():
            raise AuditError(f"offload directory {directory} does not exist")
        for meta in sorted(directory.glob("*.meta")):
            try:
                values = [value for value in bucket_values(meta) if value.stored_key in stored_keys]
            except FileNotFoundError:
                continue
            except (OSError, ValueError) as error:
                raise AuditError(f"cannot read offload metadata {meta}: {error}") from None
            if values:
                found[meta] = values
    return found


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
