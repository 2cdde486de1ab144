#!/usr/bin/env bash
# Sets up a fresh Debian machine (as root, or with sudo) for mooncake-audit:
# Debian's libibverbs1 and libnuma1 (the Mooncake daemons need them even for TCP), a virtual
# environment in .venv, and the project with its CPU Mooncake client.
#   scripts/bootstrap.sh          the tool (enough for `mooncake-audit demo`)
#   scripts/bootstrap.sh --test   plus torch 2.13.0 (CPU), triton 3.7.1 and the test tools
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(libibverbs1 libnuma1)
# the tests render the HTML report in headless Chromium and check the shipped alert rules with
# promtool (Debian's prometheus package)
[[ "${1:-}" == "--test" ]] && packages+=(chromium prometheus)
missing=()
for package in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "ok installed" || missing+=("$package")
done
if ((${#missing[@]})); then
  sudo=""; [[ $(id -u) -eq 0 ]] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
fi

python="${PYTHON:-python3}"
[[ -x .venv/bin/python ]] || "$python" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
extras="cpu"
if [[ "${1:-}" == "--test" ]]; then
  # torch first and pinned: 2.13.0 is the CPU wheel; an unpinned torch would pull a CUDA build.
  .venv/bin/python -m pip install -q "torch==2.13.0"
  extras="cpu,kernels,test"
fi
.venv/bin/python -m pip install -q -e ".[${extras}]"
