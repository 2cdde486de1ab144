"""The values a holder's offload directory holds, whichever backend wrote them: the bucket
backend's `.bucket`/`.meta` pairs (`audit.readers.buckets`) and the file-per-key backend's
KVEntry files (`audit.readers.key_files`), by stored key (`tenant \\0 key`)."""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from audit.errors import AuditError
from audit.readers.buckets import StoredValue, bucket_values
from audit.readers.key_files import key_files


@dataclass(frozen=True)
class HeldDirectory(os.PathLike):
    """An offload directory given with its holder (`--offload-dir DIR=ENDPOINT`: the holder's offload
    RPC endpoint, as the master lists its disk replicas): its copies are that holder's, never learnt
    from the master (`audit.readers.disk.directory_owners`, which a directory most of whose newest keys
    were put again on another holder misleads). It reads as its path wherever a path is wanted."""

    path: Path
    holder: str

    def __fspath__(self) -> str:
        return os.fspath(self.path)

    def __str__(self) -> str:
        return str(self.path)


_ENDPOINT = re.compile(r"[^=/\s]+:\d+")


def offload_directory(given: str | os.PathLike) -> Path | HeldDirectory:
    """`--offload-dir`'s value: DIR, or DIR=ENDPOINT (a `HeldDirectory`). A value that is a directory
    as written is that directory, whatever it holds."""
    text = os.fspath(given)
    path, _, endpoint = text.rpartition("=")
    if path and _ENDPOINT.fullmatch(endpoint) and not Path(text).is_dir():
        return HeldDirectory(Path(path), endpoint)
    return Path(text)


class DirectoryHolder(NamedTuple):
    """A directory's holder (its offload RPC endpoint) and how it is known: ``given`` with the
    directory, or ``learnt`` from the master, where `naming` of the `asked` keys named it."""

    endpoint: str
    known: str
    naming: int = 0
    asked: int = 0


def given_holders(directories: Iterable[Path | HeldDirectory]) -> dict[Path, DirectoryHolder]:
    """The holder given with each directory that has one (`HeldDirectory`)."""
    return {directory.path: DirectoryHolder(directory.holder, "given")
            for directory in directories if isinstance(directory, HeldDirectory)}


def _offload_directories(directories: Iterable[Path]) -> list[Path]:
    found = list(map(Path, directories))
    for directory in found:
        if not directory.is_dir():
            raise AuditError(f"offload directory {directory} does not exist")
    return found


def _bucket_values(meta: Path, bucket: Path | None = None) -> list[StoredValue]:
    try:
        return bucket_values(meta, bucket)
    except FileNotFoundError:  # evicted from the disk meanwhile
        return []
    except (OSError, ValueError) as error:
        raise AuditError(f"cannot read offload metadata {meta}: {error}") from None


SETTLED_NS = 2_000_000_000  # a file unchanged this long before it was parsed is taken as written


class _Parsed(NamedTuple):
    stamp: tuple[int, int, int]  # inode, size, mtime
    settled: bool  # older than SETTLED_NS when parsed: known again by its inode alone, no stat
    values: list[StoredValue]


class _Listing(NamedTuple):
    stamp: tuple[int, int]  # the directory's inode and mtime, taken before it was listed
    settled: bool  # the directory and every `.meta` in it older than SETTLED_NS: listed again only once changed
    files: dict[str, _Parsed]
    found: list[tuple[int, str, list[StoredValue]]]


_listed: dict[Path, _Listing] = {}
"""Per directory, each `.meta` parsed, by name: Mooncake writes a bucket once and a purge replaces
its `.meta` whole (a new inode), so indexing a directory again (every batch's findings are
confirmed from a fresh index) parses only the files that are new, and lists a directory whose
mtime says no name in it changed not at all. A file or directory still recent when looked at
(it may still be being written) is looked at again, by its size and mtime."""


def _bucket_index(directory: Path) -> list[tuple[int, str, list[StoredValue]]]:
    """(mtime, name, values) of every `.meta` in `directory` with its `.bucket` beside it."""
    listed_at = time.time_ns()
    status = os.stat(directory)
    stamp = (status.st_ino, status.st_mtime_ns)
    before = _listed.get(directory)
    if before is not None and before.settled and before.stamp == stamp:
        return before.found
    known = before.files if before is not None else {}
    with os.scandir(directory) as listing:
        entries = {entry.name: entry for entry in listing}
    parsed: dict[str, _Parsed] = {}
    found = []
    for name, entry in entries.items():
        if not name.endswith(".meta") or name.startswith(".") or name[:-len(".meta")] + ".bucket" not in entries:
            continue
        file = known.get(name)
        if file is None or not file.settled or file.stamp[0] != entry.inode():
            now = time.time_ns()
            try:
                status = entry.stat()
            except FileNotFoundError:  # evicted from the disk meanwhile
                continue
            file_stamp = (status.st_ino, status.st_size, status.st_mtime_ns)
            values = file.values if file is not None and file.stamp == file_stamp \
                else _bucket_values(directory / name, directory / (name[:-len(".meta")] + ".bucket"))
            file = _Parsed(file_stamp, now - status.st_mtime_ns > SETTLED_NS, values)
        parsed[name] = file
        found.append((file.stamp[2], name, file.values))
    settled = listed_at - stamp[1] > SETTLED_NS and all(file.settled for file in parsed.values())
    _listed[directory] = _Listing(stamp, settled, parsed, found)  # the files gone from the disk are forgotten
    return found


class OffloadIndex(dict[bytes, StoredValue]):
    """The newest copy of each stored key in a set of offload directories (`index_directories`),
    and the older copies a newer one hides (`superseded`, oldest first): a key removed and put
    again on another holder of this host is offloaded there anew, while the first holder's bucket
    keeps its first value, which no master lists (measured: a restart of that holder registers
    nothing while the key is held elsewhere; one after the key left the store brings it back)."""

    def __init__(self, newest: dict[bytes, StoredValue], superseded: dict[bytes, list[StoredValue]],
                 directories: list[Path], given: dict[Path, DirectoryHolder] | None = None):
        super().__init__(newest)
        self.superseded = superseded
        self.directories = directories
        self.given = given or {}  # the holders given with directories (`HeldDirectory`): never learnt
        self.owners: dict[Path, DirectoryHolder] | None = None  # each directory's, once learnt (`audit.readers.disk`)
        self._directory_of_file: dict[Path, Path] = {}
        # a file's parent is its directory where it is one of them and none lies within another
        # (a bucket's, as a rule): one set look-up instead of a pathlib walk over every directory
        nested = any(a != b and b.is_relative_to(a) for a in directories for b in directories)
        self._parents = {} if nested else {os.fspath(directory): directory for directory in directories}

    def copies(self, key: bytes) -> list[StoredValue]:
        """Every copy of `key` in the directories, newest first."""
        newest = self.get(key)
        return [] if newest is None else [newest, *reversed(self.superseded.get(key, []))]

    def directory_of(self, value: StoredValue) -> Path:
        """The offload directory a copy lies in (a key file lies below its directory)."""
        directory = self._directory_of_file.get(value.path)
        if directory is None:
            directory = self._parents.get(os.path.dirname(value.path))
            if directory is None:
                directory = next((directory for directory in self.directories
                                  if value.path.is_relative_to(directory)), value.path.parent)
            self._directory_of_file[value.path] = directory
        return directory

    def afresh(self) -> OffloadIndex:
        """The same directories indexed again (buckets written and files gone since), each one's
        holder as given or learnt kept: a directory stays its holder's."""
        fresh = index_directories(self.directories)
        fresh.given, fresh.owners, fresh._directory_of_file = self.given, self.owners, self._directory_of_file
        return fresh

    def owner_of(self, value: StoredValue) -> str | None:
        """The holder of the directory a copy lies in, as learnt (`owners`); None where not known."""
        holder = (self.owners or {}).get(self.directory_of(value))
        return None if holder is None else holder.endpoint


_merged: dict[tuple[Path, ...], tuple[list, OffloadIndex]] = {}
"""The last index of each set of directories, with the listings it was made of: when every
listing is the one reused unchanged (`_bucket_index`), so is the index."""


def index_directories(directories: Iterable[Path]) -> OffloadIndex:
    """Every complete bucket's values and every key file in `directories`, by stored key
    (`stored_key`). A key that several buckets hold (removed or evicted, then put again) maps to
    the newest bucket's; the others are its `superseded` copies."""
    directories = list(directories)
    found, given = _offload_directories(directories), given_holders(directories)
    listings = [_bucket_index(directory) for directory in found]
    key_files_found = [value for directory in found for value in key_files(directory)]
    last = _merged.get(tuple(found))
    if last is not None and not key_files_found and all(now is before for now, before in zip(listings, last[0])):
        return OffloadIndex(last[1], last[1].superseded, found, given)
    rank = {directory: place for place, directory in enumerate(sorted(set(found)))}  # as their paths sort
    buckets = [(mtime, rank[directory], name, values)
               for directory, listing in zip(found, listings) for mtime, name, values in listing]
    index: dict[bytes, StoredValue] = {}
    superseded: dict[bytes, list[StoredValue]] = {}
    for value in key_files_found:
        _newest(index, superseded, value)
    for *_, values in sorted(buckets, key=lambda bucket: bucket[:3]):
        for value in values:
            _newest(index, superseded, value)
    merged = OffloadIndex(index, superseded, found)
    _merged[tuple(found)] = listings, merged
    return OffloadIndex(merged, superseded, found, given)


def _newest(index: dict[bytes, StoredValue], superseded: dict[bytes, list[StoredValue]], value: StoredValue) -> None:
    before = index.get(value.stored_key)
    if before is not None:
        superseded.setdefault(value.stored_key, []).append(before)
    index[value.stored_key] = value


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
