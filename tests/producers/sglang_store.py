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

    python sglang_store.py MASTER METADATA_URL TAG  ->  prints one JSON line: pages, each set-up's
        geometry and value size, and each key's xxh3_64 (hex) of the page sliced out by that layout
"""

import json
import sys

import torch
import xxhash
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from sglang.srt.mem_cache.pool_host.mha import get_mha_host_pool_cls
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import MooncakeStore

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


def main(master: str, metadata: str, tag: str) -> tuple[dict, dict]:
    seed = 0
    setups, digests = {}, {}
    for name, layout, mla, ranks in SETUPS:
        sizes = set()
        for tp_rank, tp_size, pp_rank, pp_size in ranks:
            extra = {"master_server_address": master, "metadata_server": metadata, "local_hostname": "127.0.0.1",
                     "protocol": "tcp", "global_segment_size": 0, "extra_backend_tag": f"{tag}{name}"}
            pool = host_pool(layout, mla, tp_size, pp_rank, pp_size)
            assert pool.layout == layout and pool.kv_buffer.dtype == DTYPE and pool.storage_format_tag is None
            generator = torch.Generator().manual_seed(seed)
            pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape, generator=generator).to(DTYPE))
            seed += 1
            config = HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size,
                                          attn_cp_rank=0, attn_cp_size=1, is_mla_model=mla,
                                          enable_storage_metrics=False, is_page_first_layout=layout == "page_first",
                                          model_name=MODEL, extra_config=extra)
            store = MooncakeStore(config)
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
    return setups, digests


if __name__ == "__main__":
    found, xxh3 = main(*sys.argv[1:4])
    print(json.dumps({"sglang": "0.5.23", "model": MODEL, "pages": PAGES, "setups": found, "xxh3": xxh3}))
