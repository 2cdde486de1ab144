"""What the operator passed to `vllm serve`, spelled as vLLM spells it.

The flags that decide a value's layout (``--dtype``, ``--kv-cache-dtype``, ``--mamba-cache-dtype``,
``--mamba-ssm-cache-dtype``, ``--block-size``, ``--tensor-parallel-size``) come from the command
line or from the YAML file ``vllm serve --config FILE`` reads (keys with dashes or underscores).
A flag given on the audit's command line wins over the file; ``auto`` means "not given": vLLM's
own rule decides, and the audit then considers every reading that rule allows.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from pathlib import Path

from .model import LayoutError

AUTO = "auto"
# vLLM's YAML key -> our field
_FILE_KEYS = {"dtype": "model_dtype", "kv_cache_dtype": "kv_cache_dtype", "mamba_cache_dtype": "state_dtype",
              "mamba_ssm_cache_dtype": "ssm_dtype", "block_size": "block_size",
              "tensor_parallel_size": "tp_size"}


@dataclass(frozen=True, slots=True)
class ServeFlags:
    """The layout-deciding settings of one vLLM deployment; None: not given (vLLM's default)."""

    model_dtype: str | None = None
    kv_cache_dtype: str | None = None
    state_dtype: str | None = None
    ssm_dtype: str | None = None
    block_size: int | None = None
    tp_size: int | None = None

    def over(self, base: ServeFlags) -> ServeFlags:
        """These flags, and `base`'s where these say nothing."""
        return replace(base, **{f.name: getattr(self, f.name) for f in fields(self)
                                if getattr(self, f.name) is not None})

    @classmethod
    def given(cls, **values) -> ServeFlags:
        """Flags as typed: ``auto`` (any case) is the same as not giving the flag."""
        return cls(**{name: None if isinstance(value, str) and value.strip().lower() == AUTO else value
                      for name, value in values.items()})


def _as_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)) or not str(value).strip().isdigit():
        raise LayoutError(f"vLLM config {name}: expected a positive integer, got {value!r}")
    return int(value)


def read_serve_config(path: Path) -> ServeFlags:
    """The layout flags in a `vllm serve --config` YAML file (other keys are vLLM's business)."""
    import yaml

    try:
        document = yaml.safe_load(Path(path).read_text())
    except OSError as error:
        raise LayoutError(f"--vllm-config {path}: {error.strerror or error}") from None
    except yaml.YAMLError as error:
        raise LayoutError(f"--vllm-config {path}: not YAML ({str(error).splitlines()[0]})") from None
    if document is None:
        return ServeFlags()
    if not isinstance(document, dict):
        raise LayoutError(f"--vllm-config {path}: expected a mapping of vLLM options, got {type(document).__name__}")
    values = {}
    for key, value in document.items():
        name = _FILE_KEYS.get(str(key).replace("-", "_"))
        if name is None or value is None:
            continue
        values[name] = _as_int(str(key), value) if name in ("block_size", "tp_size") else str(value)
    return ServeFlags.given(**values)


def version_refusal(version: str, kv_cache_dtype: str | None, model_dtype: str) -> str | None:
    """Why vLLM ``version`` refuses to start with these dtypes (None: it starts). 0.33's
    ``VllmConfig._reject_mismatched_float_kv_cache``: an explicit float16/bfloat16 KV cache unlike
    the model dtype (0.32 served it, casting the cache)."""
    if version == "0.32" or kv_cache_dtype not in ("float16", "bfloat16") or kv_cache_dtype == model_dtype:
        return None
    return (f"vLLM {version} refuses --kv-cache-dtype {kv_cache_dtype} with model dtype {model_dtype} "
            f"(it takes auto or the model dtype); no producer of that release wrote these values")
