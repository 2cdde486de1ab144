"""`snapshot` and `diff` (two files, and against the live cluster) through the command line."""

from __future__ import annotations

import json

from tests.helpers import run_cli


def test_snapshot_then_diff_files_and_live(publisher, cli_args, namespace, tmp_path):
    for i in range(4):
        publisher.put(f"{namespace}k{i}", bytes([i + 1]) * 3000)
    first = tmp_path / "a.db"
    result = run_cli("snapshot", "--output", str(first), *cli_args, "--prefix", namespace, "--no-progress")
    assert result.exit_code == 0, result.output
    assert "snapshot of 4 keys" in result.stderr

    publisher.store.remove(f"{namespace}k0", True)  # force: the snapshot's read holds a lease
    publisher.put(f"{namespace}k9", bytes(3000))   # a new, all-zero key: a finding
    second = tmp_path / "b.db"
    assert run_cli("snapshot", "--output", str(second), *cli_args, "--prefix", namespace,
                   "--no-progress").exit_code == 1

    files = run_cli("diff", str(first), str(second), "--format", "json")
    live = run_cli("diff", str(first), "--live", *cli_args, "--format", "json")
    for result in (files, live):
        assert result.exit_code == 1, result.output
        document = json.loads(result.stdout)
        changes = {entry["key"]: (entry["change"], entry["finding"]) for entry in document["entries"]}
        assert changes == {f"{namespace}k0": ("removed", False), f"{namespace}k9": ("added", True)}
    human = run_cli("diff", str(first), str(second))
    assert human.exit_code == 1 and f"{namespace}k9" in human.stdout


def test_diff_needs_two_snapshots_or_live(tmp_path):
    result = run_cli("diff", str(tmp_path / "a.db"))
    assert result.exit_code == 2 and "--live" in result.stderr
    (tmp_path / "not.db").write_text("hello")
    result = run_cli("diff", str(tmp_path / "not.db"), str(tmp_path / "not.db"))
    assert result.exit_code == 2 and result.stderr.count("\n") == 1
