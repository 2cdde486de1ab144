"""`mooncake-audit impact` through the CLI: exit 1 when a flagged key was served, 0 when none was
(refused loads included), 2 with one line on stderr when it cannot run."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from cli import app
from tests.forensics.test_impact import AFFECTED_REQUESTS, GOOD1, REFUSED_ONLY, load, write_incident


def _impact(*args: str, env: dict | None = None):
    return CliRunner().invoke(app, ["impact", *args], env=env, catch_exceptions=False)


def _one_line_error(result) -> str:
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mooncake-audit: error: "), result.stderr
    assert "Traceback" not in result.output and result.stdout == ""
    return lines[0]


def test_exit_1_when_a_flagged_key_was_served(tmp_path):
    report, records_dir = write_incident(tmp_path)
    result = _impact(str(report), "--block-tables", str(records_dir), "--format", "json")
    assert result.exit_code == 1, result.output
    document = json.loads(result.stdout)
    assert {row["request"] for row in document["requests"]} == AFFECTED_REQUESTS
    human = _impact(str(report), "--block-tables", str(records_dir))
    assert human.exit_code == 1 and human.stdout.startswith("AFFECTED: 6 request(s)")


def test_exit_0_when_flagged_keys_were_only_refused_and_html_goes_to_its_file(tmp_path):
    report, records_dir = write_incident(tmp_path, loads_a=[
        load(REFUSED_ONLY, 0, request_id="r5", refused=True, reason="ZERO_STATE"), load(GOOD1, 1, request_id="r6")],
        loads_b=[])
    page = tmp_path / "impact.html"
    env = {"MOONCAKE_AUDIT_BLOCK_TABLES": str(records_dir)}  # as the other commands take it
    result = _impact(str(report), "--format", "html", "--output", str(page), env=env)
    assert result.exit_code == 0, result.output
    assert result.stdout == "" and "NOT AFFECTED" in page.read_text() and 'class="refused"' in page.read_text()
    human = _impact(str(report), env=env)
    assert human.exit_code == 0 and human.stdout.startswith("NOT AFFECTED: no request was served a flagged key")


def test_exit_2_with_one_line_when_it_cannot_run(tmp_path):
    report, records_dir = write_incident(tmp_path)
    assert "--block-tables" in _one_line_error(_impact(str(report)))
    assert "--format" in _one_line_error(_impact(str(report), "--block-tables", str(records_dir), "--format", "xml"))
    assert "cannot read report" in _one_line_error(_impact(str(tmp_path / "none.json"), "--block-tables",
                                                           str(records_dir)))
    (tmp_path / "layout.json").write_text('{"schema": "mooncake-audit/layout"}')
    assert "not a mooncake-audit report" in _one_line_error(_impact(str(tmp_path / "layout.json"), "--block-tables",
                                                                    str(records_dir)))
    broken = records_dir / "loads-host-a-100-0009.jsonl"
    broken.write_text(json.dumps(load(GOOD1, 0)) + "\n{broken\n")
    assert f"{broken}:2" in _one_line_error(_impact(str(report), "--block-tables", str(records_dir)))
    lenient = _impact(str(report), "--block-tables", str(records_dir), "--lenient", "--format", "json")
    assert lenient.exit_code == 1 and json.loads(lenient.stdout)["summary"]["skipped_lines"] == 1
    assert "cannot write" in _one_line_error(_impact(str(report), "--block-tables", str(records_dir), "--output",
                                                     str(tmp_path / "no" / "such" / "dir.json")))
