"""The app offers exactly the commands the README's "Use" table documents."""

from __future__ import annotations

from typer.main import get_command

from cli import app

DOCUMENTED = {"scan", "check", "watch", "snapshot", "diff", "purge", "verify", "layout", "crossref", "impact",
              "report", "explain", "simulate", "demo"}


def test_the_app_registers_exactly_the_documented_commands():
    assert set(get_command(app).commands) == DOCUMENTED
