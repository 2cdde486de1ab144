"""Prometheus alert rules for `check` and `watch`, shipped as a file for a rule_files entry."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

RULES_FILE = "mooncake-audit.rules.yml"


def path() -> Path:
    """Where the installed rules file is (copy it, or point Prometheus's rule_files at it)."""
    return Path(str(resources.files(__name__).joinpath(RULES_FILE)))
