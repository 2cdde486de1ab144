"""The producer's vLLM release and GPU, where their rules give a value other bytes.

vLLM 0.32 and 0.33 publish the same keys with the same page formulas (MooncakeStoreConnector's
files are byte-identical); what changed are rules that decide the bytes, some on one GPU only
(read from vLLM 0.33.0's own code):

- ``Platform._align_hybrid_block_size`` (``vllm/platforms/interface.py``): in align mode the block
  is also a multiple of every Mamba layer's prefill checkpoint alignment
  (``get_mamba_prefill_checkpoint_alignment``). Qwen's Gated DeltaNet layers (Qwen3-Next, Qwen3.5
  and the wrappers around a Qwen3.5 text model) declare 64 when their prefill runs on FlashInfer
  (``FLASHINFER_GDN_CHECKPOINT_ALIGNMENT``), vLLM's auto choice on SM90, and on SM100/SM120 when
  ``linear_key_head_dim`` is 128 (with CUDA 13, what 0.33's torch 2.14 wheel runs on);
  ``_resolve_gdn_prefill_backend``. Qwen3.5-9B at TP 2: block 576, 9,437,184 B keys, not 528 and
  8,650,752 B. OLMo Hybrid's GDN layers declare none.
- ``VllmConfig._reject_mismatched_float_kv_cache``: an explicit ``--kv-cache-dtype`` float16 or
  bfloat16 unlike the model dtype is refused (0.32 served it).
- GLM-5.3-Flash's KV cache defaults to fp8 on SM10x, and Kimi-K3's RecoverSSM page lost two
  tensors: families the audit refuses (``vllm_models``), their reasons say so.

Platforms: ``cpu``, and the CUDA GPUs by the rules that differ among them: ``sm90`` (Hopper),
``sm100`` (Blackwell data centre, SM10x), ``sm120`` (SM12x), and ``cuda``: a CUDA GPU none of those
rules applies to (Ampere, Ada). An operator who says only ``cuda`` leaves every CUDA architecture
a candidate (``cuda_platforms``), so naming the platform never narrows what a healthy producer
may have written.
"""

from __future__ import annotations

from .model import LayoutError

VLLM_VERSIONS = ("0.32", "0.33")
PLATFORMS = ("cuda", "cpu", "sm90", "sm100", "sm120")
CUDA_PLATFORMS = ("cuda", "sm90", "sm100", "sm120")
DEFAULT_PLATFORM = "cuda"
DEFAULT_VLLM_VERSION = "0.32"  # the first candidate where the operator names none

FLASHINFER_GDN_CHECKPOINT_ALIGNMENT = 64
# (text) model types whose recurrent layers are Qwen's Gated DeltaNet (``QwenGatedDeltaNetAttention``)
_QWEN_GDN_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")
# SM90 always; SM100 and SM120 only with 128-wide GDN keys
_FLASHINFER_GDN_PLATFORMS = {"sm90": None, "sm100": 128, "sm120": 128}


def vllm_version(value: str | None) -> str | None:
    """A release as the audit's rules know it (``0.33.0`` and ``v0.33`` are ``0.33``); None: not given."""
    if value is None or not str(value).strip() or str(value).strip().lower() == "auto":
        return None
    parts = str(value).strip().lower().removeprefix("v").split("+")[0].split(".")
    release = ".".join(parts[:2])
    if release not in VLLM_VERSIONS:
        raise LayoutError(f"vLLM version {value!r}: the audit knows the rules of {', '.join(VLLM_VERSIONS)}")
    return release


def check_platform(platform: str) -> str:
    if platform not in PLATFORMS:
        raise LayoutError(f"platform {platform!r} is not one of {PLATFORMS}")
    return platform


def base_platform(platform: str) -> str:
    """``cpu`` or ``cuda``: what the dtype and block-size defaults follow."""
    return "cpu" if check_platform(platform) == "cpu" else "cuda"


def cuda_platforms(platform: str | None) -> tuple[str, ...]:
    """The platforms a producer said to run on ``platform`` may be (None: any)."""
    if platform is None:
        return PLATFORMS
    return CUDA_PLATFORMS if platform == "cuda" else (platform,)


def prefill_checkpoint_alignment(model_type: str | None, text: dict, version: str, platform: str) -> int:
    """vLLM's ``get_mamba_prefill_checkpoint_alignment`` for a model's Mamba layers (1: none)."""
    check_platform(platform)
    if version == "0.32" or model_type not in _QWEN_GDN_TYPES or platform not in _FLASHINFER_GDN_PLATFORMS:
        return 1
    key_dim = _FLASHINFER_GDN_PLATFORMS[platform]
    return FLASHINFER_GDN_CHECKPOINT_ALIGNMENT if key_dim in (None, text.get("linear_key_head_dim")) else 1


def rules_key(model_type: str | None, text: dict, version: str, platform: str,
              kv_cache_dtype: str | None) -> tuple:
    """What the version and platform decide for a model: two (version, platform) pairs with one key
    give the same bytes (the release matters beside them only where it may refuse the KV flag)."""
    refusable = kv_cache_dtype is not None and kv_cache_dtype.lower() in ("float16", "bfloat16", "half", "bf16", "fp16")
    return (base_platform(platform), prefill_checkpoint_alignment(model_type, text, version, platform),
            version if refusable else None)
