"""The recorder's JSONL files: one per process and kind, append-only, every batch written through,
rotated by size.

Put records (``blocks-*``): one record per published key, in the per-key block-table shape that `audit.blocktables` reads:
``{"key", "block_ids", "rc", "time", "pid", "segments"[, "tp_rank"][, "tenant"]}`` (``tenant`` when the
client joined one other than Mooncake's default), plus ``"offsets"``, ``"sizes"`` and ``"note"`` when
the block ids could not be derived (``"block_ids": null``), and ``"withheld": true, "reason":
"NULL_BLOCK_ID"`` (or ``"WEIGHTS_MISMATCH"``, ``"PREFIX_MISMATCH"``: `audit.recorder.binding`) for keys the guard
kept out of the store.

Load records (``loads-*``): one record per key a consumer loaded, in the shape `audit.loadrecords`
reads: ``{"key", "time", "host", "pid", "request_id", "vllm_request_id", "bytes", "rc"[, "tp_rank"]
[, "tenant"]}``, plus ``"refused": true, "reason"`` for values the load guard kept from the model.
Deny records (``denied-*``): ``{"key", "time", "reason"}``, one per key the load guard refused,
read back by every process sharing the directory (`audit.recorder.deny`).
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import threading
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path

from audit.blocktables import DEFAULT_TENANT
from audit.recorder.blocks import KeyBlocks

logger = logging.getLogger("vllm.mooncake_audit")  # under "vllm" so vLLM's log configuration prints it

NULL_BLOCK_REASON = "NULL_BLOCK_ID"
DEFAULT_MAX_BYTES = 64 << 20

_TP_RANK = re.compile(r"@tp_rank:(\d+)@")
_ENCODER = json.JSONEncoder(separators=(",", ":"))  # built once: json.dumps(separators=...) builds one per call


def key_lines(keys: Sequence[str], blocks: Sequence[KeyBlocks], results: Sequence[int | None],
              sizes: Sequence[Sequence[int]], withheld: Mapping[int, str], now: float, pid: int,
              error: str | None = None, tenant: str = DEFAULT_TENANT) -> list[str]:
    """The JSON lines of one put: key i was published with result ``results[i]`` (None: the put raised).

    The fields every record has are formatted directly (a list of ints prints as JSON), about
    twice as fast as encoding a dict per key; the rare ones go through the JSON encoder.
    """
    common = f',"time":{now!r},"pid":{pid}'
    if tenant != DEFAULT_TENANT:
        common += f',"tenant":{_ENCODER.encode(tenant)}'
    lines = []
    for index, (key, key_blocks, rc) in enumerate(zip(keys, blocks, results)):
        block_ids = "null" if key_blocks.block_ids is None else str(key_blocks.block_ids).replace(" ", "")
        line = (f'{{"key":{_ENCODER.encode(key)},"block_ids":{block_ids},"rc":{"null" if rc is None else int(rc)}'
                f'{common},"segments":{key_blocks.segments}')
        if match := _TP_RANK.search(key):
            line += f',"tp_rank":{int(match.group(1))}'
        rare: dict = {}
        if key_blocks.block_ids is None:
            rare.update(offsets=key_blocks.offsets, sizes=list(sizes[index]), note=key_blocks.note)
        if index in withheld:
            rare.update(withheld=True, reason=withheld[index])
        if error is not None:
            rare["error"] = error
        lines.append(f"{line},{_ENCODER.encode(rare)[1:]}" if rare else line + "}")
    return lines


def load_lines(keys: Sequence[str], sizes: Sequence[int], results: Sequence[int | None],
               refused: dict[int, str], request: tuple[str | None, str | None], now: float, pid: int, host: str,
               error: str | None = None, tenant: str = DEFAULT_TENANT) -> list[str]:
    """The JSON lines of one load: key i, ``sizes[i]`` bytes asked for, result ``results[i]``
    (None: the get raised), refused by the guard for ``refused[i]`` where present; `request` is
    (the API's request id, vLLM's internal one), either None when the load is not a request's."""
    api_id, vllm_id = request
    common = (f',"time":{now!r},"host":{_ENCODER.encode(host)},"pid":{pid},'
              f'"request_id":{_ENCODER.encode(api_id)},"vllm_request_id":{_ENCODER.encode(vllm_id)}')
    if tenant != DEFAULT_TENANT:
        common += f',"tenant":{_ENCODER.encode(tenant)}'
    lines = []
    for index, (key, size, rc) in enumerate(zip(keys, sizes, results)):
        line = f'{{"key":{_ENCODER.encode(key)}{common},"bytes":{int(size)},"rc":{"null" if rc is None else int(rc)}'
        if match := _TP_RANK.search(key):
            line += f',"tp_rank":{int(match.group(1))}'
        if index in refused:
            line += f',"refused":true,"reason":{_ENCODER.encode(refused[index])}'
        if error is not None:
            line += f',"error":{_ENCODER.encode(error)}'
        lines.append(line + "}")
    return lines


class RecordWriter:
    """Appends records to this process's own files in `directory`.

    Files are named ``{stem}-{host}-{pid}-{n}.jsonl`` (stem ``blocks``, ``loads`` or ``denied``: a
    shared directory can collect several hosts; concurrent workers never interleave) and created
    exclusively, so a restarted process that reuses a pid starts a new file. Each batch is one unbuffered append: whole lines reach the OS before the
    put returns, and a crash loses nothing already written. A file that would grow past `max_bytes`
    is closed and the next one started; with `keep_files` only that many of this process's newest
    files are kept. The first file is opened on the first write, so processes that never publish
    leave nothing behind. Write errors never reach the put: they are logged once and counted.
    """

    def __init__(self, directory: Path, max_bytes: int = DEFAULT_MAX_BYTES, keep_files: int = 0,
                 stem: str = "blocks"):
        self.directory = Path(directory)
        self.stem = stem
        self.max_bytes = max_bytes
        self.keep_files = keep_files
        self.lost_records = 0
        self._reset()
        _live_writers.add(self)

    def _reset(self) -> None:
        """No file yet: at creation, and in a forked child, which must not write to its parent's files."""
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._size = 0
        self._sequence = 0
        self._paths: list[Path] = []

    @property
    def paths(self) -> list[Path]:
        """The files this process wrote, oldest first (pruned ones excluded)."""
        return list(self._paths)

    def write(self, lines: list[str]) -> None:
        """Append `lines` (JSON objects, no newline) in one write."""
        if not lines:
            return
        data = ("\n".join(lines) + "\n").encode()
        with self._lock:
            try:
                if self._fd is None or (self._size and self._size + len(data) > self.max_bytes):
                    self._open_next()
                view = memoryview(data)
                while view:
                    view = view[os.write(self._fd, view):]
                self._size += len(data)
            except OSError as error:
                if not self.lost_records:
                    logger.warning("mooncake-audit: cannot write block records to %s (%s); "
                                   "further losses are only counted", self.directory, error.strerror)
                self.lost_records += len(lines)

    def _open_next(self) -> None:
        self.close()
        self.directory.mkdir(parents=True, exist_ok=True)
        stem = f"{self.stem}-{socket.gethostname()}-{os.getpid()}"
        while self._fd is None:  # the first name no earlier process left behind
            path = self.directory / f"{stem}-{self._sequence:04d}.jsonl"
            self._sequence += 1
            try:
                self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
            except FileExistsError:
                continue  # left by an earlier process with this pid: the next sequence number
        self._size = 0
        self._paths.append(path)
        while self.keep_files and len(self._paths) > self.keep_files:
            self._paths.pop(0).unlink(missing_ok=True)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


_live_writers: weakref.WeakSet[RecordWriter] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for writer in list(_live_writers):
        writer.close()  # the child's copy of the descriptor only: the parent keeps writing its file
        writer._reset()


os.register_at_fork(after_in_child=_after_fork_in_child)
