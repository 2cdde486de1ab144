"""Pages written into a Mooncake cluster by SGLang's own MooncakeStore (0.5.23), for the tests.

Run it with a Python that has sglang==0.5.23, torch and Mooncake (a scratch venv, never the
project's); SGLang's engine does not run on a CPU machine (its kernels on PyPI are CUDA-only), so
the host KV pool is a stand-in: one registered buffer holding each page's K then V (page_first),
handed to the store through `get_page_buffer_meta` as SGLang's pools do. Everything else is
SGLang's: `MooncakeStore.__init__` (setup and its warm-up key), the key names and prefixes of
`batch_set_v1`, the zero-copy puts.

    python sglang_store.py MASTER METADATA_URL TAG  ->  prints {key: size} of what it wrote
"""

import json
import sys

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import MooncakeStore

MODEL = "Qwen/Qwen3-0.6B"
PAGE_TOKENS = 4
HALF_BYTES = 2048  # one page's K (or V) of one rank
PAGES = [f"{0xABC000 + page:064x}" for page in range(3)]
# Set-ups: (name, [(tp_rank, tp_size, pp_rank, pp_size, is_mla)]): each rank is a store of its own.
SETUPS = [
    ("mha-tp2", [(0, 2, 0, 1, False), (1, 2, 0, 1, False)]),
    ("mla", [(0, 1, 0, 1, True)]),
    ("mla-pp2", [(0, 1, 0, 2, True), (0, 1, 1, 2, True)]),
]


class HostPool:
    """page_first: each page's K then V (MLA: K only), HALF_BYTES each, non-zero."""

    def __init__(self, mla: bool, seed: int):
        halves = 1 if mla else 2
        self.page_size = PAGE_TOKENS
        self.mla = mla
        rng = np.random.default_rng(seed)
        self.kv_buffer = torch.from_numpy(rng.integers(1, 255, len(PAGES) * halves * HALF_BYTES, dtype=np.uint8))

    def get_buffers(self):
        return [self.kv_buffer]

    def get_ksize_per_token(self) -> int:
        return HALF_BYTES // PAGE_TOKENS

    def get_page_buffer_meta(self, indices):
        halves = 1 if self.mla else 2
        base = self.kv_buffer.data_ptr()
        pointers, sizes = [], []
        for start in range(0, len(indices), PAGE_TOKENS):
            page = int(indices[start]) // PAGE_TOKENS
            for half in range(halves):
                pointers.append(base + (page * halves + half) * HALF_BYTES)
                sizes.append(HALF_BYTES)
        return pointers, sizes


def main(master: str, metadata: str, tag: str) -> None:
    seed = 0
    for name, ranks in SETUPS:
        for tp_rank, tp_size, pp_rank, pp_size, mla in ranks:
            extra = {"master_server_address": master, "metadata_server": metadata, "local_hostname": "127.0.0.1",
                     "protocol": "tcp", "global_segment_size": 0, "extra_backend_tag": f"{tag}{name}"}
            config = HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size,
                                          attn_cp_rank=0, attn_cp_size=1, is_mla_model=mla,
                                          enable_storage_metrics=False, is_page_first_layout=True,
                                          model_name=MODEL, extra_config=extra)
            store = MooncakeStore(config)
            store.register_mem_pool_host(HostPool(mla, seed))
            seed += 1
            assert all(store.batch_set_v1(PAGES, torch.arange(len(PAGES) * PAGE_TOKENS)))
            store.close()


if __name__ == "__main__":
    main(*sys.argv[1:4])
    print(json.dumps({"sglang": "0.5.23", "pages": PAGES}))
