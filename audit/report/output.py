"""Where a report goes: stdout, or a file replaced atomically (readers never see half a report).

A path that exists and is not a regular file (`/dev/null`, a FIFO) is written in place.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import TextIO

from audit.errors import AuditError


def check_writable(path: Path | None) -> None:
    """Fail before the scan, not after it, when the report could not be written."""
    if path is None:
        return
    path = Path(path)
    directory = path.parent if str(path.parent) else Path(".")
    if not directory.is_dir():
        raise AuditError(f"cannot write {path}: no directory {directory}")
    if not os.access(directory, os.W_OK) and not (path.exists() and os.access(path, os.W_OK)):
        raise AuditError(f"cannot write {path}: {directory} is not writable")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


class ReportOutput:
    """A text stream: stdout, or a temporary file beside `path` renamed over it on `close()`."""

    def __init__(self, path: Path | str | None):
        self.path = None if path is None else Path(path)
        self._temp: str | None = None
        if self.path is None:
            self.stream: TextIO = sys.stdout
        elif self.path.exists() and not self.path.is_file():
            self.stream = open(self.path, "w", encoding="utf-8")
        else:
            check_writable(self.path)
            fd, self._temp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".partial",
                                              dir=self.path.parent)
            os.fchmod(fd, 0o666 & ~_umask())  # as an ordinary file would be, not mkstemp's 0600
            self.stream = os.fdopen(fd, "w", encoding="utf-8")

    def write(self, text: str) -> None:
        self.stream.write(text)

    def close(self) -> None:
        self.stream.flush()
        if self.path is None:
            return
        if self._temp is None:
            self.stream.close()
            return
        os.fsync(self.stream.fileno())
        self.stream.close()
        os.replace(self._temp, self.path)
        self._temp = None


class WholeReportSink:
    """A format written once, from the merged report (nothing to stream per key)."""

    def __init__(self, output: Path | None, *, include_all: bool = False):
        self.output = output
        self.include_all = include_all

    def record(self, record) -> None:
        """Nothing to write per key: everything is written by `finish`."""
