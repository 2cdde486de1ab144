"""Where a report goes: stdout, or a file replaced atomically (readers never see half a report)."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import TextIO


class ReportOutput:
    """A text stream: stdout, or a temporary file beside `path` renamed over it on `close()`."""

    def __init__(self, path: Path | None):
        self.path = path
        if path is None:
            self.stream: TextIO = sys.stdout
            self._temp = None
        else:
            directory = path.parent if str(path.parent) else Path(".")
            fd, self._temp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=directory)
            self.stream = os.fdopen(fd, "w", encoding="utf-8")

    def write(self, text: str) -> None:
        self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()

    def close(self) -> None:
        if self._temp is None:
            self.stream.flush()
            return
        self.stream.flush()
        os.fsync(self.stream.fileno())
        self.stream.close()
        os.replace(self._temp, self.path)
        self._temp = None
