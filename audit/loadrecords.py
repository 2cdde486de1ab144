"""The consumers' load records: which key each vLLM consumer loaded from Mooncake Store, when, for
which request, and whether it used the bytes.

The recorder plugin writes them beside its put records (``blocks-*.jsonl``) and manifests, one file
per process, ``loads-{host}-{pid}-{n:04d}.jsonl``, one JSON object a line and a line per key loaded:

    {"key": str, "time": float (unix s), "host": str, "pid": int,
     "request_id": str | null (the API's id), "vllm_request_id": str | null (vLLM's own, "10-b9212f4a"),
     "bytes": int (bytes asked for), "rc": int | null (Mooncake's result: bytes read, or a negative
     error code; null: the get raised)
     [, "tp_rank": int][, "tenant": str][, "refused": true, "reason": "ZERO_STATE" | "NONFINITE" |
     "NULL_BACKED" | "WEIGHTS_MISMATCH" | "PREFIX_MISMATCH" | "DENIED"][, "error": str]}

``refused``: the load guard kept the value from the request. A load *served* its request when it
read bytes (rc >= 0) and was not refused; one that did neither *failed*. Other fields are context.
`impact` (audit.forensics.impact) joins these loads with a report's flagged keys.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from audit.recordfiles import Malformed, numbered_lines, parsed_lines

LOAD_RECORD_PREFIX = "loads-"


@dataclass(slots=True)
class Load:
    """One key loaded once by one consumer process (the key is the LoadRecords mapping's)."""

    time: float
    host: str
    pid: int
    request_id: str | None       # the API's id
    vllm_request_id: str | None  # vLLM's internal id
    bytes: int
    rc: int | None               # None: the get raised
    refused: str | None = None   # the guard's reason, when it refused the value
    tp_rank: int | None = None
    tenant: str | None = None

    @property
    def served(self) -> bool:
        """The request used the bytes: they were read and the guard let them through."""
        return self.rc is not None and self.rc >= 0 and self.refused is None

    @property
    def failed(self) -> bool:
        """No bytes read (an error code, or the get raised), and not the guard's doing."""
        return (self.rc is None or self.rc < 0) and self.refused is None


@dataclass
class LoadRecords:
    loads: dict[str, list[Load]] = field(default_factory=dict)  # key -> its loads, in file order
    records: int = 0
    skipped_lines: int = 0
    files: list[str] = field(default_factory=list)

    def get(self, key: str) -> list[Load]:
        return self.loads.get(key, [])

    def __iter__(self) -> Iterator[tuple[str, Load]]:
        for key, loads in self.loads.items():
            for load in loads:
                yield key, load


def is_load_record_path(path) -> bool:
    """A load-record file by its name (``loads-*.jsonl``, rotated or not): a record directory also
    holds put records and manifests, which are not loads."""
    name = Path(path).name
    return name.startswith(LOAD_RECORD_PREFIX) and ".jsonl" in name


def load_record_files(paths: Iterable[Path]) -> list[Path]:
    """The load-record files among `paths` (files) and inside them (directories, recursively)."""
    found = []
    for path in map(Path, paths):
        if path.is_dir():
            found.extend(sorted(p for p in path.rglob("*.jsonl*") if p.is_file() and is_load_record_path(p)))
        elif is_load_record_path(path):
            found.append(path)
    return found


_MISSING = object()


def _nonnegative(value) -> bool:
    return type(value) is int and value >= 0  # `type`, not isinstance: true and false are no integers


def _text_or_null(value) -> bool:
    return value is None or type(value) is str


def _reason(record: dict) -> str:
    """Why a record breaks the schema: the first field that does (the slow path, for errors only)."""
    when, rc = record.get("time"), record.get("rc", _MISSING)
    checks = [
        (type(record.get("key")) is str, "'key' must be a string"),
        (type(when) in (int, float) and math.isfinite(when), "'time' must be a number (unix seconds)"),
        (type(record.get("host")) is str, "'host' must be a string"),
        (_nonnegative(record.get("pid")), "'pid' must be an integer >= 0"),
        (_text_or_null(record.get("request_id")), "'request_id' must be a string or null"),
        (_text_or_null(record.get("vllm_request_id")), "'vllm_request_id' must be a string or null"),
        (_nonnegative(record.get("bytes")), "'bytes' must be an integer >= 0"),
        (rc is None or type(rc) is int, "'rc' must be an integer or null"),
        (record.get("tp_rank") is None or _nonnegative(record["tp_rank"]), "'tp_rank' must be an integer >= 0"),
        (_text_or_null(record.get("tenant")), "'tenant' must be a string or null"),
        (record.get("refused") is None or type(record["refused"]) is bool, "'refused' must be true or false"),
    ]
    return next((why for ok, why in checks if not ok), "a refused load needs a 'reason' (a string)")


def _parse(record: dict, interned: dict) -> tuple[str, Load]:
    """One line's key and load. Checked in one expression (a consumer writes millions of lines);
    `_reason` says what is wrong only when something is. Hosts, request ids, reasons, tenants and
    sizes repeat from line to line: each is kept once (`interned`)."""
    get = record.get
    key, when, host, pid, api_id, vllm_id, size, rc, tp_rank, tenant, refused = (
        get("key"), get("time"), get("host"), get("pid"), get("request_id"), get("vllm_request_id"), get("bytes"),
        get("rc", _MISSING), get("tp_rank"), get("tenant"), get("refused"))
    reason = get("reason") if refused is True else None
    if not (type(key) is str and type(when) in (float, int) and math.isfinite(when) and type(host) is str
            and _nonnegative(pid) and _text_or_null(api_id) and _text_or_null(vllm_id) and _nonnegative(size)
            and (rc is None or type(rc) is int) and (tp_rank is None or _nonnegative(tp_rank))
            and _text_or_null(tenant) and (refused is None or refused is False or (type(reason) is str and reason))):
        raise Malformed(_reason(record))
    shared = interned.setdefault
    return key, Load(time=float(when), host=shared(host, host), pid=pid,
                     request_id=None if api_id is None else shared(api_id, api_id),
                     vllm_request_id=None if vllm_id is None else shared(vllm_id, vllm_id), bytes=shared(size, size),
                     rc=None if rc is None else shared(rc, rc),
                     refused=None if reason is None else shared(reason, reason), tp_rank=tp_rank,
                     tenant=None if tenant is None else shared(tenant, tenant))


def read_load_records(paths: Iterable[Path], *, lenient: bool = False) -> LoadRecords:
    """Every load of the load-record files among `paths` (directories: recursively, ``loads-*.jsonl*``).

    A malformed line is an AuditError naming file and line, or with `lenient` skipped and counted.
    """
    result = LoadRecords()
    interned: dict = {}

    def skipped() -> None:
        result.skipped_lines += 1

    for path in load_record_files(paths):
        result.files.append(str(path))
        for _, (key, load) in parsed_lines(numbered_lines(path, "load records"), path, "load records",
                                           lambda record: _parse(record, interned), lenient=lenient, skipped=skipped):
            result.records += 1
            result.loads.setdefault(key, []).append(load)
    return result
