"""`--format json`: one versioned document (schema in docs/report-schema.md)."""

from __future__ import annotations

import json

from audit.judge.merge import SCHEMA, SCHEMA_VERSION
from audit.records import Report
from audit.report.output import ReportOutput, WholeReportSink


def report_document(report: Report) -> dict:
    """The document without its `keys` (--all streams them in after)."""
    return {
        "schema": SCHEMA,
        "version": SCHEMA_VERSION,
        "summary": report.summary,
        "findings": [record.to_json() for record in report.findings],
        "shared_groups": report.shared_groups,
        "expected_duplicates": report.expected_duplicates,
    }


KEYS_PER_WRITE = 4096  # --all: keys encoded and written this many at a time, never the whole list


class JsonSink(WholeReportSink):
    def finish(self, report: Report) -> None:
        out = ReportOutput(self.output)
        # One compact document from the C encoder: with `indent`, json falls back to its Python
        # encoder, which cost a mamba-130m scan of 1,200 keys a second (57,000 small writes). `jq .`
        # indents. With --all the keys are streamed into it: a million keys are never one string.
        head = json.dumps(report_document(report))
        if not self.include_all:
            out.write(head + "\n")
        else:
            out.write(head[:-1] + ', "keys": [')
            batch: list[str] = []
            first = True
            for record in report.records:
                batch.append(json.dumps(record.to_json()))
                if len(batch) >= KEYS_PER_WRITE:
                    out.write(("" if first else ", ") + ", ".join(batch))
                    batch, first = [], False
            if batch:
                out.write(("" if first else ", ") + ", ".join(batch))
            out.write("]}\n")
        out.close()
