"""vLLM 0.32.0's and 0.33.0's models with recurrent state or no attention at all, and what the audit
does with each.

vLLM marks them ``IsHybrid`` or ``IsAttentionFree`` (``vllm/model_executor/models/interfaces.py``)
and registers them by architecture (``vllm/model_executor/models/registry.py``). The audit reads a
``config.json``, so each architecture is listed with the model type the audit knows its config by
(a multimodal wrapper's text config's, which decides the layout; a refused wrapper's own). An
architecture is either laid out (a family in ``audit.layouts.families``) or refused here with the reason,
which the audit's error names, and with the first release that registers it (``since``): a
release before that never served it. ``tests/layouts/test_vllm_registry.py`` (run under the real
vLLM, asking each release's registry) fails when a release registers a stateful architecture this
table does not list for it, or the table lists one it does not.
"""

from __future__ import annotations

from dataclasses import dataclass

from .versions import VLLM_VERSIONS

TABLE_RELEASES = ("0.32.0", "0.33.0")  # the releases whose registries the table was checked against


@dataclass(frozen=True, slots=True)
class StatefulModel:
    """One of vLLM's ``IsHybrid`` / ``IsAttentionFree`` architectures."""

    architecture: str
    model_type: str | None  # the (text) config's, which the audit dispatches on; None: not known
    refused: str | None = None  # why the audit does not lay it out; None: it does
    # what else a release changed in the bytes of a refused family, by release (``refusal`` adds it)
    by_version: tuple[tuple[str, str], ...] = ()
    since: str = VLLM_VERSIONS[0]  # the first release (of ``versions.VLLM_VERSIONS``) that registers it


_KDA = "Kimi Delta Attention (KDA) layers: their conv and recurrent states are not modelled"
_KIMI_K3 = (("0.32", "vLLM 0.32: nor is its RecoverSSM page, which holds two tensors more"),
            ("0.33", "vLLM 0.33: nor is its RecoverSSM page, which lost 0.32's two extra tensors (on AMD the KDA "
                     "state follows --mamba-ssm-cache-dtype)"))
_GLM5_NEXT = (("0.33", "vLLM 0.33: GLM-5.3-Flash's KV cache defaults to fp8 on SM10x GPUs (the keys of 0.32, "
                       "other bytes)"),)
_UNCHECKED = ("no config class in transformers 5.19 to check the audit's reading of its config against "
              "vLLM's, so it is not laid out")

STATEFUL_MODELS: tuple[StatefulModel, ...] = (
    # laid out: pure state models
    StatefulModel("MambaForCausalLM", "mamba"),
    StatefulModel("FalconMambaForCausalLM", "falcon_mamba"),
    StatefulModel("Mamba2ForCausalLM", "mamba2"),
    # laid out: hybrids
    StatefulModel("NemotronHForCausalLM", "nemotron_h"),
    StatefulModel("FalconH1ForCausalLM", "falcon_h1"),
    StatefulModel("GraniteMoeHybridForCausalLM", "granitemoehybrid"),
    StatefulModel("JambaForCausalLM", "jamba"),
    StatefulModel("JambaForSequenceClassification", "jamba"),
    StatefulModel("Lfm2ForCausalLM", "lfm2"),
    StatefulModel("Lfm2MoeForCausalLM", "lfm2_moe"),
    StatefulModel("ColBERTLfm2Model", "lfm2"),
    StatefulModel("Qwen3NextForCausalLM", "qwen3_next"),
    StatefulModel("Qwen3_5ForCausalLM", "qwen3_5_text"),
    StatefulModel("Qwen3_5MoeForCausalLM", "qwen3_5_moe_text"),
    StatefulModel("Qwen3_5ForConditionalGeneration", "qwen3_5"),
    StatefulModel("Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe"),
    StatefulModel("ColQwen3_5", "qwen3_5_text"),  # by its text config
    StatefulModel("Zamba2ForCausalLM", "zamba2"),
    StatefulModel("OlmoHybridForCausalLM", "olmo_hybrid"),
    StatefulModel("BailingMoeV2_5ForCausalLM", None),  # laid out by architecture: linear attention + MLA
    # laid out: multimodal wrappers, by their text config
    StatefulModel("Lfm2VlForConditionalGeneration", "lfm2"),
    StatefulModel("MiniCPMV4_6ForConditionalGeneration", "qwen3_5_text"),
    StatefulModel("MiniCPMV4_7ForConditionalGeneration", "qwen3_5_text"),
    StatefulModel("NemotronH_Nano_VL_V2", "nemotron_h"),  # its text_config, or llm_config
    StatefulModel("NemotronH_Nano_Omni_Reasoning_V3", "nemotron_h"),
    StatefulModel("NemotronH_Omni_Reasoning_V3", "nemotron_h"),
    StatefulModel("NemotronH_Super_Omni_Reasoning_V3", "nemotron_h"),
    StatefulModel("InternS2PreviewForConditionalGeneration", "qwen3_5_moe_text"),
    # laid out: vLLM 0.33's wrappers of a Qwen3.5 (its get_mamba_state_* unchanged). Clef-Flash and
    # Decision 3.0 ship a Qwen3.5 config.json (Qwen3_5ForConditionalGeneration, Qwen3_5Model): vLLM
    # names the class by a file beside it (joint_head_config.json, decision_config.json)
    StatefulModel("ClefFlashForJointSchema", "qwen3_5", since="0.33"),
    StatefulModel("D3ForSequenceClassification", "qwen3_5", since="0.33"),
    StatefulModel("MiniCPMOcrForConditionalGeneration", "qwen3_5_text", since="0.33"),  # a MiniCPM-V 4.6
    # refused
    StatefulModel("KimiLinearForCausalLM", "kimi_linear", _KDA),
    StatefulModel("KimiK3ForConditionalGeneration", "kimi_k3", _KDA, _KIMI_K3),
    StatefulModel("BailingMoeV3ForCausalLM", None, _KDA),
    StatefulModel("BailingMoeV3VLForConditionalGeneration", "bailing_moe_v3_vl", _KDA),
    StatefulModel("Glm5NextForCausalLM", "glm5_next_text", _KDA, _GLM5_NEXT),
    StatefulModel("Glm5NextForConditionalGeneration", "glm5_next", _KDA, _GLM5_NEXT),
    StatefulModel("Qwen4ExpForCausalLM", "qwen4_exp_text",
                  "two kinds of recurrent state in one model (short-conv and GDN layers, pages of two sizes) "
                  "and a QSA attention cache are not modelled"),
    StatefulModel("Qwen4ExpForConditionalGeneration", "qwen4_exp",
                  "two kinds of recurrent state in one model (short-conv and GDN layers, pages of two sizes) "
                  "and a QSA attention cache are not modelled"),
    StatefulModel("InternS2MobiusForConditionalGeneration", "interns2_mobius", _UNCHECKED),
    StatefulModel("NemotronHPuzzleForCausalLM", "nemotron_h_puzzle",
                  "per-layer block_configs (heterogeneous layers), and " + _UNCHECKED),
    StatefulModel("AliceAIForCausalLM", None, _KDA + " (AliceAI's GDN layers are Kimi's, "
                  "KimiGatedDeltaNetAttention, with kda_state_shape)", since="0.33"),
    StatefulModel("Terratorch", "terratorch",
                  "attention-free with no recurrent state: vLLM keeps no cache for it and publishes nothing"),
)

# Model types refused although vLLM 0.32.0 does not list them as hybrid: caches the attention
# layouts do not describe, or recurrent models it no longer serves (and the audit has no layout of).
REFUSED_MODEL_TYPES: dict[str, str] = {
    "deepseek_v32": "sparse MLA with an indexer cache (a second KV-cache spec per layer) is not modelled",
    "glm_moe_dsa": "sparse MLA with an indexer cache (a second KV-cache spec per layer) is not modelled",
    "deepseek_v4": "DeepSeek-V4's compressed sparse MLA caches are not modelled",
    "plamo2": "vLLM 0.32.0 no longer serves it (supported until v0.26.0)",
    "minimax": "vLLM 0.32.0 no longer serves it (supported until v0.23.0)",
    "minimax_text_01": "vLLM 0.32.0 no longer serves it (supported until v0.23.0)",
}

_BY_ARCHITECTURE = {model.architecture: model for model in STATEFUL_MODELS}
_REFUSED_BY_TYPE = {model.model_type: model for model in STATEFUL_MODELS if model.refused and model.model_type}


def _unserved_note(model: StatefulModel, version: str | None) -> str | None:
    if version is None or VLLM_VERSIONS.index(version) >= VLLM_VERSIONS.index(model.since):
        return None
    return f"vLLM {version} does not serve {model.architecture} (registered from vLLM {model.since})"


def _reason(model: StatefulModel, version: str | None) -> str:
    notes = [note for release, note in model.by_version if version in (None, release)]
    if version is None and model.since != VLLM_VERSIONS[0]:
        notes.append(f"vLLM {model.since} registers it first")
    return "; ".join([model.refused, *notes, *filter(None, [_unserved_note(model, version)])])


def unserved(architectures: list[str], version: str | None) -> str | None:
    """Why no producer of vLLM `version` wrote a config of these architectures: that release did
    not register them yet (None: it serves them, or no release named)."""
    notes = (_unserved_note(_BY_ARCHITECTURE[str(name)], version) for name in architectures
             if str(name) in _BY_ARCHITECTURE)
    return next(filter(None, notes), None)


def refusal(model_types: list[str | None], architectures: list[str], version: str | None = None) -> str | None:
    """Why the audit does not lay out a config of these model types (outer, text) and
    architectures, as of vLLM ``version`` (None: every release's notes); None where nothing says so."""
    for architecture in architectures:
        model = _BY_ARCHITECTURE.get(str(architecture))
        if model is not None and model.refused:
            return _reason(model, version)
    for name in model_types:
        if isinstance(name, str) and name in _REFUSED_BY_TYPE:
            return _reason(_REFUSED_BY_TYPE[name], version)
        if isinstance(name, str) and name in REFUSED_MODEL_TYPES:
            return REFUSED_MODEL_TYPES[name]
    return None
