"""Stand-ins for the vLLM 0.32.0 objects the manifest reads, laid out the way vLLM lays them.

`allocate_kv_cache` puts every KVCacheTensor in one backing allocation at offset 0, layer ``l`` of
a tensor at ``l * layer_stride`` (cache groups overlay each other); each layer's view is
``[blocks, heads, tokens, k|v]`` in the attention dtype, or a raw int8 page for a Mamba layer; the
connector registers the distinct view addresses in ``kv_caches`` order, each with its block stride
(``RankLocalStoreLayout.register_kv_caches``). The classes carry vLLM's names: the manifest tells
specs apart by class name, never by importing vLLM.
"""

from __future__ import annotations

import enum
import math
import sys
import types
from dataclasses import dataclass, field

BASE = 1 << 32  # where the backing allocation starts
NUM_BLOCKS = 64


@dataclass(frozen=True)
class FakeDtype:
    name: str
    itemsize: int

    def __str__(self) -> str:
        return f"torch.{self.name}"


FLOAT32, BFLOAT16, INT8, UINT8 = (FakeDtype("float32", 4), FakeDtype("bfloat16", 2), FakeDtype("int8", 1),
                                  FakeDtype("uint8", 1))


class MambaAttentionBackendEnum(enum.Enum):
    MAMBA1 = 1
    MAMBA2 = 2
    SHORT_CONV = 3
    LINEAR = 4
    GDN_ATTN = 5


class KVCacheSpec:
    """The base of vLLM's specs: the manifest writer tells them apart by class."""


@dataclass(frozen=True)
class AttentionSpec(KVCacheSpec):
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: FakeDtype

    @property
    def page_size_bytes(self) -> int:
        return self.block_size * self.num_kv_heads * 2 * self.head_size * self.dtype.itemsize


class FullAttentionSpec(AttentionSpec):
    """Full attention, as vLLM names it (the kind the manifest records)."""


@dataclass(frozen=True)
class MambaSpec(KVCacheSpec):
    block_size: int
    shapes: tuple
    dtypes: tuple
    page_size_padded: int | None = None
    mamba_type: MambaAttentionBackendEnum = MambaAttentionBackendEnum.MAMBA2

    @property
    def page_size_bytes(self) -> int:
        return self.page_size_padded or sum(math.prod(s) * d.itemsize for s, d in zip(self.shapes, self.dtypes))


class FakeTensor:
    def __init__(self, address: int, shape: tuple, dtype: FakeDtype):
        self.address, self.shape, self.dtype = address, shape, dtype
        strides, step = [], 1
        for dim in reversed(shape):
            strides.insert(0, step)
            step *= dim
        self._strides = tuple(strides)

    def data_ptr(self) -> int:
        return self.address

    def stride(self, dim: int | None = None):
        return self._strides if dim is None else self._strides[dim]

    def element_size(self) -> int:
        return self.dtype.itemsize


@dataclass
class KeyMetadata:
    model_name: str
    tp_rank: int
    pcp_rank: int = 0
    dcp_rank: int = 0
    pp_rank: int = 0
    group_id: int = 0
    cache_prefix: str = ""
    store_namespace: str = ""


class RankLocalStoreLayout:
    local_shard_ids = (0,)

    def __init__(self, metadata: KeyMetadata):
        self.metadata = metadata
        self.kv_caches_base_addr: list[int] = []
        self.block_len: list[int] = []

    def key_for(self, shard_id: int, chunk_hash: bytes) -> str:  # PoolKey.build_prefix + "@" + hash
        m = self.metadata
        prefix = f"{m.cache_prefix}@" if m.cache_prefix else ""
        return (f"{prefix}{m.model_name}{m.store_namespace}@tp_rank:{m.tp_rank}@pcp{m.pcp_rank}@dcp{m.dcp_rank}"
                f"@pp_rank:{m.pp_rank}@group:{m.group_id}@{chunk_hash.hex()}")


@dataclass
class TokenDatabase:
    metadata: KeyMetadata
    store_layout: RankLocalStoreLayout


@dataclass
class KVCacheGroupSpec:
    layer_names: list[str]
    kv_cache_spec: KVCacheSpec


@dataclass
class FakeWorker:
    """What describe_worker reads of a MooncakeStoreWorker after register_kv_caches."""

    token_dbs: list
    coord: types.SimpleNamespace
    group_tp_replication_factors: tuple
    num_blocks: int
    store: object
    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    pcp_rank: int = 0
    dcp_rank: int = 0
    kv_role: str = "kv_both"
    cache_config: types.SimpleNamespace = field(
        default_factory=lambda: types.SimpleNamespace(cache_dtype="auto", mamba_cache_mode="align"))


def build_worker(model: str, groups: list[tuple[list[str], KVCacheSpec]], tensors: list[list[str]],
                 tp_size: int = 1, tp_rank: int = 0, store: object = None) -> tuple[FakeWorker, dict]:
    """A worker and its ``kv_caches``: `groups` (layer names, spec) in group order, `tensors` the
    layers sharing each KVCacheTensor (layer l of a tensor at ``l * layer_stride``)."""
    spec_of = {layer: spec for layers, spec in groups for layer in layers}
    page = max(spec.page_size_bytes for _, spec in groups)
    layer_stride = page * NUM_BLOCKS
    kv_caches = {}
    for layers in tensors:
        for position, layer in enumerate(layers):
            spec = spec_of[layer]
            address = BASE + position * layer_stride
            if isinstance(spec, AttentionSpec):
                view = FakeTensor(address, (NUM_BLOCKS, spec.num_kv_heads, spec.block_size, 2 * spec.head_size),
                                  spec.dtype)
            else:
                view = FakeTensor(address, (NUM_BLOCKS, 1, 1, page), INT8)
            kv_caches[layer] = view
    bases = list(dict.fromkeys(view.data_ptr() for view in kv_caches.values()))
    databases = []
    for group_id, _ in enumerate(groups):
        metadata = KeyMetadata(model, tp_rank, group_id=group_id)
        layout = RankLocalStoreLayout(metadata)
        layout.kv_caches_base_addr, layout.block_len = bases, [page] * len(bases)
        databases.append(TokenDatabase(metadata, layout))
    worker = FakeWorker(databases, types.SimpleNamespace(kv_cache_groups=[KVCacheGroupSpec(list(layers), spec)
                                                                          for layers, spec in groups]),
                        (1,) * len(groups), NUM_BLOCKS, store or types.SimpleNamespace(), tp_size=tp_size,
                        tp_rank=tp_rank)
    return worker, kv_caches


def hybrid_worker(**options) -> tuple[FakeWorker, dict]:
    """Falcon-H1-like, as vLLM 0.32.0 served it in float32 on CPU: an attention group (2 layers, block
    64, 1 KV head of 64) and a Mamba2 group (2 layers, page padded to the attention page), one
    KVCacheTensor per layer slot shared by one layer of each group."""
    attention = FullAttentionSpec(block_size=64, num_kv_heads=1, head_size=64, dtype=FLOAT32)
    mamba = MambaSpec(block_size=64, shapes=((3, 160), (8, 16, 16)), dtypes=(FLOAT32, FLOAT32),
                      page_size_padded=attention.page_size_bytes)
    return build_worker("falcon-h1-tiny", [(["model.layers.0.attn", "model.layers.1.attn"], attention),
                                           (["model.2.mixer", "model.3.mixer"], mamba)],
                        [["model.layers.0.attn", "model.layers.1.attn"], ["model.2.mixer", "model.3.mixer"]],
                        **options)


class FakePlatform:
    """vLLM's ``current_platform`` as describe_worker reads it: its device name and the GPU's
    capability (``DeviceCapability`` is a (major, minor) named tuple; vLLM's CPU platform: None)."""

    def __init__(self, device_name: str, capability: tuple[int, int] | None):
        self.device_name = device_name
        self.capability = capability

    def get_device_capability(self, device_id: int = 0):
        return self.capability


def install_fake_vllm(monkeypatch, version: str = "0.32.0", platform: str = "cpu",
                      capability: tuple[int, int] | None = None) -> None:
    """`import vllm` and `vllm.platforms.current_platform`, as describe_worker reads them."""
    vllm = types.ModuleType("vllm")
    vllm.__version__ = version
    platforms = types.ModuleType("vllm.platforms")
    platforms.current_platform = FakePlatform(platform, capability)
    vllm.platforms = platforms
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.platforms", platforms)
