"""`purge` on a real cluster: exactly the flagged keys go, evidence first, changed keys stay."""

from __future__ import annotations

import gzip
import json

from audit.connection import AdminClient
from audit.forensics.evidence import key_file_name
from audit.sources.listing import AdminListing, KeyFilter
from tests.helpers import run_cli, scan_json


def _listed(settings, namespace):
    return sorted(k.name for k in AdminListing(AdminClient(settings.admin), KeyFilter(namespace)).list().keys)


def test_purge_removes_exactly_the_flagged_keys_and_keeps_evidence(publisher, settings, cli_args, namespace, tmp_path):
    names = {"bad-1": bytes(4000), "bad-2": bytes(4000), "bad\nthree": bytes(4000), "changes": bytes(4000),
             "good-1": b"\x01" * 4000, "good-2": b"\x02" * 4000}
    for name, value in names.items():
        publisher.put(namespace + name, value)
    report = tmp_path / "report.json"
    run_cli("scan", *cli_args, "--prefix", namespace, "--format", "json", "--output", str(report), "--no-progress")
    assert len(json.loads(report.read_text())["findings"]) == 4
    # Between the scan and the purge, one flagged key is replaced by a good value.
    assert publisher.store.remove(namespace + "changes", True) == 0
    publisher.put(namespace + "changes", b"\x07" * 4000)

    dry = run_cli("purge", str(report), *cli_args)
    assert dry.exit_code == 3  # a key changed since the scan is reported, and never removed
    lines = sorted(dry.stdout.splitlines())
    assert lines == sorted(["would-remove " + namespace + n.replace("\n", "\\n") for n in ("bad-1", "bad-2", "bad\nthree")]
                           + ["changed      " + namespace + "changes"])
    assert _listed(settings, namespace) == sorted(namespace + n for n in names)  # a dry run removes nothing

    evidence = tmp_path / "evidence"
    done = run_cli("purge", str(report), *cli_args, "--yes", "--evidence", str(evidence))
    assert done.exit_code == 3, done.output
    assert sorted(done.stdout.splitlines()) == sorted(
        ["removed      " + namespace + n.replace("\n", "\\n") for n in ("bad-1", "bad-2", "bad\nthree")]
        + ["changed      " + namespace + "changes"])
    assert _listed(settings, namespace) == sorted(namespace + n for n in ("changes", "good-1", "good-2"))
    for name in ("bad-1", "bad-2", "bad\nthree"):
        sidecar = json.loads((evidence / "keys" / key_file_name(namespace + name)).read_text())
        assert sidecar["key"] == namespace + name and sidecar["reason"] == "purge"
        assert gzip.decompress((evidence / sidecar["blob"]).read_bytes()) == bytes(4000)
    log = [json.loads(line) for line in (evidence / "purge-log.jsonl").read_text().splitlines()]
    assert sorted((entry["action"], entry["key"]) for entry in log) == sorted(
        [("removed", namespace + n) for n in ("bad-1", "bad-2", "bad\nthree")] + [("changed", namespace + "changes")])

    code, rescan = scan_json(cli_args, "--prefix", namespace)
    assert code == 0 and rescan["summary"]["keys_scanned"] == 3


def test_live_purge_by_verdict_and_arguments(publisher, settings, cli_args, namespace, tmp_path):
    publisher.put(namespace + "zero", bytes(1000))
    publisher.put(namespace + "fine", b"\x03" * 1000)
    result = run_cli("purge", "--verdict", "ZERO_VALUE", "--prefix", namespace, *cli_args, "--yes", "--force",
                     "--evidence", str(tmp_path / "ev"))
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines() == ["removed      " + namespace + "zero"]
    assert _listed(settings, namespace) == [namespace + "fine"]
    assert run_cli("purge", *cli_args).exit_code == 2
    assert "not a finding verdict" in run_cli("purge", "--verdict", "VANISHED", *cli_args, "--prefix", namespace).stderr


def test_stale_disk_copies_need_a_report_of_a_scan_with_offload_directories(publisher, cli_args, namespace, tmp_path):
    publisher.put(namespace + "fine", b"\x03" * 1000)
    assert "give a REPORT" in run_cli("purge", "--stale-disk-copies", "--verdict", "ZERO_VALUE", *cli_args).stderr
    report = tmp_path / "scan.json"
    scanned = run_cli("scan", *cli_args, "--prefix", namespace, "--format", "json", "--output", str(report),
                      "--no-progress")
    assert scanned.exit_code == 0, scanned.output
    refused = run_cli("purge", str(report), "--stale-disk-copies", *cli_args, "--offload-dir", str(tmp_path))
    assert refused.exit_code == 2 and refused.stdout == ""
    assert refused.stderr.strip().endswith("reports no offload directory: scan with --offload-dir first")
