"""Which dtypes vLLM gives a model's caches when the operator passed no dtype flags.

Read from vLLM 0.32.0 (our own statement of its rules, see docs/layouts.md §2):

- model dtype (``--dtype auto``, ``vllm/config/model.py``): the config's ``dtype`` /
  ``torch_dtype``; a float32 checkpoint is downcast to the platform's first supported dtype
  (bfloat16 on CUDA and on a CPU with AVX-512 BF16). A config without a dtype counts as float32.
- conv state: ``--mamba-cache-dtype``, else the model dtype.
- ssm (temporal) state: ``--mamba-ssm-cache-dtype``; when not given, a per-model rule
  (``vllm/model_executor/models/config.py``): Nemotron-H takes the config's
  ``mamba_ssm_cache_dtype`` or float32, Qwen3.5 its config's ``mamba_ssm_dtype``; KDA (Kimi
  linear) states default to float32; everything else uses the conv dtype. The rules follow the
  architecture: a wrapper vLLM lists no rule for (MiniCPM-V 4.6/4.7 around Qwen3.5, the Nemotron
  Omni models around Nemotron-H) keeps the conv dtype.
- the CPU platform (``vllm/platforms/cpu.py``, on a CPU with AVX-512 BF16) then forces the ssm
  state to float32, unless the model has ``linear_attention`` layers (GDN) and the ssm dtype is
  16-bit by the operator's flag or the model's rule.
- attention KV: ``--kv-cache-dtype``, else the model dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

from .model import LayoutError, canonical_dtype
from .versions import DEFAULT_PLATFORM, base_platform

# model_type -> the ssm dtype vLLM picks when --mamba-ssm-cache-dtype is not given
_NEMOTRON_TYPES = ("nemotron_h",)
_QWEN35_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")
_KDA_TYPES = ("kimi_linear",)
# vLLM keys the per-model ssm rules by architecture (``MODELS_CONFIG_MAP``): these wrappers of a
# Qwen3.5 or Nemotron-H text model have no entry there, so their ssm state follows the conv dtype.
_NO_SSM_RULE_ARCHITECTURES = ("MiniCPMV4_6ForConditionalGeneration", "MiniCPMV4_7ForConditionalGeneration",
                              "InternS2PreviewForConditionalGeneration", "NemotronH_Nano_Omni_Reasoning_V3",
                              "NemotronH_Omni_Reasoning_V3", "NemotronH_Super_Omni_Reasoning_V3",
                              "MiniCPMOcrForConditionalGeneration")


def config_dtype(config: dict, text: dict | None = None) -> str:
    """The checkpoint's dtype from ``config.json`` (text config first); float32 when absent."""
    for source in (text, config):
        if not isinstance(source, dict):
            continue
        for name in ("dtype", "torch_dtype"):
            value = source.get(name)
            if isinstance(value, str) and value:
                try:
                    return canonical_dtype(value)
                except LayoutError:
                    raise LayoutError(f"config.json field {name!r}: unsupported dtype {value!r}") from None
    return "float32"


def auto_model_dtype(checkpoint_dtype: str) -> str:
    """vLLM's ``--dtype auto``: float32 checkpoints run in bfloat16, others as saved."""
    return "bfloat16" if checkpoint_dtype == "float32" else checkpoint_dtype


def _model_ssm_rule(model_type: str, text: dict, config: dict) -> str | None:
    if any(name in _NO_SSM_RULE_ARCHITECTURES for name in config.get("architectures") or ()):
        return None
    if model_type in _NEMOTRON_TYPES:
        return canonical_dtype(str(text.get("mamba_ssm_cache_dtype") or "float32"))
    if model_type in _QWEN35_TYPES and text.get("mamba_ssm_dtype"):
        return canonical_dtype(str(text["mamba_ssm_dtype"]))
    if model_type in _KDA_TYPES:
        return "float32"
    return None


@dataclass(frozen=True, slots=True)
class Dtypes:
    """The dtypes of one producer's caches, and the rule each came from."""

    model: str
    conv: str
    ssm: str
    kv: str
    why: tuple[str, ...] = ()

    def as_dict(self) -> dict:
        return {"model_dtype": self.model, "conv_dtype": self.conv, "ssm_dtype": self.ssm,
                "kv_dtype": self.kv}


def resolve_dtypes(*, model_type: str, text: dict, config: dict | None = None,
                   model_dtype: str | None = None, conv_dtype: str | None = None,
                   ssm_dtype: str | None = None, kv_cache_dtype: str | None = None,
                   platform: str = DEFAULT_PLATFORM) -> Dtypes:
    """vLLM's dtypes for a model; any argument given is the operator's flag and wins. ``platform``:
    one of ``versions.PLATFORMS`` (the dtype rules tell only CPU from CUDA)."""
    why = []
    if model_dtype is None:
        saved = config_dtype(config if config is not None else text, text)
        model = auto_model_dtype(saved)
        why.append(f"model dtype {model} from config.json dtype {saved} (vLLM --dtype auto)")
    else:
        model = canonical_dtype(model_dtype)
    conv = canonical_dtype(conv_dtype) if conv_dtype else model
    if ssm_dtype:
        ssm_setting = canonical_dtype(ssm_dtype)
    else:
        ssm_setting = _model_ssm_rule(model_type, text, config if config is not None else text)
        if ssm_setting is not None:
            why.append(f"ssm dtype {ssm_setting}: vLLM's rule for {model_type}")
    if base_platform(platform) == "cpu" and ssm_setting != "float32":
        gdn = "linear_attention" in (text.get("layer_types") or ())
        if not (gdn and ssm_setting in ("float16", "bfloat16")):
            ssm_setting = "float32"
            why.append("ssm dtype float32: vLLM's CPU platform")
    ssm = ssm_setting or conv
    kv = canonical_dtype(kv_cache_dtype) if kv_cache_dtype else model
    return Dtypes(model, conv, ssm, kv, tuple(why))
