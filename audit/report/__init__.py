"""Report formats, one module each, behind one small interface (`Sink`):

`start(context)` before the first key, `record(record)` as each key is checked (streaming
formats write here), `finish(report)` with the merged report.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from audit.records import KeyRecord, Report


class Sink(Protocol):
    def record(self, record: KeyRecord) -> None: ...

    def finish(self, report: Report) -> None: ...


FORMATS = ("human", "json", "jsonl")


def make_sink(fmt: str, output: Path | None, *, include_all: bool = False) -> Sink:
    from audit.report.output import check_writable

    check_writable(output)
    if fmt == "human":  # rich only for the human report
        from audit.report.human import HumanSink as sink
    elif fmt == "json":
        from audit.report.json_report import JsonSink as sink
    elif fmt == "jsonl":
        from audit.report.jsonl import JsonlSink as sink
    else:
        raise KeyError(fmt)
    return sink(output, include_all=include_all)
