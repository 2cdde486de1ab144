"""`mooncake-audit report REPORT --html OUT` on a report of a real scan."""

from __future__ import annotations

import re

from tests.judge import test_verdicts
from tests.helpers import run_cli
from tests.judge.test_verdicts import _layout_args

workload = test_verdicts.workload  # the fixture: keys with known defects, a tiny Mamba layout, a block table


def test_report_command_renders_a_real_scan(cli_args, namespace, workload, tmp_path):
    keys, _, model_dir, table = workload
    scanned, page = tmp_path / "scan.json", tmp_path / "report.html"
    run_cli("scan", *cli_args, "--prefix", namespace.rstrip("/"), *_layout_args(model_dir), "--block-tables",
            str(table), "--all", "--format", "json", "--output", str(scanned), "--no-progress")
    result = run_cli("report", str(scanned), "--html", str(page))
    assert result.exit_code == 0, result.output
    html = page.read_text()
    assert "<svg" in html and "FINDINGS" in html and "PARTIAL_ZERO" in html
    assert not re.search(r"(src|href)\s*=\s*[\"']?https?:", html)  # the admin URL is text, never a link


def test_report_command_refuses_a_non_report_in_one_line(tmp_path):
    bogus = tmp_path / "x.json"
    bogus.write_text('{"hello": 1}')
    result = run_cli("report", str(bogus), "--html", str(tmp_path / "out.html"))
    assert result.exit_code == 2 and result.stderr.count("\n") == 1 and not (tmp_path / "out.html").exists()
