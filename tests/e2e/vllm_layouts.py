"""vLLM's own answer to "how is a value laid out": per-layer state shapes, dtypes and page sizes.

Run with .venv-vllm's python (it imports vLLM; no model weights are read, no engine starts):

    .venv-vllm/bin/python tests/e2e/vllm_layouts.py MODEL_DIR [--tp 2] [--dtype auto]
        [--mamba-cache-dtype auto] [--mamba-ssm-cache-dtype auto] [--block-size N]
        [--attention-backend CPU_ATTN]

prints one JSON object computed only with vLLM's code: the engine config vLLM resolves
(`EngineArgs.create_engine_config`: dtype rules, the platform's and the model's state-dtype
overrides), `get_mamba_state_shape_from_config` / `get_mamba_state_dtype_from_config` of the model
class (MambaStateShapeCalculator / MambaStateDtypeCalculator underneath), the attention
`FullAttentionSpec` as the backend customises it, and, for hybrids, the platform's page-size
unification (`_align_hybrid_block_size`: attention block raised, mamba page padded). This is the
reference side of the differential test of issue #11 §4; the region list (`mamba.regions`) is what
the audit's layout must reproduce per segment.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys


def _dtype_size(dtype) -> int:
    import torch

    return torch.tensor([], dtype=dtype).element_size()


def describe(args: argparse.Namespace) -> dict:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.models import ModelRegistry
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    engine_args = EngineArgs(model=args.model, skip_tokenizer_init=True, tensor_parallel_size=args.tp,
                             dtype=args.dtype, mamba_cache_dtype=args.mamba_cache_dtype,
                             mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype, enable_prefix_caching=True,
                             enforce_eager=True, max_model_len=args.max_model_len, block_size=args.block_size,
                             distributed_executor_backend="mp" if args.tp > 1 else None)
    config = engine_args.create_engine_config()
    model_config, cache_config, parallel_config = config.model_config, config.cache_config, config.parallel_config
    model_cls, architecture = ModelRegistry.resolve_model_cls(model_config.architecture, model_config=model_config)
    out: dict = {
        "model": os.path.basename(os.path.normpath(args.model)), "model_type": model_config.hf_config.model_type,
        "architecture": architecture, "tp": args.tp, "dtype": str(model_config.dtype).removeprefix("torch."),
        "is_hybrid": model_config.is_hybrid, "has_recurrent_state": bool(getattr(model_cls, "is_hybrid", False)
                                                                          or getattr(model_cls, "has_inner_state",
                                                                                     False)),
        "cache": {"block_size": cache_config.block_size, "cache_dtype": str(cache_config.cache_dtype),
                  "mamba_cache_dtype": str(cache_config.mamba_cache_dtype),
                  "mamba_ssm_cache_dtype": str(cache_config.mamba_ssm_cache_dtype),
                  "mamba_cache_mode": cache_config.mamba_cache_mode},
    }
    backend_cls = AttentionBackendEnum[args.attention_backend].get_class()
    kv_dtype = model_config.dtype
    mamba_spec = None
    if hasattr(model_cls, "get_mamba_state_shape_from_config"):
        shapes = model_cls.get_mamba_state_shape_from_config(config)
        dtypes = model_cls.get_mamba_state_dtype_from_config(config)
        mamba_spec = MambaSpec(shapes=tuple(tuple(s) for s in shapes), dtypes=tuple(dtypes), block_size=-1)
    if model_config.is_hybrid and mamba_spec is not None:
        # The unification the engine runs once the layers exist (Platform.update_block_size_for_backend)
        current_platform._align_hybrid_block_size(config, backend_cls)
        out["cache"]["block_size"] = cache_config.block_size
    out["cache"]["mamba_page_size_padded"] = cache_config.mamba_page_size_padded
    if mamba_spec is not None:
        regions, offset = [], 0
        names = ["conv", "ssm"] + [f"state{i}" for i in range(2, len(mamba_spec.shapes))]
        for name, shape, dtype in zip(names, mamba_spec.shapes, mamba_spec.dtypes):
            length = math.prod(shape) * _dtype_size(dtype)
            regions.append({"region": name, "shape": list(shape), "dtype": str(dtype).removeprefix("torch."),
                            "offset": offset, "length": length})
            offset += length
        page = cache_config.mamba_page_size_padded or offset
        if page > offset:
            regions.append({"region": "padding", "offset": offset, "length": page - offset})
        out["mamba"] = {"shapes": [list(s) for s in mamba_spec.shapes],
                        "dtypes": [str(d).removeprefix("torch.") for d in mamba_spec.dtypes],
                        "state_bytes": offset, "page_size_bytes": page, "regions": regions}
    num_attention = _layers(model_config, parallel_config, "attention")
    if num_attention or model_config.is_hybrid or mamba_spec is None:
        spec = FullAttentionSpec(block_size=cache_config.block_size,
                                 num_kv_heads=model_config.get_num_kv_heads(parallel_config),
                                 head_size=model_config.get_head_size(), dtype=kv_dtype)
        spec = backend_cls.customize_spec(spec)
        out["attention"] = {"backend": args.attention_backend, "num_kv_heads_per_rank": spec.num_kv_heads,
                            "head_size": spec.head_size, "dtype": str(spec.dtype).removeprefix("torch."),
                            "block_size": spec.block_size, "page_size_bytes": spec.page_size_bytes}
    out["layers"] = {"attention": num_attention, "mamba": _layers(model_config, parallel_config, "mamba"),
                     "total": model_config.get_num_layers(parallel_config),
                     # as the config says it (vLLM's counts above compare against its own names only)
                     "pattern": next((value for name in ("layers_block_type", "layer_types", "hybrid_override_pattern")
                                      if (value := getattr(model_config.hf_text_config, name, None)) is not None),
                                     None)}
    return out


def _layers(model_config, parallel_config, kind: str) -> int | None:
    try:
        return model_config.get_num_layers_by_block_type(parallel_config, kind)
    except Exception:  # a model type without a block-type table: unknown rather than wrong
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a directory with config.json")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--mamba-cache-dtype", default="auto")
    parser.add_argument("--mamba-ssm-cache-dtype", default="auto")
    parser.add_argument("--block-size", type=int, default=None)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--attention-backend", default="CPU_ATTN", help="an AttentionBackendEnum name")
    args = parser.parse_args(argv)
    import logging

    logging.disable(logging.WARNING)
    print(json.dumps(describe(args), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
