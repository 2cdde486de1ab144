#!/usr/bin/env bash
# A Python with SGLang 0.5.23 for tests/producers/sglang_store.py (its own MooncakeStore and host KV
# pools against a real cluster); the last line of stdout is that Python, for SGLANG_PYTHON:
#
#   SGLANG_PYTHON=$(bash scripts/sglang-env.sh | tail -1) .venv/bin/python -m pytest -q tests/producers -k sglang
#
# .venv-sglang is separate from .venv and .venv-vllm, and cannot be cheaper than a CUDA torch:
#   - SGLang imports torchvision unconditionally (mooncake_store -> pool_host -> memory_pool ->
#     sglang.srt.configs -> nano_nemotron_vl -> multimodal/internvl_utils: `import torchvision`),
#     and triton (srt/utils/common.py);
#   - the only torchvision for .venv's torch 2.13.0+cpu that pip can reach here (0.28.0) is a CUDA
#     build: beside a CPU torch its import fails ("operator torchvision::nms does not exist");
#   - so torch 2.14.1 + torchvision 0.29.1 (CUDA builds, on this machine's disk for Python 3.11),
#     whose import needs the NVIDIA runtime wheels; they run on the CPU.
# Everything goes in with --no-deps from one pinned list: exactly what the import and the script
# need (SGLang's declared deps would pull its whole serving stack).
set -euo pipefail
cd "$(dirname "$0")/.."

venv=.venv-sglang
python="${PYTHON:-python3.11}"
stamp="$venv/.sglang-ready"
packages=(
  # torch 2.14.1 and what its import needs (the NVIDIA wheels of cuda-toolkit's extras torch names)
  torch==2.14.1 torchvision==0.29.1 triton==3.8.0
  cuda-toolkit==13.0.3.0 cuda-bindings==13.5.0 cuda-pathfinder==1.9.1
  nvidia-cublas==13.1.1.3 nvidia-cuda-cupti==13.0.85 nvidia-cuda-nvrtc==13.0.88 nvidia-cuda-runtime==13.0.96
  nvidia-cudnn-cu13==9.24.0.43 nvidia-cufft==12.0.0.61 nvidia-cufile==1.15.1.6 nvidia-curand==10.4.0.35
  nvidia-cusolver==12.0.4.66 nvidia-cusparse==12.6.3.3 nvidia-cusparselt-cu13==0.8.1 nvidia-nccl-cu13==2.30.7
  nvidia-nvjitlink==13.5.37 nvidia-nvshmem-cu13==3.4.5 nvidia-nvtx==13.0.85
  typing_extensions==4.16.0 sympy==1.14.0 mpmath==1.3.0 networkx==3.6.1 filelock==4.3.1 fsspec==2026.9.0
  Jinja2==3.1.6 MarkupSafe==3.0.4 numpy==2.4.6
  # Mooncake's client and the script's digests
  mooncake-transfer-engine-non-cuda==0.3.13.post1 xxhash==4.1.0
  # SGLang and what importing its MooncakeStore and host pools pulls in
  sglang==0.5.23 orjson==3.13.0 psutil==7.2.2 pybase64==1.5.1 pillow==13.0.0 starlette==1.10.0 anyio==4.16.0
  msgspec==0.23.0 pyzmq==27.3.0 tqdm==4.70.1 ipython==9.18.1 traitlets==5.16.1 Pygments==2.21.0
  transformers==5.24.0 regex==2026.11.19 huggingface_hub==2.4.0 httpx2==2.16.2 httpcore2==2.16.2
  truststore==0.10.5 h11==0.16.0 safetensors==0.8.0 tokenizers==0.23.3 packaging==26.4 PyYAML==6.0.4
  requests==2.34.2 urllib3==2.8.0 idna==3.20 certifi==2026.10.19.post1 charset-normalizer==3.5.3
  pydantic==2.14.4 pydantic_core==2.50.5 typing-inspection==0.4.5 annotated-types==0.8.0
  aiohttp==3.14.5 multidict==7.2.1 attrs==26.1.0 yarl==1.25.1 propcache==0.5.4 aiohappyeyeballs==2.7.1
  aiosignal==1.4.0 frozenlist==1.8.0
  dill==0.4.1 apache-tvm-ffi==0.1.15.post2 sentencepiece==0.2.3 compressed-tensors==0.20.1 loguru==0.7.3
  gguf==0.19.0
)
want="$(printf '%s\n' "${packages[@]}" | sha1sum | cut -c1-12)"

if [[ ! -f "$stamp" || "$(cat "$stamp")" != "$want" || ! -x "$venv/bin/python" ]]; then
  echo "sglang-env: setting up $venv (about a minute from this machine's disk, ~6 GB)" >&2
  rm -rf "$venv"
  "$python" -m venv "$venv"
  # (this machine's pip.conf names local indexes that may be absent: drop those warnings)
  "$venv/bin/python" -m pip install -q --no-deps "${packages[@]}" 2> >(grep -v "^WARNING: Location" >&2)
  "$venv/bin/python" - >&2 <<'PY'
import torch, torchvision  # noqa: F401
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: F401
from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import MooncakeStore  # noqa: F401
print(f"sglang-env: torch {torch.__version__}, torchvision {torchvision.__version__}: SGLang imports")
PY
  echo "$want" > "$stamp"
fi
echo "$PWD/$venv/bin/python"
