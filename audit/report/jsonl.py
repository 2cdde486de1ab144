"""`--format jsonl`: one line per key as it is checked, then shared-content groups, expected
duplicate groups and a summary.

Cross-key verdicts (SHARED_CONTENT) are known only at the end: the `shared_group` lines carry them.
"""

from __future__ import annotations

import json
from pathlib import Path

from audit.judge.merge import SCHEMA, SCHEMA_VERSION
from audit.records import KeyRecord, Report
from audit.report.output import ReportOutput


class JsonlSink:
    def __init__(self, output: Path | None, *, include_all: bool = False):
        self.out = ReportOutput(output)
        self._line({"type": "header", "schema": SCHEMA + "-jsonl", "version": SCHEMA_VERSION})

    def _line(self, document: dict) -> None:
        self.out.write(json.dumps(document) + "\n")

    def record(self, record: KeyRecord) -> None:
        self._line({"type": "key", **record.to_json()})

    def finish(self, report: Report) -> None:
        for group in report.shared_groups:
            self._line({"type": "shared_group", **group})
        for group in report.expected_duplicates:
            self._line({"type": "expected_duplicate", **group})
        self._line({"type": "summary", **report.summary})
        self.out.close()
