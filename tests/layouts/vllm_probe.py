"""vLLM's own answers to the audit's layout questions, from a process of their own.

Run with the real-vLLM venv's Python (the differential tests do, once per test module):

    .venv-vllm/bin/python tests/layouts/vllm_probe.py registry
    .venv-vllm/bin/python tests/layouts/vllm_probe.py answers CASES.json

and read the JSON document on the stdout line that starts with ``RESULT_PREFIX``. A process of
its own, because to ask vLLM 0.32.0's classes it changes what the pytest process should not see:

- its multimodal model modules import torchvision, torchaudio or timm at module level, and the
  CPU venv has none: empty stand-ins are importable here (only class methods that read configs
  are called, never a model);
- vLLM inspects a model class in a subprocess of its own (a CUDA precaution); here it runs
  in-process, where the stand-ins are;
- vLLM's CPU platform forces float32 ssm states only on a CPU with AVX-512 BF16, the platform the
  audit's ``cpu`` rules describe; this host may lack it, so the check says it has it.

``registry``: every registered architecture whose class is ``IsHybrid`` or ``IsAttentionFree``,
and every one whose module could not be imported (with whether its source names either marker).
``answers``: per case ``{"id", "dir", "tp", "dtype"}`` and optionally ``"attention_layers": false``
(a hybrid class whose config has no attention layer, which vLLM never aligns),
``"prefix_caching": false`` (the CPU build turns it off for MLA, which a hybrid's config refuses
then), ``"trust_remote_code": true``: the engine config vLLM resolves, its state
shapes and dtypes (``get_mamba_state_shape_from_config`` / ``get_mamba_state_dtype_from_config``),
the block size and Mamba page after ``Platform._align_hybrid_block_size``, the attention page
(``FullAttentionSpec`` or, for MLA, ``MLAAttentionSpec``), and the ssm dtype by the model's own
rule before any platform override (``rule_state_dtypes``: what a CUDA producer gets).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import json
import logging
import math
import os
import sys
import types
from pathlib import Path

STAND_INS = ("torchvision", "torchaudio", "torchcodec", "timm", "terratorch")
RESULT_PREFIX = "vllm-probe-result: "  # the one stdout line to read (vLLM may print others)


class _Anything(type):
    """A class whose every attribute, call and item is another such class."""

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything(name, (), {})

    def __call__(cls, *args, **kwargs):
        return _Anything("instance", (), {})

    def __getitem__(cls, key):
        return cls

    def __iter__(cls):
        return iter(())


class _StandInModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything(name, (), {})


class _StandIns(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in STAND_INS:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StandInModule(spec.name)
        module.__path__ = []
        module.__version__ = "0.0.0"
        return module

    def exec_module(self, module):
        """Nothing to run: create_module set everything a stand-in has."""


def _prepare() -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    logging.disable(logging.WARNING)
    import torch
    import vllm.model_executor.models.registry as registry  # transformers first, without stand-ins

    sys.meta_path.insert(0, _StandIns())
    registry._run_in_subprocess = lambda fn: fn()
    torch.cpu._is_avx512_bf16_supported = lambda: True


def _module_name(module: str) -> str:
    return module if module.startswith("vllm.") else f"vllm.model_executor.models.{module}"


def _source_has_marker(module: str) -> bool:
    spec = importlib.util.find_spec(_module_name(module).rsplit(".", 1)[0])
    base = Path(spec.submodule_search_locations[0]) if spec and spec.submodule_search_locations else None
    leaf = _module_name(module).rsplit(".", 1)[1]
    files = [base / f"{leaf}.py"] if base and (base / f"{leaf}.py").exists() else []
    if base and (base / leaf).is_dir():
        files += sorted((base / leaf).rglob("*.py"))
    return any(marker in path.read_text() for path in files for marker in ("IsHybrid", "IsAttentionFree"))


def registry_answer() -> dict:
    from vllm.model_executor.models.interfaces import is_attention_free, is_hybrid
    from vllm.model_executor.models.registry import _VLLM_MODELS

    stateful, failed = {}, {}
    for architecture, (module, class_name) in sorted(_VLLM_MODELS.items()):
        try:
            model_cls = getattr(importlib.import_module(_module_name(module)), class_name)
        except BaseException as error:  # noqa: BLE001 - any import failure is recorded, not raised
            failed[architecture] = {"module": module, "error": f"{type(error).__name__}: {error}"[:300],
                                    "source_has_marker": _source_has_marker(module)}
            continue
        if is_hybrid(model_cls) or is_attention_free(model_cls):
            stateful[architecture] = {"module": module, "hybrid": bool(is_hybrid(model_cls)),
                                      "attention_free": bool(is_attention_free(model_cls))}
    return {"registered": len(_VLLM_MODELS), "stateful": stateful, "import_failed": failed}


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _state_regions(shapes, dtypes) -> list:
    import torch

    regions, offset = [], 0
    for shape, dtype in zip(shapes, dtypes):
        length = math.prod(shape) * torch.tensor([], dtype=dtype).element_size()
        regions.append([list(shape), _dtype_name(dtype), offset, length])
        offset += length
    return regions


def _rule_state_dtypes(config, model_cls, ssm_flag: str) -> list[str]:
    """The state dtypes by the model's own rule, before the CPU platform's override."""
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    config.cache_config.mamba_ssm_cache_dtype = ssm_flag
    rule = MODELS_CONFIG_MAP.get(config.model_config.architecture)
    if rule is not None:
        rule.verify_and_update_config(config)
    return [_dtype_name(dtype) for dtype in model_cls.get_mamba_state_dtype_from_config(config)]


def case_answer(case: dict) -> dict:
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.models import ModelRegistry
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, MLAAttentionSpec

    tp = case["tp"]
    config = EngineArgs(model=case["dir"], load_format="dummy", skip_tokenizer_init=True, tensor_parallel_size=tp,
                        dtype=case.get("dtype", "auto"), enable_prefix_caching=case.get("prefix_caching", True),
                        enforce_eager=True,
                        max_model_len=2048, trust_remote_code=case.get("trust_remote_code", False),
                        distributed_executor_backend="mp" if tp > 1 else None).create_engine_config()
    model_config, cache_config = config.model_config, config.cache_config
    model_cls, _ = ModelRegistry.resolve_model_cls(model_config.architecture, model_config=model_config)
    use_mla = bool(model_config.use_mla)
    answer: dict = {"model_dtype": _dtype_name(model_config.dtype), "use_mla": use_mla,
                    "architecture": model_config.architecture, "is_hybrid": bool(model_config.is_hybrid)}
    if hasattr(model_cls, "get_mamba_state_shape_from_config"):
        shapes = [tuple(shape) for shape in model_cls.get_mamba_state_shape_from_config(config)]
        dtypes = tuple(model_cls.get_mamba_state_dtype_from_config(config))
        spec = MambaSpec(shapes=tuple(shapes), dtypes=dtypes, block_size=-1)
        if model_config.is_hybrid and case.get("attention_layers", True):  # vLLM aligns only with attention
            backend = AttentionBackendEnum["CPU_MLA" if use_mla else "CPU_ATTN"].get_class()
            current_platform._align_hybrid_block_size(config, backend)
        answer["state_regions"] = _state_regions(shapes, dtypes)
        answer["state_page"] = cache_config.mamba_page_size_padded or spec.page_size_bytes
        answer["rule_state_dtypes"] = _rule_state_dtypes(config, model_cls, case.get("ssm_flag", "auto"))
    spec_cls = MLAAttentionSpec if use_mla else FullAttentionSpec
    attention = spec_cls(block_size=cache_config.block_size,
                         num_kv_heads=model_config.get_num_kv_heads(config.parallel_config),
                         head_size=model_config.get_head_size(), dtype=model_config.dtype)
    answer["attention"] = {"block_size": cache_config.block_size, "dtype": _dtype_name(model_config.dtype),
                           "page": attention.page_size_bytes, "heads": attention.num_kv_heads,
                           "head_size": attention.head_size}
    return answer


def answers(cases: list[dict]) -> dict:
    found = {}
    for case in cases:
        try:
            found[case["id"]] = case_answer(case)
        except Exception as error:  # noqa: BLE001 - one case's failure is that case's answer
            found[case["id"]] = {"error": f"{type(error).__name__}: {error}"[:500]}
    return found


def main(argv: list[str]) -> int:
    _prepare()
    if argv[:1] == ["registry"]:
        result = registry_answer()
    elif argv[:1] == ["answers"] and len(argv) == 2:
        result = answers(json.loads(Path(argv[1]).read_text()))
    else:
        print(__doc__, file=sys.stderr)
        return 2
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
