"""Mooncake's file-per-key SSD backend (`MOONCAKE_OFFLOAD_STORAGE_BACKEND_DESCRIPTOR=
file_per_key_storage_backend`), read as files.

The holder writes each value it offloads as a file of its own under
`<MOONCAKE_OFFLOAD_FILE_STORAGE_PATH>/file_per_key_dir/`, two levels of one-letter directories
down, named after the tenant and the key with `/` made `_`: a name that two keys can share, so the
key is taken from the file itself, a protobuf `KVEntry {1: key, 2: value}` whose key is `tenant \\0
key` (measured on 0.3.13.post1). Fields are written in number order, so the value's bytes are the
file's tail after a short head; a file whose length is not its head plus the value's is still being
written (or is no KVEntry) and is left alone. `remove` leaves the file in place.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

from audit.readers.buckets import StoredValue, read_varint

KEY_FILES_DIR = "file_per_key_dir"  # the backend's directory under the holder's offload path
HEAD_READ = 4096  # bytes read to find a file's head: tags, the key and the value's length
KEY_FIELD, VALUE_FIELD = 0x0A, 0x12  # protobuf tags: field 1 and field 2, length-delimited


def parse_head(data: bytes, file_size: int) -> tuple[bytes, int] | None:
    """(stored key, head length) of a KVEntry that begins with `data` and is `file_size` bytes
    long; None when it is not one, whole."""
    try:
        if data[:1] != bytes([KEY_FIELD]):
            return None
        key_size, at = read_varint(data, 1)
        key, at = data[at:at + key_size], at + key_size
        if len(key) != key_size or data[at:at + 1] != bytes([VALUE_FIELD]):
            return None
        value_size, at = read_varint(data, at + 1)
    except ValueError:  # truncated within the bytes read
        return None
    return (key, at) if at + value_size == file_size and b"\0" in key else None


def key_file_value(path: Path) -> StoredValue | None:
    """The value a file-per-key file holds; None when the file is gone or is no whole KVEntry."""
    try:
        with open(path, "rb") as entry:
            size = os.fstat(entry.fileno()).st_size
            head = entry.read(HEAD_READ)
    except FileNotFoundError:  # evicted from the disk meanwhile
        return None
    parsed = parse_head(head, size)
    if parsed is None:
        return None
    key, head_size = parsed
    return StoredValue(path, 0, size - head_size, key, head[:head_size])


def key_files(directory: Path) -> Iterator[StoredValue]:
    """Every whole KVEntry under `directory`'s file-per-key directory (none when it has none)."""
    for root, _, names in os.walk(Path(directory) / KEY_FILES_DIR):
        for name in sorted(names):
            value = key_file_value(Path(root) / name)
            if value is not None:
                yield value
