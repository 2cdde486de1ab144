"""Tiny random-weight models for the real-vLLM harness, made at test time (nothing is downloaded).

Run with .venv-vllm's python (transformers comes with vLLM): ``python tests/e2e/models.py OUT_DIR
[NAME ...]`` writes one directory per model, named as an operator would name a checkpoint
directory (vLLM keys carry the basename of the model path), and prints a JSON summary.

Each model's ``MODELS`` entry says what vLLM needs to serve it on the CPU build (FACTS §8):
``mamba`` (align mode), ``block_size``, and whether the CPU build runs it at all.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

VOCAB = 512


@dataclass(frozen=True)
class TinyModel:
    name: str                 # directory basename: the model field of every key
    family: str               # model_type
    dtype: str                # the checkpoint's dtype (config.json torch_dtype/dtype)
    mamba: bool               # has recurrent state: served with mamba_cache_mode="align"
    block_size: int | None    # what the harness asks vLLM for (None: vLLM's choice)
    serve_dtype: str | None = None  # LLM(dtype=...): None is vLLM's "auto" (a float32 checkpoint then runs in bf16)
    runs_on_cpu: bool = True
    why_not: str = ""
    config_extra: dict = field(default_factory=dict)  # keys added to config.json after saving
    config_args: dict = field(default_factory=dict)   # overrides of the transformers config's arguments
    weight_renames: tuple = ()  # (old, new) substrings of saved tensor names: the names vLLM's loader reads
    random_biases: bool = False  # biases drawn like the weights (transformers initialises them to zero)


MODELS: dict[str, TinyModel] = {m.name: m for m in [
    TinyModel("mamba2-tiny", "mamba2", "float32", mamba=True, block_size=16, serve_dtype="float32"),
    # in_proj biased (use_bias, random biases): the conv rows' images carry in_proj's xBC bias
    TinyModel("mamba2-tiny-bf16", "mamba2", "bfloat16", mamba=True, block_size=16, random_biases=True,
              config_args={"use_bias": True}),
    TinyModel("llama-tiny", "llama", "bfloat16", mamba=False, block_size=32),
    TinyModel("nemotron-h-tiny", "nemotron_h", "bfloat16", mamba=True, block_size=None),
    TinyModel("falcon-h1-tiny", "falcon_h1", "bfloat16", mamba=True, block_size=None),
    # vLLM 0.32.0 reads the pre-transformers-5 names conv_dim / block_dim
    TinyModel("lfm2-tiny", "lfm2", "bfloat16", mamba=True, block_size=None,
              config_extra={"conv_dim": 64, "block_dim": 64}),
    # CPU GDN attention requires bfloat16; linear head dims 128 (chunk_gated_delta_rule_cpu)
    TinyModel("qwen3-next-tiny", "qwen3_next", "bfloat16", mamba=True, block_size=None),
    TinyModel("mamba-tiny", "mamba", "float32", mamba=True, block_size=16, runs_on_cpu=False,
              why_not="Mamba1: the CPU build has no selective_scan_fwd kernel"),
]}

# Only in tests/e2e/test_tp2.py (not the TP 1 matrix of test_vllm_e2e.py). TP 2 needs the attention
# heads divisible by 2. With 2 KV heads, TP 2 shards the attention (one head per rank, keys tp_rank:0
# and 1); with 1 KV head it is replicated (keys tp_rank:0 only).
TP2_MODELS: dict[str, TinyModel] = {m.name: m for m in [
    TinyModel("llama-tiny-kv2", "llama", "bfloat16", mamba=False, block_size=32,
              config_args={"num_key_value_heads": 2}),
    TinyModel("nemotron-h-tiny-tp2", "nemotron_h", "bfloat16", mamba=True, block_size=None,
              config_args={"num_attention_heads": 2}),
]}
# Only in tests/e2e/test_served_dtypes.py (issue #19): hybrid families and sizes no other test uses.
# Granite 4.0 hybrid (granitemoehybrid): hidden 128, 4 heads / 2 KV heads of 32, Mamba2 with 8 heads
# of 32, d_state 32 and n_groups 2 (so TP 2 splits the groups, not replicates them), 4 MoE experts.
# Zamba2: every layer a Mamba2 mixer; "hybrid" layers also run the shared attention block (one KV
# cache per hybrid layer in vLLM). transformers 5 saves layers_block_type "mamba" as "linear_attention".
NEW_FAMILY_MODELS: dict[str, TinyModel] = {m.name: m for m in [
    TinyModel("granite-4h-tiny", "granitemoehybrid", "bfloat16", mamba=True, block_size=None),
    TinyModel("zamba2-tiny", "zamba2", "bfloat16", mamba=True, block_size=None,
              config_args={"layers_block_type": ["mamba"] * 4}),
    TinyModel("zamba2-hybrid-tiny", "zamba2", "bfloat16", mamba=True, block_size=None,
              config_args={"layers_block_type": ["mamba", "hybrid", "mamba", "hybrid"]}),
]}
# Only in tests/e2e/test_new_families_e2e.py (issue #30): MLA and OLMo Hybrid. The CPU MLA decode kernel
# compiles for a 576-wide latent only (kv_lora_rank 512 + qk_rope_head_dim 64, CPUMLABackend), and the
# CPU platform forces its block to 16; 2 heads so TP 2 runs. OLMo Hybrid's GDN layers follow the CPU GDN
# rules (bfloat16, linear head dims 128), its attention heads hidden/heads = 64 wide; its GDN core runs
# on vLLM's CPU GDN op through the shim plugin (MOONCAKE_AUDIT_E2E_OLMO_CPU), which needs
# linear_allow_neg_eigval false.
LAYOUT_30_MODELS: dict[str, TinyModel] = {m.name: m for m in [
    TinyModel("deepseek-v3-tiny", "deepseek_v3", "float32", mamba=False, block_size=None, serve_dtype="float32"),
    TinyModel("deepseek-v3-tiny-bf16", "deepseek_v3", "bfloat16", mamba=False, block_size=None),
    # transformers 5 saves OLMo Hybrid's norms as attention_layer_norm / feedforward_layer_norm,
    # names vLLM 0.32's OlmoHybridModel mapper does not know (it loads input_layernorm /
    # post_attention_layernorm)
    TinyModel("olmo-hybrid-tiny", "olmo_hybrid", "bfloat16", mamba=True, block_size=None,
              weight_renames=(("attention_layer_norm", "input_layernorm"),
                              ("feedforward_layer_norm", "post_attention_layernorm"))),
]}
# Only in tests/e2e/test_binding_e2e.py (issue #40): Falcon-H1 with muP multipliers other than 1 (the
# released models' are), so that the layer-0 image rule is proved with each of them in play.
BINDING_MODELS: dict[str, TinyModel] = {m.name: m for m in [
    TinyModel("falcon-h1-mup-tiny", "falcon_h1", "bfloat16", mamba=True, block_size=None,
              config_args={"embedding_multiplier": 4.0, "ssm_in_multiplier": 0.5,
                           "ssm_multipliers": [1.0, 2.0, 0.5, 1.5, 1.0]}),
    # Qwen3-Next with 2 key-head groups of 2 value heads: in_proj_qkvz's interleaving shows, and TP 2
    # gives each rank one group
    TinyModel("qwen3-next-tiny-gqa", "qwen3_next", "bfloat16", mamba=True, block_size=None,
              config_args={"linear_num_key_heads": 2, "linear_num_value_heads": 4}),
    # Qwen3.5's text model: flat in_proj_qkv (vLLM's gqa_interleaved_layout=False); 2 key heads, so
    # TP 2 gives each rank its share of q, k and v
    TinyModel("qwen3-5-tiny", "qwen3_5_text", "bfloat16", mamba=True, block_size=None),
    # Mamba1, served with the shim plugin's CPU scan (MOONCAKE_AUDIT_E2E_MAMBA1_CPU; the CPU build has
    # no selective_scan_fwd): mamba-tiny's shape, both checkpoint dtypes
    TinyModel("mamba1-tiny", "mamba", "float32", mamba=True, block_size=16, serve_dtype="float32"),
    TinyModel("mamba1-tiny-bf16", "mamba", "bfloat16", mamba=True, block_size=16),
    TinyModel("falcon-mamba-tiny", "falcon_mamba", "bfloat16", mamba=True, block_size=16),
    TinyModel("jamba-tiny", "jamba", "bfloat16", mamba=True, block_size=None),
    # LFM2 with conv_bias (random biases): its in_proj biases B and x before their product
    TinyModel("lfm2-tiny-bias", "lfm2", "bfloat16", mamba=True, block_size=None, random_biases=True,
              config_args={"conv_bias": True}, config_extra={"conv_dim": 64, "block_dim": 64}),
]}
# Only in tests/e2e/test_binding_e2e.py (issue #40): attention models whose layer 0 vLLM computes
# otherwise than Llama's: Qwen2's biased qkv_proj (and its K turned by YaRN), Gemma 3's normalizer and 1 + w norm (layer 0
# sliding), Granite's embedding multiplier (and dynamic NTK rope), Phi-3's fused qkv_proj (TP 2, LongRoPE), OLMo2's missing pre-norm (vLLM's
# Transformers backend). Head dim 64: the CPU attention's.
ATTENTION_BINDING_MODELS: dict[str, TinyModel] = {m.name: m for m in [
    TinyModel("qwen2-tiny", "qwen2", "bfloat16", mamba=False, block_size=32, random_biases=True,
              config_args={"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                "original_max_position_embeddings": 1024}}),  # long-context Qwen2's YaRN
    TinyModel("gemma3-tiny", "gemma3_text", "bfloat16", mamba=False, block_size=32),
    TinyModel("granite-tiny", "granite", "bfloat16", mamba=False, block_size=32,
              config_args={"rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0,
                                                "max_trained_positions": 2048}}),  # dynamic NTK: another base
    TinyModel("olmo2-tiny", "olmo2", "bfloat16", mamba=False, block_size=32,
              config_args={"num_key_value_heads": 2}),  # its k_norm over both KV heads (one would be per head)
    TinyModel("phi3-tiny-kv2", "phi3", "bfloat16", mamba=False, block_size=32,
              config_args={"num_key_value_heads": 2,  # served at TP 2: a KV head a rank
                           # Phi-3's long-context LongRoPE: max_model_len 2048 > 1,024, so its long factors
                           "original_max_position_embeddings": 1024,  # (transformers copies it into the rope's)
                           "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0,
                                               "original_max_position_embeddings": 1024,
                                               "short_factor": [1.0 + i / 64 for i in range(32)],
                                               "long_factor": [1.0 + i / 2 for i in range(32)]}}),
]}
ALL_MODELS: dict[str, TinyModel] = {**MODELS, **TP2_MODELS, **NEW_FAMILY_MODELS, **LAYOUT_30_MODELS, **BINDING_MODELS,
                                    **ATTENTION_BINDING_MODELS}


def hf_config(model: TinyModel):
    import transformers as t

    common = dict(vocab_size=VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    if model.family == "mamba2":
        # hidden 64, 2 layers, d_state 16, 8 heads x 16 (d_inner 128), n_groups 1, d_conv 4
        return t.Mamba2Config(**{**dict(hidden_size=64, num_hidden_layers=2, state_size=16, num_heads=8, head_dim=16,
                                        expand=2, n_groups=1, conv_kernel=4, chunk_size=16, **common),
                                 **model.config_args})
    if model.family == "mamba":
        return t.MambaConfig(hidden_size=64, num_hidden_layers=2, state_size=16, expand=2, conv_kernel=4, **common)
    if model.family == "falcon_mamba":
        return t.FalconMambaConfig(hidden_size=64, num_hidden_layers=2, state_size=16, expand=2, conv_kernel=4,
                                   **common)
    if model.family == "jamba":
        # layer 0 Mamba, layer 1 attention (head dim 64: the CPU attention's); dense MLPs (one expert)
        return t.JambaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                             num_key_value_heads=1, attn_layer_period=2, attn_layer_offset=1, num_experts=1,
                             expert_layer_period=1, expert_layer_offset=0, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2,
                             use_mamba_kernels=False, max_position_embeddings=4096, **common)
    if model.family == "llama":
        # head_dim 64: the CPU attention refuses 16
        return t.LlamaConfig(**{**dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                       num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                                       max_position_embeddings=4096, **common), **model.config_args})
    if model.family == "nemotron_h":
        return t.NemotronHConfig(**{**dict(
            hidden_size=64, layers_block_type=["mamba", "attention", "mamba", "mlp"], num_attention_heads=1,
            num_key_value_heads=1, head_dim=64, intermediate_size=128, ssm_state_size=16, mamba_num_heads=8,
            mamba_head_dim=16, n_groups=1, conv_kernel=4, expand=2, chunk_size=16, max_position_embeddings=4096,
            **common), **model.config_args})
    if model.family == "falcon_h1":
        return t.FalconH1Config(**{**dict(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=1, num_key_value_heads=1,
            mamba_d_ssm=128, mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=16, mamba_d_conv=4,
            mamba_expand=2, mamba_chunk_size=16, max_position_embeddings=4096, **common), **model.config_args})
    if model.family == "lfm2":
        return t.Lfm2Config(**{**dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=1,
                                      num_key_value_heads=1, conv_L_cache=3, block_auto_adjust_ff_dim=False,
                                      layer_types=["conv", "full_attention", "conv"], max_position_embeddings=4096,
                                      **common),
                               **model.config_args})
    if model.family == "qwen3_next":
        return t.Qwen3NextConfig(**{**dict(
            hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=2,
            num_key_value_heads=1, head_dim=64, linear_conv_kernel_dim=4, linear_key_head_dim=128,
            linear_value_head_dim=128, linear_num_key_heads=1, linear_num_value_heads=1,
            layer_types=["linear_attention"] * 3 + ["full_attention"], num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=64, shared_expert_intermediate_size=64, decoder_sparse_step=1,
            max_position_embeddings=4096, **common), **model.config_args})
    if model.family == "granitemoehybrid":
        return t.GraniteMoeHybridConfig(**{**dict(
            hidden_size=128, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            layer_types=["mamba", "attention", "mamba", "mamba"], mamba_n_heads=8, mamba_d_head=32, mamba_n_groups=2,
            mamba_d_state=32, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16, num_local_experts=4,
            num_experts_per_tok=2, shared_intermediate_size=128, position_embedding_type="nope",
            max_position_embeddings=4096, **common), **model.config_args})
    if model.family == "zamba2":
        # attention: 2 heads of 2*hidden/heads = 64 (vLLM's Zamba2 attention is MHA over num_attention_heads)
        return t.Zamba2Config(**{**dict(
            hidden_size=64, num_hidden_layers=4, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_ngroups=1,
            n_mamba_heads=8, chunk_size=16, intermediate_size=128, num_attention_heads=2, num_mem_blocks=1,
            max_position_embeddings=4096, **common), **model.config_args})
    if model.family == "deepseek_v3":
        # every layer dense (first_k_dense_replace = layers): MLA without the MoE
        return t.DeepseekV3Config(**{**dict(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
            kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32,
            first_k_dense_replace=2, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
            moe_intermediate_size=64, num_nextn_predict_layers=0, max_position_embeddings=4096, **common),
            **model.config_args})
    if model.family == "olmo_hybrid":
        return t.OlmoHybridConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=2,
                                  num_key_value_heads=2, linear_num_key_heads=1, linear_num_value_heads=1,
                                  linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
                                  linear_allow_neg_eigval=False,
                                  layer_types=["linear_attention"] * 3 + ["full_attention"],
                                  max_position_embeddings=4096, **common)
    if model.family == "qwen3_5_text":
        return t.Qwen3_5TextConfig(
            hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=2,
            head_dim=64, linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
            linear_num_key_heads=2, linear_num_value_heads=2,
            layer_types=["linear_attention"] * 3 + ["full_attention"], max_position_embeddings=4096, **common)
    attention = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                     num_key_value_heads=1, max_position_embeddings=4096, **common)
    if model.family == "qwen2":
        return t.Qwen2Config(**{**attention, **model.config_args})
    if model.family == "gemma3_text":
        return t.Gemma3TextConfig(**attention, head_dim=64, query_pre_attn_scalar=64, sliding_window=64,
                                  layer_types=["sliding_attention", "full_attention"])
    if model.family == "granite":
        return t.GraniteConfig(**{**attention, **model.config_args}, embedding_multiplier=12.0, attention_multiplier=0.125,
                               residual_multiplier=0.22, logits_scaling=8.0)
    if model.family == "phi3":
        return t.Phi3Config(**{**attention, **model.config_args})
    if model.family == "olmo2":
        return t.Olmo2Config(**{**attention, **model.config_args}, head_dim=64)
    raise ValueError(model.family)


def make(model: TinyModel, out: Path) -> Path:
    """The model's directory under `out`, created once (a config.json marks it complete)."""
    import torch
    import transformers as t

    path = out / model.name
    if (path / "config.json").exists():
        return path
    torch.manual_seed(0)
    config = hf_config(model)
    dtype = getattr(torch, model.dtype)
    net = t.AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():  # random weights small enough that activations stay finite over 2-4 layers
        for name, parameter in net.named_parameters():
            if parameter.dim() >= 2 or (model.random_biases and name.endswith(".bias")):
                parameter.normal_(0.0, 0.05)
    net.save_pretrained(path, safe_serialization=True)
    if model.weight_renames:
        _rename_weights(path / "model.safetensors", model.weight_renames)
    if model.config_extra:
        config_path = path / "config.json"
        data = json.loads(config_path.read_text())
        data.update(model.config_extra)
        config_path.write_text(json.dumps(data, indent=2))
    return path


def _rename_weights(path: Path, renames: tuple) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(path)
    for old, new in renames:
        tensors = {name.replace(old, new): tensor for name, tensor in tensors.items()}
    save_file(tensors, path, metadata={"format": "pt"})


def main(argv: list[str]) -> int:
    out = Path(argv[0])
    names = argv[1:] or [name for name, model in ALL_MODELS.items() if model.runs_on_cpu]
    made = {}
    for name in names:
        made[name] = str(make(ALL_MODELS[name], out))
    print(json.dumps(made))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
