"""`mooncake-audit crossref REPORT --block-tables PATH`: NULL_BACKED verdicts added offline to a
report written earlier, so block tables gathered after a scan need no second scan.

A report written with `--all` (or as JSONL) holds every key; a findings-only report can only be
cross-referenced for the keys it lists (the summary says which kind it was).
"""

from __future__ import annotations

import json
from pathlib import Path

from audit.blocktables import BlockTables
from audit.errors import AuditError
from audit.judge.merge import SCHEMA, merge_records
from audit.judge.key import apply_block_table
from audit.records import KeyRecord, Report, Verdict


def read_report(path: Path) -> tuple[dict, list[KeyRecord], bool]:
    """(summary, records, holds every key) of a JSON or JSONL report."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise AuditError(f"cannot read report {path}: {getattr(error, 'strerror', None) or error}") from None
    try:
        if text.lstrip().startswith('{"type"'):
            lines = [json.loads(line) for line in text.splitlines() if line.strip()]
            summary = next((line for line in lines if line.get("type") == "summary"), {})
            records = [KeyRecord.from_json(line) for line in lines if line.get("type") == "key"]
            return {k: v for k, v in summary.items() if k != "type"}, records, True
        document = json.loads(text)
        if not isinstance(document, dict) or document.get("schema") != SCHEMA:
            raise AuditError(f"{path} is not a mooncake-audit report")
        complete = "keys" in document
        records = [KeyRecord.from_json(r) for r in document["keys" if complete else "findings"]]
        return document.get("summary", {}), records, complete
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as error:
        if isinstance(error, AuditError):
            raise
        raise AuditError(f"report {path} is malformed: {error}") from None


def crossref_report(path: Path, tables: BlockTables) -> Report:
    summary, records, every_key = read_report(path)
    for record in records:
        if Verdict.NULL_BACKED in record.verdicts:
            record.verdicts.remove(Verdict.NULL_BACKED)
        record.evidence.pop("null_backed", None)
        record.evidence.pop("block_table", None)
        apply_block_table(record, tables.get(record.key))
    keep = ("tool", "started_at", "finished_at", "cluster", "filters", "read_mode", "checker", "layouts")
    context = {name: summary[name] for name in keep if name in summary}
    context["crossref"] = {"report": str(path), "report_lists_every_key": every_key}
    context["block_tables"] = tables.summary({r.key for r in records} if every_key else None)
    return merge_records(records, context=context, keys_listed=summary.get("keys_listed", len(records)),
                         keys_selected=summary.get("keys_selected"),
                         interrupted=summary.get("interrupted", False), duration_s=summary.get("duration_s", 0.0))

