#!/usr/bin/env bash
# Fresh machine to green tests: set up with the test extras, then run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh --test
exec .venv/bin/python -m pytest -q "$@"
