"""The disk reader's mapped windows and the offload index it keeps between batches, on files
written here in the bucket backend's format (FACTS §11)."""

from __future__ import annotations

import os

import numpy as np

from audit.readers.buckets import stored_key
from audit.readers.mapped import PAGE, MappedWindow, window_bytes
from audit.readers.offload_index import index_directories


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        out.append(value & 0x7F | (0x80 if value > 0x7F else 0))
        value >>= 7
        if not value:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def write_bucket(directory, bucket_id: int, values: dict[bytes, bytes]) -> None:
    """`<id>.bucket` and its `<id>.meta` as Mooncake writes them: records back to back, then the
    metadata (replaced whole, as a purge does, when the bucket is written again)."""
    records, meta, offset = b"", b"", 0
    for key, value in values.items():
        records += key + value
        meta += _field(2, key)
        places = _varint(1 << 3) + _varint(offset) if offset else b""
        meta += _field(3, places + _varint(2 << 3) + _varint(len(key)) + _varint(3 << 3) + _varint(len(value)))
        offset += len(key) + len(value)
    (directory / f"{bucket_id}.bucket").write_bytes(records)
    staged = directory / f".{bucket_id}.meta.new"
    staged.write_bytes(_varint(1 << 3) + _varint(len(records)) + meta)
    os.replace(staged, directory / f"{bucket_id}.meta")


def test_a_window_holds_each_value_where_its_file_places_it(tmp_path):
    first, second = os.urandom(3 * PAGE + 100), os.urandom(PAGE + 7)
    (tmp_path / "a").write_bytes(first)
    (tmp_path / "b").write_bytes(second)
    window = MappedWindow(window_bytes([len(first), len(second)]))
    placed = []
    for name, offset, length in (("a", 25, 2 * PAGE + 50), ("b", PAGE - 3, 10), ("a", 0, PAGE)):
        descriptor = os.open(tmp_path / name, os.O_RDONLY)
        try:
            placed.append((window.place(descriptor, offset, length), name, offset, length))
        finally:
            os.close(descriptor)
    data = {"a": first, "b": second}
    for at, name, offset, length in placed:
        assert at % PAGE == offset % PAGE  # where it lies in its page: not on a cache line
        assert window.array[at:at + length].tobytes() == data[name][offset:offset + length]
    kept = window.array[placed[0][0]:placed[0][0] + 16]
    window.clear()  # the files let go: zero pages again, and a view kept is still memory
    assert not window.array.any() and not kept.any()


def test_a_window_refuses_more_than_it_holds(tmp_path):
    (tmp_path / "a").write_bytes(bytes(3 * PAGE))
    window = MappedWindow(2 * PAGE)
    descriptor = os.open(tmp_path / "a", os.O_RDONLY)
    try:
        try:
            window.place(descriptor, 0, 3 * PAGE)
        except OSError as error:
            assert "cannot hold" in str(error)
        else:
            raise AssertionError("a value larger than the window was mapped")
    finally:
        os.close(descriptor)
    assert isinstance(window.array, np.ndarray) and window.array.nbytes == 2 * PAGE


def test_indexing_again_sees_new_and_rewritten_buckets(tmp_path):
    one, two = stored_key("default", "one"), stored_key("default", "two")
    write_bucket(tmp_path, 1, {one: b"x" * 10, two: b"y" * 20})
    first = index_directories([tmp_path])
    assert {key: (value.offset, value.size) for key, value in first.items()} == {one: (0, 10), two: (len(one) + 10, 20)}
    write_bucket(tmp_path, 2, {two: b"z" * 30})  # put again: a newer bucket
    second = index_directories([tmp_path])
    assert second[two].path.name == "2.bucket" and second[two].size == 30 and second[one] == first[one]
    write_bucket(tmp_path, 1, {two: b"y" * 20})  # a purge rewrote bucket 1's metadata without `one`
    os.utime(tmp_path / "1.meta", ns=(1, 1))  # older than bucket 2: which bucket is newest is by mtime
    third = index_directories([tmp_path])
    assert one not in third and third[two].path.name == "2.bucket"
    (tmp_path / "2.meta").unlink()  # evicted
    assert index_directories([tmp_path])[two].path.name == "1.bucket"
    for settled in (tmp_path / "1.meta", tmp_path):  # long written: indexed again from what was parsed
        os.utime(settled, ns=(1, 1))
    assert index_directories([tmp_path])[two].path.name == "1.bucket"
    assert index_directories([tmp_path]) == index_directories([tmp_path])  # the second made of the first's listing
    write_bucket(tmp_path, 3, {two: b"w" * 40})  # a new name changes the directory's mtime
    assert index_directories([tmp_path])[two].size == 40
