"""Ground truth of SGLang's own Mamba/linear-state geometry.

Run with the SGLang Python (not under pytest):

    .venv-sglang/bin/python tests/producers/sglang_mamba_geometry.py

For tiny configs of each hybrid family SGLang serves with a Mamba pool, this
goes the way SGLang's model loader goes:

  config.json in a temp dir
    -> sglang.srt.utils.hf_transformers.config.get_config(dir)   (the loader;
       picks the class from sglang's _CONFIG_REGISTRY / CONFIG_MAPPING)
    -> sglang.srt.configs.hybrid_arch.mambaish_config(model_config)
       (what KVCacheConfigurator and pool_configurator call)
    -> <config>.mamba2_cache_params   (Mamba2CacheParams: .layers, .shape.conv,
       .shape.temporal, .dtype.conv, .dtype.temporal)
    -> <config>.full_attention_layer_ids  (the KV pool's layers)

under get_parallel().override(tp_size=N, attn_tp_size=N, ...) for N in 1, 2.
It prints ONE JSON line. Nothing here touches a GPU or a store.

The Mamba-state dtypes are read by sglang.srt.configs.mamba_utils.
mamba2_state_dtype(config): conv = env SGLANG_MAMBA_CONV_DTYPE (default
"bfloat16", independent of the model dtype); temporal = float32, else
config.mamba_ssm_dtype (or text_config.mamba_ssm_dtype), else env
SGLANG_MAMBA_SSM_DTYPE, which the server arg --mamba-ssm-dtype sets
(arg_groups/serving_hook.py handle_environment_variables). The script runs
with whatever those env vars are in its environment and reports them.
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
import traceback
import types

TP_SIZES = (1, 2)
PAGE_SIZE = 1  # bytes are reported per slot; multiply by the page size

# Fields every tiny config shares (each family adds its own).
_BASE = {
    "torch_dtype": "bfloat16",
    "vocab_size": 1024,
    "hidden_size": 256,
}

FAMILIES = {
    # Qwen3-Next (GDN). Field names as in Qwen/Qwen3-Next-80B-A3B-Instruct.
    # SGLang decides layer kinds from full_attention_interval only
    # (Qwen3NextConfig.layers_block_type); layer_types is given consistently.
    "qwen3_next_gdn": {
        **_BASE,
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "intermediate_size": 512,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "full_attention_interval": 4,
        "layer_types": [
            "linear_attention",
            "linear_attention",
            "linear_attention",
            "full_attention",
        ],
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 48,
        "linear_conv_kernel_dim": 4,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 64,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "partial_rotary_factor": 0.25,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
    },
    # Nemotron-H (Mamba2). Field names as in nvidia/NVIDIA-Nemotron-Nano-9B-v2
    # (hybrid_override_pattern, mamba_num_heads, mamba_head_dim, n_groups,
    # ssm_state_size, conv_kernel, expand).
    "nemotron_h_mamba2": {
        **_BASE,
        "architectures": ["NemotronHForCausalLM"],
        "model_type": "nemotron_h",
        "intermediate_size": 512,
        "num_hidden_layers": 4,
        "hybrid_override_pattern": "M-M*",
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "mamba_num_heads": 8,
        "mamba_head_dim": 64,
        "n_groups": 2,
        "ssm_state_size": 32,
        "conv_kernel": 4,
        "expand": 2,
        "chunk_size": 128,
        "mamba_hidden_act": "silu",
        "max_position_embeddings": 4096,
    },
    # Same, but the SGLang-canonical constructor names (mamba_n_groups,
    # mamba_d_conv) instead of the HF checkpoint names (n_groups, conv_kernel).
    "nemotron_h_mamba2_canonical_names": {
        **_BASE,
        "architectures": ["NemotronHForCausalLM"],
        "model_type": "nemotron_h",
        "intermediate_size": 512,
        "layers_block_type": ["mamba", "mlp", "mamba", "attention"],
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "mamba_num_heads": 8,
        "mamba_head_dim": 64,
        "mamba_n_groups": 2,
        "ssm_state_size": 32,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
        "max_position_embeddings": 4096,
    },
    # LFM2 (short conv). Field names as in LiquidAI/LFM2-350M.
    "lfm2_short_conv": {
        **_BASE,
        "architectures": ["Lfm2ForCausalLM"],
        "model_type": "lfm2",
        "intermediate_size": 512,
        "block_ff_dim": 512,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "layer_types": ["conv", "conv", "full_attention", "conv"],
        "conv_L_cache": 3,
        "conv_bias": False,
        "max_position_embeddings": 4096,
    },
    # Falcon-H1 (parallel hybrid: attention AND mamba2 in every layer).
    # Field names as in tiiuae/Falcon-H1-0.5B-Instruct.
    "falcon_h1_mamba2": {
        **_BASE,
        "architectures": ["FalconH1ForCausalLM"],
        "model_type": "falcon_h1",
        "intermediate_size": 512,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "mamba_d_ssm": 512,
        "mamba_n_heads": 8,
        "mamba_d_head": 64,
        "mamba_n_groups": 1,
        "mamba_d_state": 32,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
        "mamba_chunk_size": 128,
        "max_position_embeddings": 4096,
    },
    # Plain Mamba2 (Mamba-Codestral style). transformers' Mamba2Config has no
    # intermediate_size; SGLang's Mamba2Config.mamba2_cache_params reads it.
    "mamba2_pure": {
        **_BASE,
        "architectures": ["Mamba2ForCausalLM"],
        "model_type": "mamba2",
        "num_hidden_layers": 4,
        "num_heads": 8,
        "head_dim": 64,
        "n_groups": 2,
        "state_size": 32,
        "conv_kernel": 4,
        "expand": 2,
        "chunk_size": 128,
    },
    # Qwen3-Next variants: layer_types that disagree with
    # full_attention_interval, and layer_types alone (no interval).
    "qwen3_next_gdn_layer_types_disagree": None,  # filled below
    "qwen3_next_gdn_layer_types_only": None,  # filled below
}


_q = FAMILIES["qwen3_next_gdn"]
FAMILIES["qwen3_next_gdn_layer_types_disagree"] = dict(
    _q,
    full_attention_interval=2,
    layer_types=[
        "linear_attention",
        "linear_attention",
        "linear_attention",
        "full_attention",
    ],
)
FAMILIES["qwen3_next_gdn_layer_types_only"] = {
    k: v for k, v in _q.items() if k != "full_attention_interval"
}
FAMILIES["mamba2_pure_with_intermediate_size"] = dict(FAMILIES["mamba2_pure"], intermediate_size=512)

# dtype probes at TP 1: (family, extra config fields, env overrides)
DTYPE_PROBES = [
    (fam, extra, env)
    for fam in (
        "qwen3_next_gdn",
        "nemotron_h_mamba2",
        "lfm2_short_conv",
        "falcon_h1_mamba2",
        "mamba2_pure_with_intermediate_size",
    )
    for extra, env in (
        ({"mamba_ssm_dtype": "bfloat16"}, {}),
        ({}, {"SGLANG_MAMBA_SSM_DTYPE": "bfloat16"}),
        ({"mamba_ssm_dtype": "bfloat16"}, {"SGLANG_MAMBA_SSM_DTYPE": "float32"}),
        ({"torch_dtype": "float16"}, {}),
        ({}, {"SGLANG_MAMBA_CONV_DTYPE": "float16"}),
    )
]


def _dtype_name(dt) -> str:
    return str(dt).replace("torch.", "")


def _itemsize(dt) -> int:
    return int(dt.itemsize)


def _load_config(cfg_dict, get_config):
    d = tempfile.mkdtemp(prefix="sglang_mamba_geom_")
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg_dict, f)
    return get_config(d, trust_remote_code=False)


def _fake_model_config(hf_config):
    # The attributes hybrid_arch.mambaish_config reads from ModelConfig.
    return types.SimpleNamespace(
        hf_config=hf_config,
        is_draft_model=False,
        linear_attn_registry_result=None,
    )


def _one(name, cfg_dict, tp, get_config, get_parallel, hybrid_arch):
    from sglang.srt.runtime_context import linear_attn_tp_size

    out = {"tp": tp}
    with get_parallel().override(
        tp_size=tp,
        attn_tp_size=tp,
        attn_dp_size=1,
        attn_cp_size=1,
        enable_cp_tp_group_sharing=False,
    ):
        hf = _load_config(cfg_dict, get_config)
        out["config_class"] = f"{type(hf).__module__}.{type(hf).__qualname__}"
        mc = _fake_model_config(hf)
        which = None
        for fn in (
            "mamba2_config",
            "hybrid_gdn_config",
            "hybrid_kda_config",
            "hybrid_lightning_config",
        ):
            got = getattr(hybrid_arch, fn)(mc)
            if got is not None:
                which = fn
                break
        state_cfg = hybrid_arch.mambaish_config(mc)
        out["mambaish_config_via"] = which
        out["linear_attn_tp_size"] = linear_attn_tp_size()
        cp = state_cfg.mamba2_cache_params
        if cp is None:
            out["mamba2_cache_params"] = None
            return out
        mamba_layers = [int(i) for i in cp.layers]
        attn_layers = [int(i) for i in state_cfg.full_attention_layer_ids]
        n_layers = int(getattr(state_cfg, "num_hidden_layers", 0) or 0)
        conv_shapes = [list(map(int, s)) for s in cp.shape.conv]
        temporal = list(map(int, cp.shape.temporal))
        cdt, tdt = cp.dtype.conv, cp.dtype.temporal
        temporal_bytes_per_layer = math.prod(temporal) * _itemsize(tdt)
        conv_bytes_per_layer = [math.prod(s) * _itemsize(cdt) for s in conv_shapes]
        out.update(
            {
                "cache_params_class": type(cp).__name__,
                "shape_class": type(cp.shape).__name__,
                "num_hidden_layers": n_layers,
                "mamba_layer_ids": mamba_layers,
                "num_mamba_layers": len(mamba_layers),
                "full_attention_layer_ids": attn_layers,
                "num_attention_layers": len(attn_layers),
                "temporal_state_shape": temporal,
                "conv_state_shapes": conv_shapes,
                "temporal_dtype": _dtype_name(tdt),
                "conv_dtype": _dtype_name(cdt),
                "shape_fields": {
                    k: getattr(cp.shape, k)
                    for k in (
                        "intermediate_size",
                        "conv_dim",
                        "num_heads",
                        "head_dim",
                        "state_size",
                        "conv_kernel",
                        "num_k_heads_per_tp",
                        "conv_shard_groups",
                        "disable_conv_window_dedup",
                    )
                    if hasattr(cp.shape, k)
                },
                "temporal_bytes_per_slot_per_layer": temporal_bytes_per_layer,
                "conv_bytes_per_slot_per_layer": conv_bytes_per_layer,
                # HiCache keys for one page of PAGE_SIZE slots, as the brief
                # describes MambaPoolHost: page x layers x state x itemsize.
                "temporal_key_bytes_per_slot": len(mamba_layers)
                * temporal_bytes_per_layer,
                "conv_key_bytes_per_slot": [
                    len(mamba_layers) * b for b in conv_bytes_per_layer
                ],
                "mamba_cache_per_req": int(cp.mamba_cache_per_req),
            }
        )
    return out


def main() -> int:
    import logging

    logging.disable(logging.WARNING)
    import torch
    import sglang
    from sglang.srt.configs import hybrid_arch
    from sglang.srt.environ import envs
    from sglang.srt.runtime_context import get_parallel
    from sglang.srt.utils.hf_transformers.config import get_config
    import transformers

    result = {
        "sglang_version": getattr(sglang, "__version__", None),
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "env": {
            "SGLANG_MAMBA_CONV_DTYPE": os.environ.get("SGLANG_MAMBA_CONV_DTYPE"),
            "SGLANG_MAMBA_SSM_DTYPE": os.environ.get("SGLANG_MAMBA_SSM_DTYPE"),
            "SGLANG_USE_CPU_ENGINE": os.environ.get("SGLANG_USE_CPU_ENGINE"),
            "resolved_conv_env": envs.SGLANG_MAMBA_CONV_DTYPE.get(),
            "resolved_ssm_env": envs.SGLANG_MAMBA_SSM_DTYPE.get(),
        },
        "page_size_for_bytes": PAGE_SIZE,
        "families": {},
    }
    for name, cfg in FAMILIES.items():
        fam = {"config": cfg, "per_tp": {}}
        for tp in TP_SIZES:
            try:
                fam["per_tp"][str(tp)] = _one(
                    name, cfg, tp, get_config, get_parallel, hybrid_arch
                )
            except Exception as e:  # record, keep going
                fam["per_tp"][str(tp)] = {
                    "tp": tp,
                    "error": f"{type(e).__name__}: {e}",
                    "where": traceback.format_exc().strip().splitlines()[-3:],
                }
        result["families"][name] = fam
    probes = []
    for fam, extra, env in DTYPE_PROBES:
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            o = _one(fam, dict(FAMILIES[fam], **extra), 1, get_config,
                     get_parallel, hybrid_arch)
            probes.append(
                {"family": fam, "config_extra": extra, "env": env,
                 "temporal_dtype": o["temporal_dtype"],
                 "conv_dtype": o["conv_dtype"]}
            )
        except Exception as e:
            probes.append({"family": fam, "config_extra": extra, "env": env,
                           "error": f"{type(e).__name__}: {e}"})
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    result["dtype_probes_tp1"] = probes
    sys.stdout.write(json.dumps(result, default=str, sort_keys=False) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
