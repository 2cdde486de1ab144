"""`diff A B`: what changed between two snapshots (or a snapshot and a fresh snapshot of the live
cluster), key by key in key order.

B is attached to A's connection and the two `keys` tables are joined inside SQLite on their key
indexes, so only differing keys pass through Python, one at a time: memory stays bounded whatever
the number of keys. A difference is a *finding* when the key, as B has it, carries a finding
verdict (it was added bad, changed into something bad, or became bad).
"""

from __future__ import annotations

import json
import sqlite3
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from rich.console import Console
from rich.text import Text

from audit.errors import AuditError
from audit.forensics.snapshot import Snapshot, key_text, open_snapshot, read_only_uri
from audit.records import FINDINGS
from audit.report.inert import inert, printable

SCHEMA = "mooncake-audit/diff"
SCHEMA_VERSION = 1
CHANGES = ("added", "removed", "changed", "verdicts")

_SIDE = ("id", "size", "xxh3", "zero", "verdicts", "layout", "shape", "scanned_at")


def _columns(alias: str) -> str:
    return ", ".join(f"{alias}.{column}" for column in _SIDE)


_DIFFERING = f"""
SELECT a.key, {_columns('a')}, {_columns('b')}
FROM main.keys AS a LEFT JOIN other.keys AS b ON b.key = a.key
WHERE b.id IS NULL OR a.size IS NOT b.size OR a.xxh3 IS NOT b.xxh3 OR a.verdicts IS NOT b.verdicts
UNION ALL
SELECT b.key, {', '.join('NULL' for _ in _SIDE)}, {_columns('b')}
FROM other.keys AS b
WHERE NOT EXISTS (SELECT 1 FROM main.keys AS a WHERE a.key = b.key)
ORDER BY 1
"""

_REGIONS_CHANGED = """
SELECT ra.idx FROM main.region_results AS ra
JOIN other.region_results AS rb ON rb.key_id = ? AND rb.idx = ra.idx
WHERE ra.key_id = ? AND ra.xxh3_i64 != rb.xxh3_i64
ORDER BY ra.idx
"""


@dataclass(frozen=True)
class DiffResult:
    """Counts and descriptions up front; `entries()` streams the differing keys again from the two
    files (so both must still exist when the result is rendered)."""

    a_path: Path
    b_path: Path
    a: dict        # each snapshot as `_describe` tells it
    b: dict
    summary: dict  # per-change counts, findings, keys on each side, warnings, exit_code

    def entries(self) -> Iterator[dict]:
        return _entries(self.a_path, self.b_path)

    @property
    def exit_code(self) -> int:
        return self.summary["exit_code"]


def diff_snapshots(a: Path, b: Path) -> DiffResult:
    """Compare two snapshot files; a one-line AuditError when either is not a readable snapshot."""
    with open_snapshot(a) as first, open_snapshot(b) as second:
        a_side, b_side = _describe(first), _describe(second)
    counts = Counter()
    findings = 0
    for entry in _entries(Path(a), Path(b)):
        counts[entry["change"]] += 1
        findings += entry["finding"]
    warnings = _warnings(a_side, b_side)
    incomplete = any(not side["complete"] or side["sampled"] for side in (a_side, b_side))
    summary = {
        **{change: counts[change] for change in CHANGES},
        "findings": findings,
        "keys_a": a_side["keys"],
        "keys_b": b_side["keys"],
        "warnings": warnings,
        "exit_code": 1 if findings else 3 if incomplete else 0,
    }
    return DiffResult(Path(a), Path(b), a_side, b_side, summary)


def _describe(snapshot: Snapshot) -> dict:
    summary = snapshot.meta["summary"]
    return {
        "path": str(snapshot.path),
        "created_at": snapshot.meta.get("created_at"),
        "finished_at": summary.get("finished_at"),
        "tool": snapshot.meta.get("tool"),
        "cluster": snapshot.meta.get("cluster"),
        "filters": summary.get("filters"),
        "keys": snapshot.keys,
        "complete": bool(summary.get("complete")),
        "sampled": "sample" in summary,
    }


def _warnings(a: dict, b: dict) -> list[str]:
    """Why some differences may not be changes of the store."""
    warnings = []
    for label, side in (("A", a), ("B", b)):
        if not side["complete"]:
            warnings.append(f"snapshot {label} is incomplete (interrupted, or keys unread): keys it did not reach "
                            f"show as {'added' if label == 'A' else 'removed'}, keys it could not read as verdicts")
        if side["sampled"]:
            warnings.append(f"snapshot {label} read a sample of the keys: the others show as "
                            f"{'added' if label == 'A' else 'removed'}")
    if a["filters"] != b["filters"]:
        warnings.append("the snapshots were taken with different --prefix/--match: keys outside either scope "
                        "show as added or removed")
    return warnings


def _entries(a: Path, b: Path) -> Iterator[dict]:
    with open_snapshot(a) as first:
        db = first.db
        try:
            db.execute("ATTACH DATABASE ? AS other", (read_only_uri(b),))
            shapes = _comparable_shapes(_shapes(db, "main"), _shapes(db, "other"))
            for row in db.execute(_DIFFERING):
                entry = _entry(db, row, shapes)
                if entry is not None:
                    yield entry
        except sqlite3.DatabaseError as error:
            raise AuditError(f"cannot diff {a} and {b}: {error}") from None


def _shapes(db: sqlite3.Connection, schema: str) -> dict[int, list[tuple]]:
    shapes: dict[int, list[tuple]] = {}
    for shape, *geometry in db.execute(f"SELECT shape, segment, layer, region, kind, offset, length, dtype "
                                       f"FROM {schema}.shapes ORDER BY shape, idx"):
        shapes.setdefault(shape, []).append(tuple(geometry))
    return shapes


def _comparable_shapes(a: dict[int, list[tuple]], b: dict[int, list[tuple]]) -> dict[tuple[int, int], list[tuple]]:
    """(A shape, B shape) -> A's geometry, for the pairs with identical geometry: only regions of
    the same layout can be compared one by one."""
    return {(sa, sb): ga for sa, ga in a.items() for sb, gb in b.items() if ga == gb}


def _side(row: dict) -> dict | None:
    if row["id"] is None:
        return None
    return {
        "size": row["size"],
        "xxh3": row["xxh3"],
        "zero": None if row["zero"] is None else bool(row["zero"]),
        "verdicts": json.loads(row["verdicts"]),
        "layout": row["layout"],
        "scanned_at": datetime.fromtimestamp(row["scanned_at"], timezone.utc).isoformat(timespec="seconds"),
    }


def _known_and_different(x, y) -> bool:
    return x is not None and y is not None and x != y


def _change(a: dict | None, b: dict | None) -> str | None:
    if a is None:
        return "added"
    if b is None:
        return "removed"
    if _known_and_different(a["size"], b["size"]) or _known_and_different(a["xxh3"], b["xxh3"]):
        return "changed"
    if a["verdicts"] != b["verdicts"]:
        return "verdicts"
    return None  # e.g. read in one snapshot only, with the same verdicts: nothing to say


def _entry(db: sqlite3.Connection, row: tuple, shapes: dict) -> dict | None:
    width = len(_SIDE)
    a_row, b_row = dict(zip(_SIDE, row[1:1 + width])), dict(zip(_SIDE, row[1 + width:]))
    a, b = _side(a_row), _side(b_row)
    change = _change(a, b)
    if change is None:
        return None
    regions = None
    if change == "changed" and (a_row["shape"], b_row["shape"]) in shapes:
        geometry = shapes[(a_row["shape"], b_row["shape"])]
        regions = [{"segment": geometry[idx][0], "layer": geometry[idx][1], "region": geometry[idx][2]}
                   for (idx,) in db.execute(_REGIONS_CHANGED, (b_row["id"], a_row["id"]))]
    findings = sorted(v for v in b["verdicts"] if v in FINDINGS) if b else []
    return {"key": key_text(row[0]), "change": change, "a": a, "b": b, "finding": bool(findings),
            "findings": findings, "regions_changed": regions}


def diff_document(result: DiffResult) -> dict:
    """The JSON rendering (`--format json`); holds every entry in memory, as one document must."""
    return {"schema": SCHEMA, "version": SCHEMA_VERSION, "a": result.a, "b": result.b,
            "summary": result.summary, "entries": list(result.entries())}


_MARKS = {"added": "+", "removed": "-", "changed": "~", "verdicts": "!"}


def print_diff(result: DiffResult, console: Console) -> None:
    """The human rendering: a headline, both snapshots, warnings, then one line per differing key
    (streamed, so a large diff prints in bounded memory). Every stored string is printed inert."""

    def show(line: Text) -> None:
        console.print(line, soft_wrap=True, highlight=False)  # one line per entry, whatever the width

    summary = result.summary
    if summary["findings"]:
        headline = f"FINDINGS: {summary['findings']} differing key(s) with findings"
    elif any(summary[change] for change in CHANGES):
        headline = "NO FINDINGS among the differences"
    else:
        headline = "NO DIFFERENCES"
    show(Text(f"{headline}; {summary['added']} added, {summary['removed']} removed, "
              f"{summary['changed']} changed, {summary['verdicts']} with other verdicts"))
    for label, side in (("A", result.a), ("B", result.b)):
        master = (side["cluster"] or {}).get("master")
        show(Text(f"{label}: {printable(side['path'])}, taken {side['created_at']}, {side['keys']} keys, "
                  f"master {printable(str(master))}"))
    for warning in summary["warnings"]:
        show(Text(f"warning: {warning}"))
    for entry in result.entries():
        show(_line(entry))


def _verdicts(side: dict | None) -> str:
    return "-" if side is None else ",".join(side["verdicts"]) or "OK"


def _value(side: dict | None, name: str) -> str:
    return "-" if side is None or side[name] is None else str(side[name])


def _line(entry: dict) -> Text:
    a, b, change = entry["a"], entry["b"], entry["change"]
    line = Text(f"{_MARKS[change]} {change:<8} ")
    line.append_text(inert(entry["key"]))
    if change in ("added", "removed"):
        side = b if change == "added" else a
        details = f"size {_value(side, 'size')}, xxh3 {_value(side, 'xxh3')}, verdicts {_verdicts(side)}"
    else:
        details = f"verdicts {_verdicts(a)} -> {_verdicts(b)}"
        if change == "changed":
            details = (f"size {_value(a, 'size')} -> {_value(b, 'size')}, xxh3 {_value(a, 'xxh3')} -> "
                       f"{_value(b, 'xxh3')}, {details}")
        if entry["regions_changed"]:
            details += ", regions " + " ".join(f"{r['segment']}/{r['region']}" for r in entry["regions_changed"])
    line.append(f"  {printable(details, 2000)}")
    if entry["finding"]:
        line.append("  FINDING", style="bold red")
    return line
