"""Snapshots and diffs on a real cluster: exact key names, digests of the bytes put, regions, then
what a diff says after keys are removed, added and re-put with other bytes."""

from __future__ import annotations

import io
import json
import os
import sqlite3

import numpy as np
import pytest
import xxhash
from rich.console import Console

from audit.errors import AuditError
from audit.forensics.diff import diff_document, diff_snapshots, print_diff
from audit.forensics.snapshot import SCHEMA, SnapshotSink, open_snapshot
from audit.keys import vllm_key
from audit.layouts import layouts_from_hf_config
from audit.run.orchestrator import ScanOptions, run_scan
from audit.judge.plan import CheckPlan
from audit.records import KeyRecord, Report

TINY_MAMBA = {"model_type": "mamba", "hidden_size": 32, "intermediate_size": 64, "state_size": 4,
              "conv_kernel": 4, "num_hidden_layers": 3}
LAYOUT = layouts_from_hf_config(TINY_MAMBA, model="tiny-mamba")[0]  # 3 layers x (conv, ssm): 6 regions
LAYER1_SSM = next(region for segment, region in LAYOUT.regions() if segment.layer == 1 and region.name == "ssm")


def _state(rng: np.random.Generator, nbytes: int) -> bytes:
    """Every byte range non-zero and finite: bf16 numbers of small magnitude."""
    numbers = (rng.standard_normal(nbytes // 2) * 0.05).astype(np.float32)
    return (numbers.view(np.uint32) >> 16).astype(np.uint16).tobytes()


def _snapshot(settings, namespace: str, path):
    plan = CheckPlan(layouts=[LAYOUT], keep_regions=True)
    with SnapshotSink(path) as sink:
        return run_scan(settings, ScanOptions(prefix=namespace.rstrip("/"), plan=plan), sink)


def _state_key(namespace: str, name: str) -> str:
    return vllm_key("tiny-mamba", name.encode().hex(), cache_prefix=namespace.rstrip("/"))


def _rows(path) -> dict[str, dict]:
    db = sqlite3.connect(path)
    db.row_factory = sqlite3.Row
    rows = {row["key"].decode(): dict(row) for row in db.execute("SELECT * FROM keys")}
    for row in rows.values():
        row["regions"] = [dict(r) for r in db.execute("SELECT * FROM regions WHERE key = ? ORDER BY idx",
                                                      (row["key"],))]
    db.close()
    return rows


@pytest.fixture
def store(publisher, namespace):
    """Values put into the namespace, by role; the same bytes under the two `shared` keys."""
    rng = np.random.default_rng(7)
    shared = _state(rng, 3000)
    values = {
        _state_key(namespace, "good"): _state(rng, LAYOUT.size),
        _state_key(namespace, "to-zero"): _state(rng, LAYOUT.size),
        _state_key(namespace, "to-edit"): _state(rng, LAYOUT.size),
        namespace + "line\nbreak": _state(rng, 1000),
        namespace + "'; DROP TABLE keys; --": _state(rng, 2000),
        namespace + "shared-a": shared,
        namespace + "shared-b": shared,
    }
    for key, value in values.items():
        publisher.put(key, value)
    return values


def _replace(publisher, key: str, value: bytes) -> None:
    """Mooncake never overwrites a key through put: remove it (forced: the scan's reads hold a lease), put again."""
    assert publisher.store.remove(key, force=True) == 0
    publisher.put(key, value)


def test_snapshot_rows_then_diff_after_changes(settings, publisher, namespace, store, tmp_path):
    first = tmp_path / "a.db"
    report = _snapshot(settings, namespace, first)
    assert report.summary["keys_scanned"] == len(store)
    assert sorted(os.listdir(tmp_path)) == ["a.db"]  # the temporary file was renamed, none left behind

    rows = _rows(first)
    assert set(rows) == set(store)
    for key, value in store.items():
        assert rows[key]["xxh3"] == xxhash.xxh3_64_hexdigest(value) and rows[key]["size"] == len(value)
    good = rows[_state_key(namespace, "good")]
    assert len(good["regions"]) == 6 and good["layout"] == "tiny-mamba/group:0/mamba1/tp1"
    value = store[_state_key(namespace, "good")]
    assert [r["xxh3"] for r in good["regions"]] == [
        xxhash.xxh3_64_hexdigest(value[region.offset:][:region.length]) for _, region in LAYOUT.regions()]
    assert json.loads(good["fields"])["model"] == "tiny-mamba" and json.loads(good["verdicts"]) == []
    assert rows[namespace + "line\nbreak"]["regions"] == [] and rows[namespace + "line\nbreak"]["shape"] is None
    assert {key for key, row in rows.items() if "SHARED_CONTENT" in row["verdicts"]} == {
        namespace + "shared-a", namespace + "shared-b"}
    with open_snapshot(first) as snapshot:
        assert snapshot.meta["schema"] == SCHEMA and snapshot.meta["version"] == 1 and snapshot.keys == len(store)
        assert snapshot.meta["summary"]["verdicts"] == {"SHARED_CONTENT": 2}
        assert snapshot.db.execute("SELECT keys FROM shared_groups").fetchall() == [(2,)]

    zero_key, edit_key = _state_key(namespace, "to-zero"), _state_key(namespace, "to-edit")
    edited = bytearray(store[edit_key])
    edited[LAYER1_SSM.offset] ^= 1  # the low mantissa bits of one bf16 number
    _replace(publisher, zero_key, bytes(LAYOUT.size))
    _replace(publisher, edit_key, bytes(edited))
    removed = namespace + "'; DROP TABLE keys; --"
    assert publisher.store.remove(removed, force=True) == 0
    added_zero, added_good = namespace + "added\n[red]zero[/red]", _state_key(namespace, "added")
    publisher.put(added_zero, bytes(4096))
    publisher.put(added_good, _state(np.random.default_rng(8), LAYOUT.size))
    second = tmp_path / "b.db"
    _snapshot(settings, namespace, second)

    result = diff_snapshots(first, second)
    entries = list(result.entries())
    by_change = {change: {e["key"] for e in entries if e["change"] == change}
                 for change in ("added", "removed", "changed", "verdicts")}
    assert by_change == {"added": {added_zero, added_good}, "removed": {removed}, "changed": {zero_key, edit_key},
                         "verdicts": set()}
    assert [e["key"] for e in entries] == sorted(e["key"] for e in entries)
    found = {e["key"]: e["findings"] for e in entries if e["finding"]}
    assert found == {zero_key: ["ZERO_STATE"], added_zero: ["ZERO_VALUE"]}
    by_key = {e["key"]: e for e in entries}
    assert by_key[edit_key]["regions_changed"] == [{"segment": "layers.1", "layer": 1, "region": "ssm"}]
    assert len(by_key[zero_key]["regions_changed"]) == 6 and by_key[zero_key]["a"]["verdicts"] == []
    assert by_key[added_good]["regions_changed"] is None and by_key[removed]["b"] is None
    assert result.summary == {"added": 2, "removed": 1, "changed": 2, "verdicts": 0, "findings": 2,
                              "keys_a": 7, "keys_b": 8, "warnings": [], "exit_code": 1}

    document = json.loads(json.dumps(diff_document(result)))
    assert document["schema"] == "mooncake-audit/diff" and document["version"] == 1
    assert document["a"]["path"] == str(first) and len(document["entries"]) == 5

    out = io.StringIO()
    print_diff(result, Console(file=out, width=80, force_terminal=False))
    text = out.getvalue()
    assert text.startswith("FINDINGS: 2 differing key(s) with findings")
    assert "added\\n[red]zero[/red]" in text and "regions layers.1/ssm" in text
    assert len(text.splitlines()) == 3 + len(entries)  # headline, A, B, one line per entry

    same = diff_snapshots(second, second)
    assert same.exit_code == 0 and list(same.entries()) == []
    out = io.StringIO()
    print_diff(same, Console(file=out, width=400, force_terminal=False))
    assert out.getvalue().startswith("NO DIFFERENCES")


def _synthetic(count: int, regions_every: int):
    """Records shaped like a scan's, generated lazily (so only the sink's memory is measured)."""
    geometry = [{"segment": s.name, "layer": s.layer, "region": r.name, "kind": r.kind, "offset": r.offset,
                 "length": r.length, "dtype": r.dtype} for s, r in LAYOUT.regions()]
    for i in range(count):
        regions = None
        if i % regions_every == 0:
            regions = [{**g, "xxh3": f"{((i * 48 + j) * 0x9E3779B97F4A7C15) % 2**64:016x}", "zero": False,
                        "nan": 0, "inf": 0}
                       for j, g in enumerate(geometry)]
        yield KeyRecord(key=vllm_key("tiny-mamba", f"{i:032x}"), size=LAYOUT.size, fields=None,
                        xxh3=(i * 0x9E3779B97F4A7C15) & (2**64 - 1), zero=False, layout="tiny-mamba/group:0/mamba1/tp1",
                        regions=regions)


def _rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_large_snapshot_streams_in_bounded_memory(tmp_path):
    path, count = tmp_path / "large.db", 200_000
    baseline = peak = _rss()
    with SnapshotSink(path) as sink:
        for i, record in enumerate(_synthetic(count, regions_every=20)):
            sink.record(record)
            if i % 10_000 == 0:
                peak = max(peak, _rss())
        sink.finish(Report(summary={"complete": True, "cluster": None}, records=[], shared_groups=[]))
    growth_mb = (max(peak, _rss()) - baseline) / 2**20
    print(f"\n{count} keys (1 in 20 with 6 regions): RSS growth {growth_mb:.1f} MiB, "
          f"{path.stat().st_size / count:.0f} bytes per key")
    assert growth_mb < 64
    with open_snapshot(path) as snapshot:
        assert snapshot.keys == count
        assert snapshot.db.execute("SELECT count(*) FROM region_results").fetchone()[0] == count // 20 * 6


def test_a_failed_scan_leaves_no_file(tmp_path):
    path = tmp_path / "never.db"
    with pytest.raises(RuntimeError), SnapshotSink(path) as sink:
        sink.record(next(_synthetic(1, 1)))
        raise RuntimeError("the scan failed")
    assert os.listdir(tmp_path) == []


def test_finish_adds_what_only_the_report_has(tmp_path):
    """Keys the scan never streamed (resumed from a checkpoint, gone before sizing) and replica rows."""
    streamed, resumed = _synthetic(2, 1)
    streamed.evidence["replicas"] = [{"endpoint": "10.0.0.1:12345", "xxh3": "00", "status": "ok"}]
    path = tmp_path / "s.db"
    with SnapshotSink(path) as sink:
        sink.record(streamed)
        sink.finish(Report(summary={"complete": True, "cluster": None}, records=[streamed, resumed], shared_groups=[]))
    with open_snapshot(path) as snapshot:
        assert snapshot.keys == 2
        replicas, evidence = snapshot.db.execute("SELECT replicas, evidence FROM keys WHERE key = ?",
                                                 (streamed.key.encode(),)).fetchone()
        assert json.loads(replicas)[0]["endpoint"] == "10.0.0.1:12345" and json.loads(evidence) == {}
        digests = [row[0] for row in snapshot.db.execute("SELECT xxh3 FROM regions ORDER BY key, idx")]
    assert digests == [r["xxh3"] for r in streamed.regions + resumed.regions]  # digests >= 2**63 included


def _finished(path, records=(), complete: bool = True):
    with SnapshotSink(path) as sink:
        for record in records:
            sink.record(record)
        sink.finish(Report(summary={"complete": complete, "cluster": None}, records=[], shared_groups=[]))
    return path


def test_an_incomplete_snapshot_without_findings_exits_3(tmp_path):
    whole = _finished(tmp_path / "whole.db", _synthetic(3, 1))
    interrupted = _finished(tmp_path / "interrupted.db", _synthetic(2, 1), complete=False)
    result = diff_snapshots(whole, interrupted)
    assert (result.summary["removed"], result.summary["findings"], result.exit_code) == (1, 0, 3)
    assert result.summary["warnings"][0].startswith("snapshot B is incomplete")


def _not_a_snapshot(tmp_path) -> dict:
    good = _finished(tmp_path / "good.db", _synthetic(3000, 1))
    data = good.read_bytes()
    report = tmp_path / "report.json"
    report.write_text('{"schema": "mooncake-audit/report", "version": 1}')
    other = tmp_path / "other.db"
    sqlite3.connect(other).execute("CREATE TABLE t (x)").connection.close()
    future = _finished(tmp_path / "future.db")
    db = sqlite3.connect(future)
    db.execute("UPDATE meta SET value = '2' WHERE name = 'version'")
    db.commit()
    db.close()
    truncated, damaged = tmp_path / "truncated.db", tmp_path / "damaged.db"
    truncated.write_bytes(data[: len(data) // 2])
    damaged.write_bytes(data[: len(data) // 2] + bytes(8192) + data[len(data) // 2 + 8192:])
    return {report: "is not a readable mooncake-audit snapshot (file is not a database)",
            other: "is not a readable mooncake-audit snapshot (no such table: meta)",
            future: "is a snapshot of version 2; this mooncake-audit reads version 1",
            truncated: "is not a readable mooncake-audit snapshot (database disk image is malformed)",
            damaged: "is not a readable mooncake-audit snapshot (database disk image is malformed)",
            tmp_path / "missing.db": "cannot read snapshot",
            tmp_path: "cannot read snapshot"}


def test_what_is_not_a_snapshot_is_one_line_error(tmp_path):
    good = _finished(tmp_path / "empty.db")
    for path, message in _not_a_snapshot(tmp_path).items():
        with pytest.raises(AuditError) as raised:
            diff_snapshots(good, path)
        assert message in str(raised.value) and "\n" not in str(raised.value)
