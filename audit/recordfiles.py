"""Reading the recorder's JSON-lines files: whole, or the lines appended since the last look.

A file is one JSON object a line (put records, load records, refusals). Read whole, a line that is
not one, or that its reader's `parse` refuses (`Malformed`), is an error naming file and line, or
with `lenient` skipped and counted.

Record files are appended to by other processes while they are read (`watch` tails the put records;
the load guard reads other processes' refusals and puts), and rotated. `AppendedLines` keeps one
cursor per file (its inode and the offset read to): a line still being written waits for its
newline; a file that shrank or was replaced (another inode: truncated, rotated onto the same name) is
read again from its start; a new file from its start.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from audit.errors import AuditError

T = TypeVar("T")


class Malformed(ValueError):
    """A line that breaks its file's schema; becomes a file:line error (or a skipped line)."""


def numbered_lines(path: Path, what: str) -> Iterator[tuple[int, str]]:
    """(line number, line) of a UTF-8 file; `what` names the file in an error ("block table")."""
    try:
        handle = open(path, encoding="utf-8", errors="strict")
    except OSError as error:
        raise AuditError(f"cannot read {what} {path}: {error.strerror}") from None
    with handle:
        try:
            yield from enumerate(handle, 1)
        except UnicodeDecodeError:
            raise AuditError(f"{what} {path}: not UTF-8 text") from None


def parsed_lines(lines: Iterable[tuple[int, str]], path: Path, what: str, parse: Callable[[dict], T], *,
                 lenient: bool, skipped: Callable[[], None]) -> Iterator[tuple[int, T]]:
    """(line number, `parse` of its JSON object) per line, blank lines passed over; a line that is no
    JSON object, or that `parse` raises `Malformed` for, is an AuditError, or with `lenient` `skipped()`."""
    for number, line in lines:
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record, dict):
                raise Malformed("a line must hold a JSON object")
            parsed = parse(record)
        except (json.JSONDecodeError, Malformed) as error:
            if lenient:
                skipped()
                continue
            reason = error.msg if isinstance(error, json.JSONDecodeError) else str(error)
            raise AuditError(f"{what} {path}:{number}: {reason}") from None
        yield number, parsed


@dataclass(frozen=True, slots=True)
class Appended:
    """What one file gained: its whole new lines (bytes, newline included), and the number of the
    line before the first of them (0: they start the file)."""

    path: Path
    data: bytes
    lines_before: int


class AppendedLines:
    """Cursors over record files; `read(paths)` gives each file's whole lines appended since the last
    `read` that saw it. A file no longer among `paths` loses its cursor."""

    def __init__(self):
        self._cursors: dict[Path, tuple[int, int, int]] = {}  # path: (inode, byte offset, lines read)
        self.bytes_read = 0

    def read(self, paths: Iterable[Path], *, skip_unreadable: bool = False) -> list[Appended]:
        """A file that cannot be read raises its `OSError`, or with `skip_unreadable` is passed over
        (rotated away meanwhile: its lines were read before or are gone)."""
        appended: list[Appended] = []
        present: set[Path] = set()
        for path in paths:
            try:
                stat = path.stat()
            except OSError:
                continue  # removed between the listing of the directory and now
            present.add(path)
            inode, offset, number = self._cursors.get(path, (stat.st_ino, 0, 0))
            if inode != stat.st_ino or stat.st_size < offset:
                inode, offset, number = stat.st_ino, 0, 0  # truncated or replaced: read it again
            if stat.st_size > offset:
                try:
                    with open(path, "rb") as handle:
                        handle.seek(offset)
                        data = handle.read()
                except OSError:
                    if skip_unreadable:
                        continue
                    raise
                end = data.rfind(b"\n") + 1
                if end:
                    appended.append(Appended(path, data[:end], number))
                    offset += end
                    number += data.count(b"\n", 0, end)
                    self.bytes_read += end
            self._cursors[path] = (inode, offset, number)
        for path in set(self._cursors) - present:
            del self._cursors[path]
        return appended
