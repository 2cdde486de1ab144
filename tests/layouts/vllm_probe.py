"""vLLM's own answers to the audit's layout questions, from a process of their own.

Run with the real-vLLM venv's Python (the differential tests do, once per test module):

    .venv-vllm/bin/python tests/layouts/vllm_probe.py registry
    .venv-vllm/bin/python tests/layouts/vllm_probe.py answers CASES.json
    VLLM_PROBE_ROOT=DIR .venv-vllm/bin/python tests/layouts/vllm_probe.py answers CASES.json

and read the JSON document on the stdout line that starts with ``RESULT_PREFIX``. ``VLLM_PROBE_ROOT``:
a directory holding another release's ``vllm/`` package (0.33.0's wheel unpacked, its Python only):
it goes first on ``sys.path``, so that release's code answers, on the venv's torch and transformers,
on its CPU platform (``VLLM_TARGET_DEVICE=cpu``; its CUDA libraries are never loaded). A process of
its own, because to ask vLLM's classes it changes what the pytest process should not see:

- its multimodal model modules import torchvision, torchaudio or timm at module level, and the
  CPU venv has none: empty stand-ins are importable here (only class methods that read configs
  are called, never a model);
- vLLM inspects a model class in a subprocess of its own (a CUDA precaution); here it runs
  in-process, where the stand-ins are;
- vLLM's CPU platform forces float32 ssm states only on a CPU with AVX-512 BF16, the platform the
  audit's ``cpu`` rules describe; this host may lack it, so the check says it has it.

``registry``: the release answering, every registered architecture whose class is ``IsHybrid`` or
``IsAttentionFree``, and every one whose module could not be imported (with whether its source
names either marker).
``answers``: per case ``{"id", "dir", "tp", "dtype"}`` and optionally ``"attention_layers": false``
(a hybrid class whose config has no attention layer, which vLLM never aligns),
``"prefix_caching": false`` (the CPU build turns it off for MLA, which a hybrid's config refuses
then), ``"trust_remote_code": true``, ``"kv_cache_dtype"`` (vLLM's flag): the engine config vLLM
resolves (or the error with which it refuses the flags), its state shapes and dtypes
(``get_mamba_state_shape_from_config`` / ``get_mamba_state_dtype_from_config``), the block size
and Mamba page after the platform's ``update_block_size_for_backend`` (the pass vLLM runs once
the model is built, the hybrid alignment in it; the built layers' attention backends stood in by
the case's: ``CPU_ATTN``, ``CPU_MLA`` for MLA, none without attention layers; what its last check
says against the aligned block, if anything, in ``block_refused``), the attention page
(``FullAttentionSpec`` or, for MLA, ``MLAAttentionSpec``), and the ssm dtype by the model's own
rule before any platform override (``rule_state_dtypes``: what a CUDA producer gets), and with
``"gpus": true`` what a CUDA producer's block and padded page are on each GPU of ``GPUS``.

The GPU answers (``gpu_answer``): vLLM's own ``Platform.update_block_size_for_backend`` and
``_align_hybrid_block_size`` (the methods the CUDA platform inherits), with the FlashAttention
backend class (its preferred and kernel block sizes and page spec) as the built layers' backend,
after the model's own ssm-dtype rule, on the engine config reset to CUDA's default block 16 and no
padding. Stood in by the probe, because no GPU is here: the platform (``StandInCuda``: vLLM's
``Platform`` with a CUDA enum, the device capability of the GPU and CUDA runtime 13, nothing
else), and the model's built layers, which ``get_mamba_prefill_checkpoint_alignment`` asks (vLLM
0.33): one bare instance of each Mamba layer class the model's modules hold (no ``__init__``
run), whose ``_checkpoint_alignment`` is what ``QwenGatedDeltaNetAttention.__init__`` sets:
``FLASHINFER_GDN_CHECKPOINT_ALIGNMENT`` in align mode when vLLM's own
``_resolve_gdn_prefill_backend`` picks FlashInfer on the stand-in platform, else None. Every other
layer class answers with its own ``get_prefill_checkpoint_alignment``.
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
GPUS = {"sm90": (9, 0), "sm100": (10, 0)}  # the GPU rules vLLM 0.33 added: Hopper, Blackwell (SM10x)
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
    root = os.environ.get("VLLM_PROBE_ROOT")
    if root:  # another release's Python first; its CUDA build answers as its CPU platform
        sys.path.insert(0, root)
        os.environ["VLLM_TARGET_DEVICE"] = "cpu"
        # and a model-info cache of its own: written to the venv's, its entries made every engine of
        # the venv's release miss once per class and inspect it again in a subprocess (8 s each)
        cache = Path(os.environ.get("VLLM_CACHE_ROOT") or Path.home() / ".cache" / "vllm")
        os.environ["VLLM_CACHE_ROOT"] = str(cache / "releases" / Path(root).name)
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
    import vllm

    return {"vllm_version": vllm.__version__, "registered": len(_VLLM_MODELS), "stateful": stateful,
            "import_failed": failed}


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


def _stand_in_cuda(capability: tuple[int, int]):
    from vllm.platforms.interface import DeviceCapability, Platform, PlatformEnum

    class StandInCuda(Platform):
        """A CUDA GPU of this capability; everything else is vLLM's ``Platform``."""

        _enum = PlatformEnum.CUDA
        device_name = device_type = "cuda"

        @classmethod
        def get_device_capability(cls, device_id: int = 0):
            return DeviceCapability(*capability)

        @classmethod
        def get_cuda_runtime_major(cls) -> int:
            return 13

    return StandInCuda()


def _mamba_layer_classes(model_cls) -> list:
    """The Mamba layer classes in the model's modules and the model modules they import (a
    wrapper's language model), most derived only."""
    from vllm.model_executor.layers.mamba.abstract import MambaBase

    def model_module(name: str) -> bool:
        return name.startswith(("vllm.model_executor.models.", "vllm.models.")) and name in sys.modules

    modules = {sys.modules[cls.__module__] for cls in model_cls.__mro__ if model_module(cls.__module__)}
    for module in list(modules):
        modules |= {sys.modules[value.__module__] for value in vars(module).values()
                    if isinstance(value, type) and model_module(value.__module__)}
    found = {value for module in modules for value in vars(module).values()
             if isinstance(value, type) and issubclass(value, MambaBase) and value is not MambaBase}
    return sorted((cls for cls in found if not any(other is not cls and issubclass(other, cls) for other in found)),
                  key=lambda cls: cls.__qualname__)


def _stand_in_layers(config, model_cls, platform) -> dict:
    """One bare layer of each Mamba layer class, as ``get_mamba_prefill_checkpoint_alignment`` reads them."""
    import vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn as qwen_gdn
    from vllm.v1.attention.backends.gdn_attn import FLASHINFER_GDN_CHECKPOINT_ALIGNMENT

    qwen_gdn.current_platform = platform
    _, prefill = qwen_gdn._resolve_gdn_prefill_backend(config)
    layers = {}
    for cls in _mamba_layer_classes(model_cls):
        layer = cls.__new__(cls)
        align = config.cache_config.mamba_cache_mode == "align" and prefill == "flashinfer"
        layer._checkpoint_alignment = FLASHINFER_GDN_CHECKPOINT_ALIGNMENT if align else None
        layers[cls.__qualname__] = layer
    return layers


def _update_block_size(platform_cls, config, backends: list) -> str | None:
    """``Platform.update_block_size_for_backend`` with `backends` as the built layers' backends;
    what its last check (``_check_aligned_block_size``) says against the aligned block, if anything
    (vLLM would not start; the block it computed is kept for the comparison)."""
    check = platform_cls._check_aligned_block_size
    refusals = []

    def recorded(cls, *args):
        try:
            check(*args)
        except ValueError as error:
            refusals.append(str(error))

    own = vars(platform_cls).get("_check_aligned_block_size")
    platform_cls._find_non_ssm_backends = classmethod(lambda cls, vllm_config: list(backends))
    platform_cls._check_aligned_block_size = classmethod(recorded)
    try:
        platform_cls.update_block_size_for_backend(config)
    finally:
        if own is None:
            del platform_cls._check_aligned_block_size
        else:
            platform_cls._check_aligned_block_size = own
    return refusals[0] if refusals else None


def gpu_answer(config, model_cls, capability: tuple[int, int]) -> dict:
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    from vllm.v1.kv_cache_interface import MambaSpec

    platform = _stand_in_cuda(capability)
    cache_config = config.cache_config
    cache_config.block_size = 16  # CUDA's default block before the backends' pass (CacheConfig's)
    cache_config.mamba_page_size_padded = None
    answer: dict = {"alignment": None}
    try:
        import vllm.model_executor.layers.mamba.abstract as abstract
    except ImportError:
        abstract = None
    if abstract is not None and hasattr(abstract, "get_mamba_prefill_checkpoint_alignment"):  # vLLM 0.33
        layers = _stand_in_layers(config, model_cls, platform)
        from vllm.model_executor.layers.mamba.abstract import MambaBase
        abstract.get_layers_from_vllm_config = (
            lambda vllm_config, kind, names=None: layers if kind is MambaBase else {})
        answer["layer_classes"] = sorted(layers)
        answer["alignment"] = abstract.get_mamba_prefill_checkpoint_alignment(config)
    _update_block_size(type(platform), config, [FlashAttentionBackend])
    spec = MambaSpec(shapes=tuple(tuple(shape) for shape in model_cls.get_mamba_state_shape_from_config(config)),
                     dtypes=tuple(model_cls.get_mamba_state_dtype_from_config(config)), block_size=-1)
    answer.update(block_size=cache_config.block_size,
                  state_page=cache_config.mamba_page_size_padded or spec.page_size_bytes)
    return answer


def case_answer(case: dict) -> dict:
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.models import ModelRegistry
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, MLAAttentionSpec

    tp = case["tp"]
    config = EngineArgs(model=case["dir"], load_format="dummy", skip_tokenizer_init=True, tensor_parallel_size=tp,
                        dtype=case.get("dtype", "auto"), enable_prefix_caching=case.get("prefix_caching", True),
                        kv_cache_dtype=case.get("kv_cache_dtype", "auto"),
                        enforce_eager=True,
                        max_model_len=2048, trust_remote_code=case.get("trust_remote_code", False),
                        distributed_executor_backend="mp" if tp > 1 else None).create_engine_config()
    model_config, cache_config = config.model_config, config.cache_config
    model_cls, _ = ModelRegistry.resolve_model_cls(model_config.architecture, model_config=model_config)
    use_mla = bool(model_config.use_mla)
    import vllm

    answer: dict = {"vllm_version": vllm.__version__, "model_dtype": _dtype_name(model_config.dtype), "use_mla": use_mla,
                    "architecture": model_config.architecture, "is_hybrid": bool(model_config.is_hybrid)}
    # vLLM's block-size pass once the model is built (the CPU backend's block, the hybrid alignment),
    # with the attention backends of the built layers stood in: none in a hybrid without attention
    backend = AttentionBackendEnum["CPU_MLA" if use_mla else "CPU_ATTN"].get_class()
    refused = _update_block_size(type(current_platform), config, [backend] if case.get("attention_layers", True) else [])
    if refused:
        answer["block_refused"] = refused
    if hasattr(model_cls, "get_mamba_state_shape_from_config"):
        shapes = [tuple(shape) for shape in model_cls.get_mamba_state_shape_from_config(config)]
        dtypes = tuple(model_cls.get_mamba_state_dtype_from_config(config))
        spec = MambaSpec(shapes=tuple(shapes), dtypes=dtypes, block_size=-1)
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
    if case.get("gpus") and "state_regions" in answer and model_config.is_hybrid and not use_mla \
            and case.get("attention_layers", True):  # last: it re-aligns the engine config for CUDA
        answer["gpus"] = {name: gpu_answer(config, model_cls, capability) for name, capability in GPUS.items()}
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
