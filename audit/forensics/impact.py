"""`mooncake-audit impact REPORT --block-tables DIR`: which requests were served a flagged key.

The join of a scan report's flagged keys with the consumers' load records (audit.loadrecords): a
key is flagged when its record has a finding (`KeyRecord.is_finding`), or when the producer's put
records in the same directory map it to vLLM's NULL block (`NULL_BACKED`, applied as `crossref` does,
so a report scanned without block tables gets them too; a null-backed key the report does not list is
flagged as well: the store may have lost it since, the consumers may not). A load *served* its
request when it read bytes and the load guard did not refuse them; a refused load is listed, but
the guard kept it from the request.

Requests are counted by the API's `request_id`, else by vLLM's own id (mapped to the API's where any
load of the same request carried both). Keys loaded that the report does not hold (`loaded_gone`)
mean something only when the report holds every key (written with `--all`, or JSONL).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from audit.blocktables import BlockTables, read_block_tables
from audit.judge.crossref import read_report
from audit.judge.key import apply_block_table
from audit.loadrecords import Load, LoadRecords, is_load_record_path, read_load_records
from audit.records import KeyRecord, Verdict

IMPACT_SCHEMA = "mooncake-audit/impact"
IMPACT_VERSION = 1


def iso_time(unix: float | None) -> str | None:
    return None if unix is None else datetime.fromtimestamp(unix, timezone.utc).isoformat(timespec="milliseconds")


def hour_of(unix: float) -> str:
    return datetime.fromtimestamp(unix, timezone.utc).strftime("%Y-%m-%dT%H:00Z")


@dataclass
class Impact:
    """The result: the document `--format json` writes (`to_json`), and each flagged key's loads in
    time (`timeline`: key -> [(unix time, served)], for the HTML page's picture)."""

    summary: dict
    affected: list[dict]
    requests: list[dict]
    loaded_gone: list[dict]
    by_host: dict[str, int]
    by_hour: dict[str, int]
    timeline: dict[str, list[tuple[float, bool]]] = field(default_factory=dict)

    @property
    def exit_code(self) -> int:
        return self.summary["exit_code"]

    def to_json(self) -> dict:
        return {"schema": IMPACT_SCHEMA, "version": IMPACT_VERSION, "summary": self.summary,
                "affected": self.affected, "requests": self.requests, "loaded_gone": self.loaded_gone,
                "by_host": self.by_host, "by_hour": self.by_hour}


@dataclass(slots=True)
class _Request:
    request_id: str | None
    vllm_request_ids: set[str] = field(default_factory=set)
    hosts: set[str] = field(default_factory=set)
    keys: set[str] = field(default_factory=set)
    first: float = float("inf")
    last: float = float("-inf")

    def add(self, key: str, load: Load) -> None:
        if load.vllm_request_id is not None:
            self.vllm_request_ids.add(load.vllm_request_id)
        self.hosts.add(load.host)
        self.keys.add(key)
        self.first, self.last = min(self.first, load.time), max(self.last, load.time)


def _flagged(records: Iterable[KeyRecord], tables: BlockTables | None) -> tuple[dict[str, KeyRecord], set[str], int]:
    """(flagged key -> its record, the report's keys, keys the block tables made NULL_BACKED).
    Keys the tables map to the null block and the report lacks get a record of their own
    (`NULL_BACKED` alone, no bytes known)."""
    flagged: dict[str, KeyRecord] = {}
    in_report: set[str] = set()
    added = 0
    for record in records:
        in_report.add(record.key)
        if tables is not None and Verdict.NULL_BACKED not in record.verdicts:
            apply_block_table(record, tables.get(record.key))
            added += Verdict.NULL_BACKED in record.verdicts
        if record.is_finding:
            flagged[record.key] = record
    for key, entry in (tables.entries.items() if tables is not None else ()):
        if entry.null_backed and key not in in_report:
            record = KeyRecord(key=key, size=None, fields=None)
            apply_block_table(record, entry)
            flagged[key] = record
            added += 1
    return flagged, in_report, added


class _RequestNames:
    """The name a load's request is counted by: the API's id; else vLLM's, mapped to the API's where
    some load of the same request carried both; None for a load naming neither."""

    def __init__(self, loads: LoadRecords):
        self.api_ids: dict[str, str] = {}  # vLLM's id -> the API's
        for _, load in loads:
            if load.request_id is not None and load.vllm_request_id is not None:
                self.api_ids.setdefault(load.vllm_request_id, load.request_id)

    def __call__(self, load: Load) -> tuple[str, str | None] | None:
        """(the name, the API's id where known)."""
        if load.request_id is not None:
            return load.request_id, load.request_id
        if load.vllm_request_id is None:
            return None
        api_id = self.api_ids.get(load.vllm_request_id)
        return (api_id, api_id) if api_id is not None else (load.vllm_request_id, None)

    def names(self, loads: Iterable[Load]) -> list[str]:
        return sorted({named[0] for load in loads if (named := self(load)) is not None})


def _affected_row(key: str, record: KeyRecord, key_loads: list[Load], in_report: bool,
                  name_of: _RequestNames) -> dict:
    """One flagged key that was served or refused: what its loads were, and whose."""
    served = [load for load in key_loads if load.served]
    refused = [load for load in key_loads if load.refused is not None]
    times = [load.time for load in served + refused]
    return {
        "key": key, "verdicts": list(record.verdicts),
        "severity": None if record.severity is None else str(record.severity), "in_report": in_report,
        "loads": len(served), "refused": len(refused),
        "refused_reasons": dict(sorted(Counter(load.refused for load in refused).items())),
        "failed": sum(1 for load in key_loads if load.failed),
        "requests": len(name_of.names(served)),
        "request_ids": sorted({load.request_id for load in served if load.request_id is not None}),
        "vllm_request_ids": sorted({load.vllm_request_id for load in served if load.vllm_request_id is not None}),
        "refused_requests": name_of.names(refused),
        "hosts": sorted({load.host for load in served + refused}),
        "first_load": iso_time(min(times)), "last_load": iso_time(max(times)),
        "first_load_unix": min(times), "last_load_unix": max(times),
    }


def _loaded_gone(loads: LoadRecords, in_report: set[str], flagged: dict[str, KeyRecord]) -> list[dict]:
    """Keys loaded that the report does not hold, the latest load first."""
    rows = []
    for key, key_loads in loads.loads.items():
        if key not in in_report:
            last = max(load.time for load in key_loads)
            rows.append({"key": key, "loads": len(key_loads), "served": sum(1 for load in key_loads if load.served),
                         "flagged": key in flagged, "last_load": iso_time(last), "last_load_unix": last})
    return sorted(rows, key=lambda row: (-row["last_load_unix"], row["key"]))


def assess_impact(records: Iterable[KeyRecord], loads: LoadRecords, *, tables: BlockTables | None = None,
                  report_complete: bool = False, context: dict | None = None) -> Impact:
    """Join a report's records with the load records (a pure function: nothing is read here).

    `tables`: the producer's put records, for NULL_BACKED; `report_complete`: the records are every
    key the store held (then a loaded key missing from them is `loaded_gone`); `context` goes into
    the summary as it is.
    """
    flagged, in_report, added = _flagged(records, tables)
    name_of = _RequestNames(loads)
    requests: dict[str, _Request] = {}
    by_host: dict[str, set[str]] = defaultdict(set)
    by_hour: dict[str, set[str]] = defaultdict(set)
    affected, timeline = [], {}
    counts = Counter()
    for key, record in flagged.items():
        key_loads = loads.get(key)
        counts["loads_of_flagged"] += len(key_loads)
        shown = [load for load in key_loads if load.served or load.refused is not None]
        if not shown:
            continue  # never loaded, or every load failed: no request got its bytes
        for load in shown:
            if load.refused is not None:
                counts["refused_loads_of_flagged"] += 1
                continue
            counts["served_loads_of_flagged"] += 1
            named = name_of(load)
            if named is None:
                counts["served_without_request_id"] += 1
                continue
            if named[0] not in requests:
                requests[named[0]] = _Request(named[1])
            requests[named[0]].add(key, load)
            by_host[load.host].add(named[0])
            by_hour[hour_of(load.time)].add(named[0])
        affected.append(_affected_row(key, record, key_loads, key in in_report, name_of))
        timeline[key] = sorted((load.time, load.served) for load in shown)
    affected.sort(key=lambda row: (row["first_load_unix"], row["key"]))
    loaded_gone = _loaded_gone(loads, in_report, flagged) if report_complete else []

    all_times = [load.time for _, load in loads]
    summary = {
        **(context or {}),
        "report_complete": report_complete,
        "requests_affected": len(requests),
        "served_without_request_id": counts["served_without_request_id"],
        "flagged_keys": len(flagged),
        "flagged_keys_loaded": len(affected),
        "flagged_keys_served": sum(1 for row in affected if row["loads"]),
        "null_backed_from_block_tables": added,
        "loads_of_flagged": counts["loads_of_flagged"],
        "served_loads_of_flagged": counts["served_loads_of_flagged"],
        "refused_loads_of_flagged": counts["refused_loads_of_flagged"],
        "refused_loads": sum(1 for _, load in loads if load.refused is not None),
        "failed_loads": sum(1 for _, load in loads if load.failed),
        "load_records": loads.records,
        "keys_loaded": len(loads.loads),
        "files": list(loads.files),
        "skipped_lines": loads.skipped_lines,
        "first_load": iso_time(min(all_times, default=None)),
        "last_load": iso_time(max(all_times, default=None)),
        "loaded_gone": len(loaded_gone) if report_complete else None,
        "exit_code": 1 if counts["served_loads_of_flagged"] else 0,
    }
    request_rows = [{"request": name, "request_id": request.request_id,
                     "vllm_request_ids": sorted(request.vllm_request_ids), "hosts": sorted(request.hosts),
                     "keys": len(request.keys), "first_load": iso_time(request.first),
                     "last_load": iso_time(request.last)}
                    for name, request in sorted(requests.items(), key=lambda item: (item[1].first, item[0]))]
    return Impact(summary=summary, affected=affected, requests=request_rows, loaded_gone=loaded_gone,
                  by_host={host: len(names) for host, names in sorted(by_host.items())},
                  by_hour={hour: len(names) for hour, names in sorted(by_hour.items())}, timeline=timeline)


def _put_record_paths(paths: Iterable[Path]) -> list[Path]:
    """What `read_block_tables` reads of `paths`: directories (it passes over the load records and
    manifests in them) and the files that are not load records."""
    return [path for path in map(Path, paths) if path.is_dir() or not is_load_record_path(path)]


def impact_of_report(report: Path, record_dirs: Iterable[Path], *, lenient: bool = False) -> Impact:
    """Read the report, the put records and the load records, and join them (AuditError, one line,
    for anything unreadable or malformed)."""
    record_dirs = [Path(path) for path in record_dirs]
    summary, records, complete = read_report(report)
    tables = read_block_tables(_put_record_paths(record_dirs), lenient=lenient)
    loads = read_load_records(record_dirs, lenient=lenient)
    context = {"report": {"path": str(report), "finished_at": summary.get("finished_at"),
                          "keys": len(records), "findings": summary.get("findings")},
               "block_tables": tables.summary({record.key for record in records} if complete else None)}
    return assess_impact(records, loads, tables=tables, report_complete=complete, context=context)
