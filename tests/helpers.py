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


def check_in_buffer(values: dict[str, bytes], plan) -> dict:
    """`check_batch` over `values` laid out in one host buffer (64-byte aligned), as a scan with
    `plan` would check them once read: key -> its record."""
    from types import SimpleNamespace

    import numpy as np

    from audit.checks.host import HostChecker
    from audit.readers.buffers import FetchedBatch, Slot
    from audit.records import KeyInfo
    from audit.run.scan import check_batch

    offsets, blobs, offset = [], [], 0
    for value in values.values():
        offsets.append(offset)
        blobs.append(value + bytes(-len(value) % 64))
        offset += len(blobs[-1])
    buffer = SimpleNamespace(array=np.frombuffer(b"".join(blobs), dtype=np.uint8).copy())
    slots = [Slot(KeyInfo(name, len(value)), at) for (name, value), at in zip(values.items(), offsets)]
    batch = FetchedBatch(slots, [len(value) for value in values.values()], buffer)
    return {record.key: record for record in check_batch(batch, HostChecker(), plan)}
