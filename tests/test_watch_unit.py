"""docs/watch.md's systemd unit passes `systemd-analyze verify` (skipped where systemd is absent)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

analyze = shutil.which("systemd-analyze")


@pytest.mark.skipif(analyze is None, reason="systemd-analyze not installed")
def test_the_documented_unit_verifies(tmp_path):
    doc = (Path(__file__).parent.parent / "docs" / "watch.md").read_text()
    unit = re.search(r"```ini\n(.*?)```", doc, re.S).group(1)
    executable = Path(sys.executable).with_name("mooncake-audit")
    if not executable.exists():
        pytest.skip("the mooncake-audit script is not installed beside this python")
    path = tmp_path / "mooncake-audit-watch.service"
    path.write_text(unit.replace("/opt/mooncake-audit/.venv/bin/mooncake-audit", str(executable)))
    verified = subprocess.run([analyze, "verify", str(path)], capture_output=True, text=True, timeout=60)
    assert verified.returncode == 0 and not verified.stderr.strip(), verified.stderr
