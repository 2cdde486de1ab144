"""Differential test (issue #11 §4): our layouts against what vLLM's own code computes.

Skipped unless vLLM is importable: run it in the real-vLLM venv,

    .venv-vllm/bin/python -m pytest -q tests/layouts/test_against_vllm.py

For every config of a matrix (the families we model x TP 1/2/4 x model dtype), vLLM resolves its
engine config on this platform (``EngineArgs.create_engine_config``: dtype rules, the model's and
the CPU platform's state-dtype overrides, the CPU default block size), then its own code gives the
state shapes and dtypes (``get_mamba_state_shape_from_config`` / ``get_mamba_state_dtype_from_config``
of the model class: MambaStateShapeCalculator / MambaStateDtypeCalculator), the hybrid page-size
unification (``Platform._align_hybrid_block_size`` with the CPU attention backend) and the
attention page (``FullAttentionSpec.page_size_bytes``). Our layout, built from the same
config.json with ``platform="cpu"``, must give the same region shapes, dtypes, offsets and sizes,
the same page sizes and the same attention block. Any difference fails.
"""

from __future__ import annotations

import logging
import math
import os

import pytest

vllm = pytest.importorskip("vllm")

from audit.layouts import layouts_from_hf_config, load_hf_config  # noqa: E402
from audit.layouts.dtypes import resolve_dtypes  # noqa: E402
from audit.layouts.hf_config import model_type_of  # noqa: E402

COMMON = dict(vocab_size=256, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
              max_position_embeddings=4096)

# model_type -> (architecture, config kwargs); sized so that TP 1, 2 and 4 all divide
FAMILIES = {
    "llama": ("LlamaForCausalLM", dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=64)),
    "qwen3": ("Qwen3ForCausalLM", dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=4, head_dim=64)),
    "mamba": ("MambaForCausalLM", dict(hidden_size=64, num_hidden_layers=2, state_size=16, expand=2,
                                       conv_kernel=4, intermediate_size=128)),
    "mamba2": ("Mamba2ForCausalLM", dict(hidden_size=64, num_hidden_layers=2, state_size=16, num_heads=8,
                                         head_dim=16, expand=2, n_groups=1, conv_kernel=4, chunk_size=16)),
    "nemotron_h": ("NemotronHForCausalLM", dict(
        hidden_size=64, layers_block_type=["mamba", "attention", "mamba", "mlp"], num_attention_heads=4,
        num_key_value_heads=4, head_dim=64, intermediate_size=128, ssm_state_size=16, mamba_num_heads=8,
        mamba_head_dim=16, n_groups=2, conv_kernel=4, expand=2, chunk_size=16)),
    "falcon_h1": ("FalconH1ForCausalLM", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        head_dim=64, mamba_d_ssm=128, mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=16,
        mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16)),
    "lfm2": ("Lfm2ForCausalLM", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
        conv_L_cache=3, block_auto_adjust_ff_dim=False, layer_types=["conv", "full_attention", "conv"],
        conv_dim=64, block_dim=64)),
    "qwen3_next": ("Qwen3NextForCausalLM", dict(
        hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
        head_dim=64, linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_num_key_heads=4, linear_num_value_heads=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"], num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=64, shared_expert_intermediate_size=64, decoder_sparse_step=1)),
    "jamba": ("JambaForCausalLM", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
        attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1, num_experts=2,
        mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=8, use_mamba_kernels=False)),
    "granitemoehybrid": ("GraniteMoeHybridForCausalLM", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
        layer_types=["mamba", "attention", "mamba", "mamba"], mamba_n_heads=8, mamba_d_head=16,
        mamba_n_groups=1, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, num_local_experts=2,
        num_experts_per_tok=1, shared_intermediate_size=128)),
}
DTYPES = ("auto", "float32")
GDN_BF16_ONLY = {"qwen3_next"}  # "CPU GDN attention requires BF16"


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    import torch
    import transformers

    base = tmp_path_factory.mktemp("configs")
    made = {}
    for model_type, (architecture, kwargs) in FAMILIES.items():
        config = transformers.AutoConfig.for_model(model_type, **COMMON, **kwargs)
        config.architectures = [architecture]
        config.dtype = torch.bfloat16
        path = base / f"{model_type}-tiny"
        config.save_pretrained(path)
        made[model_type] = path
    return made


def _vllm_answer(path, tp: int, dtype: str) -> dict:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    logging.disable(logging.WARNING)
    import torch
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.models import ModelRegistry
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    config = EngineArgs(model=str(path), skip_tokenizer_init=True, tensor_parallel_size=tp, dtype=dtype,
                        enable_prefix_caching=True, enforce_eager=True, max_model_len=2048,
                        distributed_executor_backend="mp" if tp > 1 else None).create_engine_config()
    model_config, cache_config = config.model_config, config.cache_config
    model_cls, _ = ModelRegistry.resolve_model_cls(model_config.architecture, model_config=model_config)
    backend = AttentionBackendEnum["CPU_ATTN"].get_class()
    answer: dict = {"model_dtype": str(model_config.dtype).removeprefix("torch.")}
    if hasattr(model_cls, "get_mamba_state_shape_from_config"):
        shapes = model_cls.get_mamba_state_shape_from_config(config)
        dtypes = model_cls.get_mamba_state_dtype_from_config(config)
        spec = MambaSpec(shapes=tuple(tuple(s) for s in shapes), dtypes=tuple(dtypes), block_size=-1)
        if model_config.is_hybrid:
            current_platform._align_hybrid_block_size(config, backend)
        regions, offset = [], 0
        for name, shape, state_dtype in zip(("conv", "ssm"), spec.shapes, spec.dtypes):
            length = math.prod(shape) * torch.tensor([], dtype=state_dtype).element_size()
            regions.append((name, tuple(shape), str(state_dtype).removeprefix("torch."), offset, length))
            offset += length
        answer["state_regions"] = regions
        answer["state_page"] = cache_config.mamba_page_size_padded or spec.page_size_bytes
    kv_dtype = model_config.dtype
    attention = FullAttentionSpec(block_size=cache_config.block_size,
                                  num_kv_heads=model_config.get_num_kv_heads(config.parallel_config),
                                  head_size=model_config.get_head_size(), dtype=kv_dtype)
    answer["attention"] = {"block_size": cache_config.block_size, "dtype": str(kv_dtype).removeprefix("torch."),
                           "page": attention.page_size_bytes, "heads": attention.num_kv_heads}
    return answer


def _ours(path, tp: int, dtype: str) -> dict:
    config = load_hf_config(path)
    model_dtype = None if dtype == "auto" else dtype
    layouts = layouts_from_hf_config(config, model=path.name, tp_size=tp, platform="cpu", model_dtype=model_dtype)
    text, model_type = model_type_of(config)
    ours: dict = {"model_dtype": resolve_dtypes(model_type=model_type, text=text, config=config,
                                                model_dtype=model_dtype, platform="cpu").model}
    for layout in layouts:
        segment = next(segment for segment in layout.segments if segment.layer >= 0)
        if layout.kind == "attention":
            (kv,) = segment.regions
            ours["attention"] = {"block_size": kv.shape[1], "dtype": kv.dtype, "page": segment.length,
                                 "heads": kv.shape[0]}
        else:
            ours["state_regions"] = [(region.name, region.shape, region.dtype, region.offset - segment.offset,
                                      region.length) for region in segment.regions if region.kind == "state"]
            ours["state_page"] = segment.length
    return ours


MATRIX = [(family, tp, dtype) for family in FAMILIES for tp in (1, 2, 4) for dtype in DTYPES
          if not (dtype == "float32" and family in GDN_BF16_ONLY)]


@pytest.mark.parametrize("family, tp, dtype", MATRIX, ids=[f"{f}-tp{t}-{d}" for f, t, d in MATRIX])
def test_layout_matches_vllm(model_dirs, family, tp, dtype):
    path = model_dirs[family]
    theirs = _vllm_answer(path, tp, dtype)
    ours = _ours(path, tp, dtype)
    if "state_regions" not in theirs:  # attention only: vLLM's attention page is the whole story
        ours.pop("state_regions", None)
        ours.pop("state_page", None)
    if "attention" not in ours:  # pure state model: no attention page in its values
        theirs.pop("attention")
    assert ours == theirs
