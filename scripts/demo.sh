#!/usr/bin/env bash
# Fresh machine to first report: set up, then run the demo on an embedded local cluster.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/mooncake-audit demo "$@"
