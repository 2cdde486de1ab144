"""Mooncake's SSD tier on a holder's disk (the bucket backend, FACTS §11), read as files
(`audit.readers.offload_index` indexes them beside the file-per-key backend's).

A holder that offloads writes each bucket as two files in its `MOONCAKE_OFFLOAD_FILE_STORAGE_PATH`:
`<id>.bucket`, its records back to back with no header, each `[tenant \\0 key][value]`, and
`<id>.meta`, a protobuf `BucketMetadata {1: data_size, 2: repeated key, 3: repeated {1: offset,
2: key_size, 3: data_size}}` (fields left at 0 are omitted). The `.meta` is written once the bucket
is complete, so a `.bucket` without one is still being written and is left alone. Mooncake's
`remove` leaves these files in place, so a directory can hold values the master no longer lists.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple


class StoredValue(NamedTuple):
    """Where one key's value lies in a file: `offset` is its record's, which begins with `head`
    (a bucket's: the stored key; a file-per-key file's: its protobuf up to the value's bytes),
    then `size` bytes of value."""

    path: Path
    offset: int
    size: int
    stored_key: bytes  # `tenant \0 key`
    head: bytes

    @property
    def value_offset(self) -> int:
        return self.offset + len(self.head)

    @property
    def in_bucket(self) -> bool:
        """Whether the value lies in a bucket (many keys per file) rather than a file of its own."""
        return self.path.suffix == ".bucket"


def read_varint(data: bytes, at: int) -> tuple[int, int]:
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
        tag, at = read_varint(data, at)
        number, wire = tag >> 3, tag & 7
        if wire == 0:
            value, at = read_varint(data, at)
            yield number, value, start, at
        elif wire == 2:
            length, at = read_varint(data, at)
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


def read_small_file(path: Path) -> bytes:
    """A small file's bytes by plain system calls (no buffered file object: a disk tier of one key
    a bucket has a `.meta` per key, and an index reads them all)."""
    descriptor = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        parts = []
        while part := os.read(descriptor, 1 << 16):
            parts.append(part)
        return b"".join(parts)
    finally:
        os.close(descriptor)


def bucket_values(meta: Path, bucket: Path | None = None) -> list[StoredValue]:
    """The values a bucket holds, in its order, from its `.meta` file (`bucket`: its `.bucket`, where
    the caller has its path already)."""
    keys: list[bytes] = []
    places: list[tuple[int, int, int]] = []
    for number, value in _fields(read_small_file(meta)):
        if number == 2 and isinstance(value, bytes):
            keys.append(value)
        elif number == 3 and isinstance(value, bytes):
            place = dict(_fields(value))
            places.append((int(place.get(1, 0)), int(place.get(2, 0)), int(place.get(3, 0))))
    if len(keys) != len(places):
        raise ValueError(f"{len(keys)} keys but {len(places)} places")
    bucket = bucket or meta.with_suffix(".bucket")
    if any(key_size != len(key) for key, (_, key_size, _) in zip(keys, places)):
        raise ValueError("a key_size differs from its key's length")
    return [StoredValue(bucket, offset, size, key, key) for key, (offset, _, size) in zip(keys, places)]


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


def stored_key(tenant: str, key: str) -> bytes:
    return tenant.encode() + b"\0" + key.encode("utf-8", "surrogateescape")


def tenant_and_key(stored: bytes) -> tuple[str, str]:
    """`stored_key`'s inverse: the tenant and the key of a stored `tenant \\0 key`."""
    tenant, _, key = stored.partition(b"\0")
    return tenant.decode("utf-8", "surrogateescape"), key.decode("utf-8", "surrogateescape")
