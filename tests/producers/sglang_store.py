"""Pages written into a Mooncake cluster by SGLang's own MooncakeStore and host KV pool (0.5.23), for the tests.

Run it with a Python that has sglang==0.5.23, torch, torchvision and Mooncake, never the project's
(`scripts/sglang-env.sh` makes one: SGLang imports torchvision, and none runs beside .venv's CPU
torch). SGLang's engine does not run on a CPU machine (its kernels on PyPI are CUDA-only), but its
pools do: each rank builds SGLang's device pool
(`MHATokenToKVPool` / `MLATokenToKVPool`) on device "cpu", its host pool the way SGLang's HiCache
assembler does (`MHATokenToKVPoolHost` page_first / page_first_direct, `MLATokenToKVPoolHost`
page_first, from the device pool's buffer info; pin_memory off), fills the host KV buffer with
bfloat16 randn values, and hands it to `MooncakeStore.register_mem_pool_host`; `batch_set_v1`
then puts each page zero-copy from the pool's `get_page_buffer_meta` pointers. Nothing here
chooses a byte: geometry in, SGLang's layout out.

The geometry is a tiny one under the name "Qwen/Qwen3-0.6B": MHA 2 layers, 2 KV heads of 64
(TP 2: 1 head a rank), MLA kv_lora_rank 64 + qk_rope_head_dim 16 over 2 layers (PP 2: 1 layer a
stage), bfloat16, pages of 4 tokens. One page's value per rank:

    MHA page_first         K (then V): [page_tokens, layers, kv_heads_per_rank, head_dim]
    MHA page_first_direct  K (then V): [layers, page_tokens, kv_heads_per_rank, head_dim]
    MLA page_first         K:          [page_tokens, layers, 1, kv_lora_rank + qk_rope_head_dim]

The hybrid set-up ("hybrid", under the name HYBRID_MODEL) is a tiny Nemotron-H: HYBRID_CONFIG,
loaded by SGLang's own loader (`get_config`, so `NemotronHConfig`), its `mamba2_cache_params` as
SGLang's `mambaish_config` gives them at TP 1 (2 Mamba2 layers, 1 attention layer). Its device
pools on "cpu" are SGLang's `MambaPool` and `HybridLinearKVPool` (whose KV sub-pool holds the
attention layer only); the host pools are built as `build_hybrid_mamba_stack` builds them (the
KV pool's declared device pool through `_mha_host_inputs`, page_first; `MambaPoolHost`
page_first, pin_memory off), put in a `HostPoolGroup` of `build_pool_entry` entries and given to
the store the way `HybridCacheController.attach_storage_backend` does (`register_mem_pool_host`
of the anchor, then `register_mem_host_pool_v2` for each entry). SGLang's device-to-host copies
need CUDA kernels, so the host buffers are filled by hand (temporal float32, conv and KV
bfloat16 randn). `batch_set_v1` puts the KV pages (`_0_k`, `_0_v`) as the controller's
`_page_backup` does, `batch_set_v2([PoolTransfer(MAMBA, ...)])` each page's state slot
(`_0_temporal`, `_0_conv_0`: [layers, 1, *state] of one slot, `get_page_buffer_meta`).

    python sglang_store.py MASTER METADATA_URL TAG  ->  prints one JSON line: pages, each set-up's
        geometry and value size, and each key's xxh3_64 (hex) of the page sliced out by that layout
"""

import json
import math
import os
import sys
import tempfile
import types

import torch
import xxhash
from sglang.srt.configs import hybrid_arch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, PoolName, PoolTransfer
from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import _mha_host_inputs, build_pool_entry
from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, MambaPool, MHATokenToKVPool, MLATokenToKVPool
from sglang.srt.mem_cache.pool_host import HostPoolGroup
from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost
from sglang.srt.mem_cache.pool_host.mha import get_mha_host_pool_cls
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import MooncakeStore
from sglang.srt.runtime_context import get_parallel
from sglang.srt.utils.hf_transformers.config import get_config

MODEL = "Qwen/Qwen3-0.6B"
PAGE_TOKENS = 4
DTYPE = torch.bfloat16
LAYERS = 2
KV_HEADS = 2
HEAD_DIM = 64
KV_LORA_RANK = 64
QK_ROPE_HEAD_DIM = 16
PAGES = [f"{0xABC000 + page:064x}" for page in range(3)]
HOST_TOKENS = len(PAGES) * PAGE_TOKENS
DEVICE_TOKENS = 2 * HOST_TOKENS
# Set-ups: (name, layout, is_mla, [(tp_rank, tp_size, pp_rank, pp_size)]): each rank is a store of its own.
SETUPS = [
    ("mha-tp2", "page_first", False, [(0, 2, 0, 1), (1, 2, 0, 1)]),
    ("mha-direct", "page_first_direct", False, [(0, 1, 0, 1)]),
    ("mla", "page_first", True, [(0, 1, 0, 1)]),
    ("mla-pp2", "page_first", True, [(0, 1, 0, 2), (0, 1, 1, 2)]),
]
HYBRID_MODEL = "nvidia/Nemotron-H-tiny"
# Nemotron-H's field names (nvidia/NVIDIA-Nemotron-Nano-9B-v2): "MM*" is Mamba2, Mamba2, attention.
HYBRID_CONFIG = {
    "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "torch_dtype": "bfloat16",
    "vocab_size": 1024, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 3,
    "hybrid_override_pattern": "MM*", "num_attention_heads": 4, "num_key_value_heads": KV_HEADS,
    "head_dim": HEAD_DIM, "mamba_num_heads": 8, "mamba_head_dim": 16, "n_groups": 1, "ssm_state_size": 16,
    "conv_kernel": 4, "expand": 2, "chunk_size": 128, "mamba_hidden_act": "silu", "max_position_embeddings": 4096}


def stage_layers(pp_rank: int, pp_size: int) -> range:
    per_stage = LAYERS // pp_size
    return range(pp_rank * per_stage, (pp_rank + 1) * per_stage)


def host_pool(layout: str, mla: bool, tp_size: int, pp_rank: int, pp_size: int):
    """SGLang's device pool on "cpu", then its host pool as the HiCache assembler builds it
    (`hybrid_pool_assembler._build_mha_mla_host_pool`), with pin_memory off."""
    layers = stage_layers(pp_rank, pp_size)
    common = dict(size=DEVICE_TOKENS, page_size=PAGE_TOKENS, dtype=DTYPE, layer_num=len(layers), device="cpu",
                  enable_memory_saver=False, start_layer=layers.start, end_layer=layers.stop - 1)
    host_args = dict(host_to_device_ratio=1.0, host_size=0, page_size=PAGE_TOKENS, layout=layout, pin_memory=False,
                     device="cpu", allocator_type="default", pool_label="kv", host_token_capacity=HOST_TOKENS)
    if mla:
        device = MLATokenToKVPool(kv_lora_rank=KV_LORA_RANK, qk_rope_head_dim=QK_ROPE_HEAD_DIM, **common)
        return MLATokenToKVPoolHost(device.get_device_pool_infos()[0].buffer_info,
                                    device_capacity_tokens=device.size, start_layer=device.start_layer,
                                    end_layer=device.end_layer, target_layer_num=device.layer_num,
                                    override_kv_cache_dim=device.kv_cache_dim, **host_args)
    device = MHATokenToKVPool(head_num=KV_HEADS // tp_size, head_dim=HEAD_DIM, enable_alt_stream=False, **common)
    info = device.get_device_pool_infos()[0].buffer_info
    return get_mha_host_pool_cls(info)(info, device_capacity_tokens=device.size, start_layer=device.start_layer,
                                       end_layer=device.end_layer, draft_buffer_infos=(),
                                       write_back_staging=device.hicache_write_back_staging, **host_args)


def page_view(pool, layout: str, mla: bool, page: int, obj: int) -> torch.Tensor:
    """One page's K (obj 0) or V (obj 1) sliced out of the host KV buffer by the layout above."""
    tokens = slice(page * PAGE_TOKENS, (page + 1) * PAGE_TOKENS)
    if mla:
        return pool.kv_buffer[tokens]
    return pool.kv_buffer[obj, page] if layout == "page_first_direct" else pool.kv_buffer[obj, tokens]


def geometry(name: str, layout: str, mla: bool, ranks, value_bytes: int) -> dict:
    tp_size, pp_size = ranks[0][1], ranks[0][3]
    found = {"layout": layout, "mla": mla, "dtype": str(DTYPE).removeprefix("torch."), "page_tokens": PAGE_TOKENS, "model_layers": LAYERS,
             "layers_per_rank": LAYERS // pp_size, "tp_size": tp_size, "pp_size": pp_size,
             "objects": ["k"] if mla else ["k", "v"], "value_bytes": value_bytes}
    if mla:
        found |= {"kv_lora_rank": KV_LORA_RANK, "qk_rope_head_dim": QK_ROPE_HEAD_DIM,
                  "kv_cache_dim": KV_LORA_RANK + QK_ROPE_HEAD_DIM}
    else:
        found |= {"kv_heads": KV_HEADS, "kv_heads_per_rank": KV_HEADS // tp_size, "head_dim": HEAD_DIM}
    return found


def _store(master: str, metadata: str, tag: str, name: str, model: str, mla: bool, layout: str,
           tp_rank: int = 0, tp_size: int = 1, pp_rank: int = 0, pp_size: int = 1) -> MooncakeStore:
    extra = {"master_server_address": master, "metadata_server": metadata, "local_hostname": "127.0.0.1",
             "protocol": "tcp", "global_segment_size": 0, "extra_backend_tag": f"{tag}{name}"}
    return MooncakeStore(HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=mla, enable_storage_metrics=False, is_page_first_layout=layout == "page_first",
        model_name=model, extra_config=extra))


def hybrid_cache_params():
    """HYBRID_CONFIG through SGLang's loader and `mambaish_config` at TP 1 (as
    sglang_mamba_geometry.py): the state config, its `mamba2_cache_params`."""
    folder = tempfile.mkdtemp(prefix="sglang_store_hybrid_")
    with open(os.path.join(folder, "config.json"), "w") as file:
        json.dump(HYBRID_CONFIG, file)
    with get_parallel().override(tp_size=1, attn_tp_size=1, attn_dp_size=1, attn_cp_size=1,
                                 enable_cp_tp_group_sharing=False):
        hf_config = get_config(folder, trust_remote_code=False)
        model_config = types.SimpleNamespace(hf_config=hf_config, is_draft_model=False,
                                             linear_attn_registry_result=None)
        state_config = hybrid_arch.mambaish_config(model_config)
        return hf_config, state_config, state_config.mamba2_cache_params


def hybrid(master: str, metadata: str, tag: str, seed: int, digests: dict) -> dict:
    """The hybrid set-up: SGLang's KV and Mamba host pools, registered and written as its hybrid
    cache controller does (see the module's docstring); its geometry."""
    hf_config, state_config, params = hybrid_cache_params()
    state_layers = [int(layer) for layer in params.layers]
    attention_layers = [int(layer) for layer in state_config.full_attention_layer_ids]
    # Device pools on "cpu": the Mamba state pool (one slot a page here) and the hybrid KV pool.
    mamba = MambaPool(size=len(PAGES), spec_state_size=0, cache_params=params, mamba_layer_ids=state_layers,
                      device="cpu")
    kvcache = HybridLinearKVPool(size=DEVICE_TOKENS, dtype=DTYPE, page_size=PAGE_TOKENS, head_num=KV_HEADS,
                                 head_dim=HEAD_DIM, full_attention_layer_ids=attention_layers, device="cpu",
                                 mamba_pool=mamba)
    (decl,) = kvcache.host_pool_decls()
    kv_device = decl.device_pool
    assert decl.pool_name == PoolName.KV and kv_device is kvcache.full_kv_pool
    assert kv_device.layer_num == len(attention_layers)
    # Host pools as build_hybrid_mamba_stack builds them (build_kv_host_pool, build_mamba_host_pool).
    cls, info, mha_kwargs = _mha_host_inputs(kv_device)
    kv_host = cls(info, 1.0, 0, PAGE_TOKENS, "page_first", pin_memory=False, device="cpu",
                  allocator_type="default", pool_label="kv", host_token_capacity=HOST_TOKENS, **mha_kwargs)
    (mamba_info,) = mamba.get_device_pool_infos()
    mamba_info.buffer_info.validate(layer_ids=mamba_info.layer_ids)
    mamba_host = MambaPoolHost(mamba_info.buffer_info, 1.0, 0, device_capacity=mamba.size, pin_memory=False,
                               device="cpu", allocator_type="default", layout="page_first")
    assert kv_host.layout == mamba_host.layout == "page_first" and kv_host.storage_format_tag is None
    assert len(mamba_host.conv_buffer) == 1 and mamba_host.num_mamba_layers == len(state_layers)
    full_mapping = {layer - kvcache.start_layer: index for index, layer in enumerate(attention_layers)}
    mamba_mapping = {layer - kvcache.start_layer: index for index, layer in enumerate(mamba_info.layer_ids)}
    transfer_max = max(full_mapping.keys() | mamba_mapping.keys()) + 1
    group = HostPoolGroup([
        build_pool_entry(name=PoolName.KV, host_pool=kv_host, device_pool=kv_device, layer_mapping=full_mapping,
                         transfer_layer_id_max=transfer_max, is_anchor=True),
        build_pool_entry(name=PoolName.MAMBA, host_pool=mamba_host, device_pool=mamba, layer_mapping=mamba_mapping,
                         transfer_layer_id_max=transfer_max)])
    # SGLang's device-to-host copies are CUDA kernels: the host buffers are filled by hand.
    generator = torch.Generator().manual_seed(seed)
    kv_host.kv_buffer.copy_(torch.randn(kv_host.kv_buffer.shape, generator=generator).to(DTYPE))
    mamba_host.temporal_buffer.copy_(torch.randn(mamba_host.temporal_buffer.shape, generator=generator,
                                                 dtype=torch.float32).to(mamba_host.temporal_dtype))
    for conv in mamba_host.conv_buffer:
        conv.copy_(torch.randn(conv.shape, generator=generator).to(mamba_host.conv_dtype))

    store = _store(master, metadata, tag, "hybrid", HYBRID_MODEL, False, "page_first")
    # HybridCacheController: the anchor through register_mem_pool_host, every entry through v2.
    store.register_mem_pool_host(group.anchor_entry.host_pool)
    for entry in group.entries:
        store.register_mem_host_pool_v2(entry.host_pool, entry.name)
    assert set(store.registered_pools) == {PoolName.MAMBA}
    sizes = {}
    # KV: what batch_set_v1 puts, `_0_k` / `_0_v` of each page.
    indices = torch.arange(HOST_TOKENS)
    keys, pointers, element_sizes = store._batch_preprocess(store._tag_keys(PAGES), indices)
    assert len(keys) == 2 * len(PAGES)
    for i, (key, pointer, size) in enumerate(zip(keys, pointers, element_sizes)):
        view = page_view(kv_host, "page_first", False, i // 2, i % 2)
        assert view.is_contiguous() and view.data_ptr() == pointer and view.nbytes == size, key
        digests[key] = f"{xxhash.xxh3_64_intdigest(view.view(torch.uint8).numpy()):016x}"
        sizes.setdefault("kv"[i % 2], set()).add(size)
    # Mamba: what batch_set_v2 puts, one state slot a page (MambaPoolHost.page_size is 1).
    slots = torch.arange(len(PAGES))
    transfer = PoolTransfer(name=PoolName.MAMBA, host_indices=slots, keys=list(PAGES))
    keys, multiplier = store._get_hybrid_page_component_keys(PAGES, transfer)
    keys = store._tag_keys(keys)
    pointers, element_sizes = mamba_host.get_page_buffer_meta(slots)
    objects = ["temporal", *(f"conv_{i}" for i in range(len(mamba_host.conv_buffer)))]
    assert multiplier == len(objects) and len(keys) == len(pointers) == len(PAGES) * multiplier
    for i, (key, pointer, size) in enumerate(zip(keys, pointers, element_sizes)):
        slot, obj = divmod(i, multiplier)
        view = mamba_host.temporal_buffer[slot] if obj == 0 else mamba_host.conv_buffer[obj - 1][slot]
        assert key.endswith(f"_0_{objects[obj]}"), key
        assert view.is_contiguous() and view.data_ptr() == pointer and view.nbytes == size, key
        digests[key] = f"{xxhash.xxh3_64_intdigest(view.contiguous().view(torch.uint8).numpy()):016x}"
        sizes.setdefault(objects[obj], set()).add(size)
    assert all(store.batch_set_v1(PAGES, indices))
    assert store.batch_set_v2([transfer]) == {PoolName.MAMBA: [True] * len(PAGES)}
    store.close()
    assert all(len(found) == 1 for found in sizes.values()), sizes
    object_bytes = {name: found.pop() for name, found in sizes.items()}
    temporal = [int(n) for n in params.shape.temporal]
    conv = [[int(n) for n in shape] for shape in params.shape.conv]
    dtype = lambda found: str(found).removeprefix("torch.")  # noqa: E731
    assert object_bytes["temporal"] == len(state_layers) * math.prod(temporal) * mamba_host.temporal_dtype.itemsize
    assert object_bytes["conv_0"] == len(state_layers) * math.prod(conv[0]) * mamba_host.conv_dtype.itemsize
    return {"layout": "page_first", "mla": False, "hybrid": True, "dtype": dtype(DTYPE), "page_tokens": PAGE_TOKENS,
            "model": HYBRID_MODEL, "config_class": type(hf_config).__name__,
            "model_layers": int(hf_config.num_hidden_layers), "state_layers": state_layers,
            "attention_layers": attention_layers, "layers_per_rank": len(attention_layers), "tp_size": 1,
            "pp_size": 1, "kv_heads": KV_HEADS, "kv_heads_per_rank": KV_HEADS, "head_dim": HEAD_DIM,
            "temporal_shape": temporal, "temporal_dtype": dtype(mamba_host.temporal_dtype), "conv_shapes": conv,
            "conv_dtype": dtype(mamba_host.conv_dtype), "mamba_state_slots_per_page": mamba_host.page_size,
            "objects": ["k", "v", *objects], "value_bytes": object_bytes["k"], "object_bytes": object_bytes,
            "config": HYBRID_CONFIG}


def main(master: str, metadata: str, tag: str) -> tuple[dict, dict]:
    seed = 0
    setups, digests = {}, {}
    for name, layout, mla, ranks in SETUPS:
        sizes = set()
        for tp_rank, tp_size, pp_rank, pp_size in ranks:
            pool = host_pool(layout, mla, tp_size, pp_rank, pp_size)
            assert pool.layout == layout and pool.kv_buffer.dtype == DTYPE and pool.storage_format_tag is None
            generator = torch.Generator().manual_seed(seed)
            pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape, generator=generator).to(DTYPE))
            seed += 1
            store = _store(master, metadata, tag, name, MODEL, mla, layout, tp_rank, tp_size, pp_rank, pp_size)
            store.register_mem_pool_host(pool)
            indices = torch.arange(HOST_TOKENS)
            # What batch_set_v1 puts: SGLang's key names, pointers and sizes; each must be the page the layout names.
            keys, pointers, element_sizes = store._batch_preprocess(store._tag_keys(PAGES), indices)
            objects = 1 if mla else 2
            assert len(keys) == len(PAGES) * objects
            for i, (key, pointer, size) in enumerate(zip(keys, pointers, element_sizes)):
                view = page_view(pool, layout, mla, i // objects, i % objects)
                assert view.is_contiguous() and view.data_ptr() == pointer and view.nbytes == size, key
                digests[key] = f"{xxhash.xxh3_64_intdigest(view.view(torch.uint8).numpy()):016x}"
            sizes.update(element_sizes)
            assert all(store.batch_set_v1(PAGES, indices))
            store.close()
        assert len(sizes) == 1, sizes
        setups[name] = geometry(name, layout, mla, ranks, sizes.pop())
    setups["hybrid"] = hybrid(master, metadata, tag, seed, digests)
    return setups, digests


if __name__ == "__main__":
    found, xxh3 = main(*sys.argv[1:4])
    print(json.dumps({"sglang": "0.5.23", "model": MODEL, "pages": PAGES, "setups": found, "xxh3": xxh3}))
