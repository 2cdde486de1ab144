"""Shared test helpers: run the CLI in-process and read its JSON report."""

from __future__ import annotations

import json
from functools import lru_cache
from importlib import resources

import jsonschema
from typer.testing import CliRunner

from cli import app


@lru_cache
def report_schema() -> dict:
    return json.loads(resources.files("audit").joinpath("schemas/report.schema.json").read_text())


def run_cli(*args: str):
    return CliRunner().invoke(app, list(args), catch_exceptions=False)


def scan_json(cli_args: list[str], *extra: str) -> tuple[int, dict]:
    """Exit code and the validated JSON report of `mooncake-audit scan --format json`."""
    result = run_cli("scan", *cli_args, "--format", "json", "--no-progress", *extra)
    assert result.exit_code in (0, 1, 3), result.output
    document = json.loads(result.stdout)
    jsonschema.validate(document, report_schema())
    return result.exit_code, document


def by_key(document: dict) -> dict[str, dict]:
    return {record["key"]: record for record in document.get("keys", document["findings"])}
