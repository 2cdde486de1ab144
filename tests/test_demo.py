"""`mooncake-audit demo`, the first thing a new user runs: its own cluster, the #53084 finding."""

from __future__ import annotations

import json

from tests.helpers import report_schema, run_cli


def test_demo_finds_exactly_the_null_backed_keys():
    import jsonschema

    result = run_cli("demo", "--format", "json", "--no-progress")
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    jsonschema.validate(document, report_schema())
    assert document["summary"]["verdicts"] == {"NULL_BACKED": 24, "ZERO_STATE": 24}
    assert document["summary"]["keys_scanned"] == 48 and document["summary"]["complete"]
    assert "precision 1.00, recall 1.00" in result.stderr
