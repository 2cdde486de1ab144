"""What the load recorder and the load guard add to a consumer's load (issue #29 §6).

Run from the repository root:  python -m benchmarks.load_guard [--loads 60] [--keys 8] [--family llama]

A producer publishes 1 MiB values shaped like a Mamba2 hybrid's state key (16 layers, one 64 KiB
page each: a float32 conv state of 8 KiB, a float32 ssm state of 48 KiB, 8 KiB of zero padding) and a
consumer loads them into its own registered KV memory with `batch_get_into_multi_buffers`, `--keys`
keys a load (a request's hit). Per-load microseconds, modes interleaved load by load, each first
equally often, on one embedded cluster (TCP loopback):

- ``bare``, ``bare again`` (an A/A control: the noise floor), ``recording`` (load records only),
  ``guard`` (records, deny list, in-place check by the consumer's manifest: zero test of each state,
  NaN/Inf screen of each float32 state), ``guard, no manifest`` (zero test per segment only) and
  ``guard, bound`` (the guard, and layer-0 binding, issue #40: each value's conv rows decoded to
  tokens under the consumer's own weights and compared with its chunk hash's prefix record);
- the guard's own check with the store stubbed, per key, and as a share of a bare load;
- the producer's puts of the same values (fresh keys each round, removed untimed): ``put bare``,
  ``put, guard`` (the null-block test and the records) and ``put, guard bound`` (the put guard's
  layer-0 binding too).

For binding, the model is a Mamba2 whose layer-0 conv state is this page's (2 rows of 1,024 float32:
hidden 448, d_conv 3, one group of d_state 64) with a 50,288-token vocabulary and random weights;
every block's layer-0 conv rows are the images of two tokens, and every key's hash has its prefix
record, so every value is bound and kept.

With ``--family llama`` the values are a Llama's attention blocks instead (16 layers, one 64 KiB page
each: 8 KV heads of 64, 16 tokens, float32, K then V per head as vLLM's CPU backend keeps them; hidden
512, a 32,000-token vocabulary, random weights): binding decodes each block's 16 layer-0 V rows and
compares them with its hash's KV-block record, and the first KV head's K rows (its tokens' K turned
to the block's recorded start) with their tokens' K there.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

import numpy as np  # noqa: E402

from audit.cluster import LocalCluster  # noqa: E402
from audit.recorder.deny import DenyList  # noqa: E402
from audit.layouts.weights import token_images  # noqa: E402
from audit.recorder.binding import StateBinder  # noqa: E402
from audit.recorder.guard import LoadGuard  # noqa: E402
from audit.recorder.records import RecordWriter  # noqa: E402
from audit.recorder.wrapper import recording_store_class  # noqa: E402

LAYERS, PAGE = 16, 64 << 10
STATES = [("conv", 0, 8 << 10, (2, 1024)), ("ssm", 8 << 10, 48 << 10, (8, 64, 24))]  # float32; then padding
NUM_BLOCKS = 9
MODEL = "mamba2-bench"
CONFIG = {"model_type": "mamba2", "architectures": ["Mamba2ForCausalLM"], "hidden_size": 448, "expand": 2,
          "n_groups": 1, "state_size": 64, "num_heads": 14, "head_dim": 64, "conv_kernel": 3,
          "num_hidden_layers": LAYERS, "vocab_size": 50288, "layer_norm_epsilon": 1e-5, "torch_dtype": "float32"}


LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 512, "num_hidden_layers": LAYERS,
         "num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 32000, "rms_norm_eps": 1e-5}
KV_HEADS, HEAD, BLOCK_TOKENS = 8, 64, 16  # a 64 KiB float32 page: heads x (K|V) x tokens x head


def manifest(model_path: Path | None = None, family: str = "mamba2") -> dict:
    if family == "llama":
        document = {"groups": [{"group": 1, "kind": "attention", "block_size": BLOCK_TOKENS,
                                "attention": {"num_kv_heads": KV_HEADS, "head_size": HEAD, "head_size_v": HEAD,
                                              "dtype": "float32"},
                                "segments": [{"index": i, "block_len": PAGE, "layer": f"model.layers.{i}.self_attn.attn",
                                              "layer_index": i, "offset_in_page": 0} for i in range(LAYERS)]}]}
        if model_path is not None:
            document.update(model=MODEL, model_path=str(model_path), tp_size=1, tp_rank=0)
        return document
    document = {"groups": [{"group": 1, "kind": "mamba2",
                            "states": [{"name": n, "offset": o, "length": length, "dtype": "float32", "shape": list(shape)}
                                       for n, o, length, shape in STATES],
                            "segments": [{"index": i, "block_len": PAGE, "layer": f"model.layers.{i}", "layer_index": i,
                                          "offset_in_page": 0} for i in range(LAYERS)]}]}
    if model_path is not None:
        document.update(model=MODEL, model_path=str(model_path), tp_size=1, tp_rank=0)
    return document


def write_model(directory: Path, family: str = "mamba2", llama: dict = LLAMA) -> Path:
    """The checkpoint whose layer-0 images the bound guard checks against (random weights); `llama`:
    the Llama's config, where another geometry is wanted (`benchmarks.binding --geometry small`)."""
    from tests.helpers import write_safetensors

    directory.mkdir(parents=True, exist_ok=True)
    if family == "llama":
        (directory / "config.json").write_text(json.dumps(llama))
        rng = np.random.default_rng(40)
        hidden, width = llama["hidden_size"], llama["num_key_value_heads"] * llama["head_dim"]
        write_safetensors(directory / "model.safetensors", {
            "model.embed_tokens.weight": rng.standard_normal((llama["vocab_size"], hidden), dtype=np.float32) * 0.02,
            "model.layers.0.input_layernorm.weight": 1 + 0.1 * rng.standard_normal(hidden, dtype=np.float32),
            "model.layers.0.self_attn.v_proj.weight": rng.standard_normal((width, hidden), dtype=np.float32) * 0.03,
            "model.layers.0.self_attn.k_proj.weight": rng.standard_normal((width, hidden), dtype=np.float32) * 0.03})
        return directory
    (directory / "config.json").write_text(json.dumps(CONFIG))
    rng = np.random.default_rng(40)
    hidden, rows = CONFIG["hidden_size"], 896 + 1024 + CONFIG["num_heads"]  # z, xBC, dt
    write_safetensors(directory / "model.safetensors", {
        "backbone.embeddings.weight": rng.standard_normal((CONFIG["vocab_size"], hidden), dtype=np.float32) * 0.02,
        "backbone.layers.0.norm.weight": 1 + 0.1 * rng.standard_normal(hidden, dtype=np.float32),
        "backbone.layers.0.mixer.in_proj.weight": rng.standard_normal((rows, hidden), dtype=np.float32) * 0.03})
    return directory


def block_start(block: int) -> int:
    """The position a Llama block's first token had in its prompt (its K is turned to it)."""
    return BLOCK_TOKENS * block


def turned_keys(images, tokens: list[int], start: int) -> np.ndarray:
    """The first KV head's K of `tokens` at positions from `start` (tokens, HEAD): vLLM's llama.py at layer 0."""
    from audit.layouts.rotary import rotate

    keys = images.keys
    k = keys.pre_rotary(images.normed(images.embeddings.rows(np.asarray(tokens))))
    half = keys.rotary.rotary_dim // 2
    angles = keys.rotary.angles(start + np.arange(len(tokens)), np.arange(half))
    return np.concatenate(rotate(k[:, :half], k[:, half:2 * half], angles), axis=1).astype(np.float32)


def block_tokens(block: int, family: str = "mamba2") -> list[int]:
    """The tokens whose images a block's layer-0 rows hold: two conv rows, or 16 tokens' V."""
    if family == "llama":
        return [(7 * block + 3 * t + 11) % LLAMA["vocab_size"] for t in range(BLOCK_TOKENS)]
    return [7 * block + 11, 13 * block + 101]


class KVMemory:
    """LAYERS registered buffers of NUM_BLOCKS pages; block 0 unused (vLLM's null block). On
    `device` cuda they are torch tensors in GPU memory, as a GPU consumer's caches are (`caches`:
    vLLM's kv_caches for the guards' describe, in host or GPU memory, as vLLM hands them over)."""

    def __init__(self, fill: bool, images=None, family: str = "mamba2", device: str = "cpu"):
        rng = np.random.default_rng(1)
        self.buffers = []
        for _ in range(LAYERS):
            pages = np.zeros((NUM_BLOCKS, PAGE), np.uint8)
            if fill:
                states = rng.normal(size=(NUM_BLOCKS, (56 << 10) // 4)).astype(np.float32)
                pages[:, :56 << 10] = states.view(np.uint8)
            self.buffers.append(pages)
        if fill and family == "llama":  # pages of random K and V; layer 0's V: the images of the block's tokens
            for block in range(NUM_BLOCKS):
                for buffer in self.buffers:
                    buffer[block] = rng.normal(size=PAGE // 4).astype(np.float32).view(np.uint8)
                page = self.buffers[0][block].view(np.float32).reshape(KV_HEADS, 2, BLOCK_TOKENS, HEAD)
                v = images.images(block_tokens(block, family)).reshape(BLOCK_TOKENS, KV_HEADS, HEAD)
                page[:, 1] = v.transpose(1, 0, 2)
                if images.keys is not None:  # the first head's K, transposed as the CPU backend keeps it
                    k = turned_keys(images, block_tokens(block, family), block_start(block))
                    page[0, 0] = np.ascontiguousarray(k.T).reshape(BLOCK_TOKENS, HEAD)
        elif fill and images is not None:  # layer 0's conv rows: the images of each block's tokens
            for block in range(NUM_BLOCKS):
                rows = images.images(block_tokens(block)).astype(np.float32)
                self.buffers[0][block, :8 << 10] = rows.view(np.uint8).reshape(-1)
        self.caches = {f"model.layers.{i}": buffer for i, buffer in enumerate(self.buffers)}
        if device == "cuda":
            import torch

            self.buffers = [torch.from_numpy(buffer).cuda() for buffer in self.buffers]
            self.caches = {f"model.layers.{i}": buffer for i, buffer in enumerate(self.buffers)}

    def address(self, layer: int, block: int = 0) -> int:
        buffer = self.buffers[layer]
        return (buffer.ctypes.data if isinstance(buffer, np.ndarray) else buffer.data_ptr()) + block * PAGE

    def register(self, store) -> None:
        for layer in range(LAYERS):
            if store.register_buffer(self.address(layer), NUM_BLOCKS * PAGE) != 0:
                raise SystemExit("register_buffer failed")

    def batch(self, count: int) -> tuple[list[list[int]], list[list[int]]]:
        blocks = [1 + i % (NUM_BLOCKS - 1) for i in range(count)]
        return ([[self.address(layer, b) for layer in range(LAYERS)] for b in blocks],
                [[PAGE] * LAYERS for _ in blocks])


def keys_of(count: int, tag: str = "") -> list[str]:
    return [f"bench{tag}@tp_rank:0@pcp0@dcp0@pp_rank:0@group:1@{i:032x}" for i in range(count)]


def write_prefix_records(directory: Path, keys: list[str], family: str = "mamba2") -> None:
    """Each key's hash -> the digest of its block's tokens, as the consumer's scheduler records them
    (key i is loaded into block 1 + i % (NUM_BLOCKS - 1), `KVMemory.batch`): a conv window, or a KV block."""
    from audit.prefixrecords import prefix_line

    directory.mkdir(parents=True, exist_ok=True)
    blocks = [1 + i % (NUM_BLOCKS - 1) for i in range(len(keys))]
    lines = [prefix_line(key.rpartition("@")[2], None, None, block_tokens(block, family), block_start(block))
             if family == "llama" else prefix_line(key.rpartition("@")[2], 2, block_tokens(block))
             for key, block in zip(keys, blocks)]
    (directory / "prefixes-bench-0-0000.jsonl").write_text("\n".join(lines) + "\n")


def median_us(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6


def guard(record_dir: Path, name: str, described: bool, model_path: Path | None = None,
          family: str = "mamba2", caches: dict | None = None) -> LoadGuard:
    """A load guard; with `model_path`, binding at layer 0 under that checkpoint (its images built now);
    `caches`: the consumer's (host or GPU memory)."""
    binder = StateBinder(record_dir / name) if model_path is not None else None
    made = LoadGuard(DenyList(record_dir / name, RecordWriter(record_dir / name, stem="denied")), binder)
    if described:
        made.describe(manifest(model_path, family), caches or {})
    if binder is not None:
        binder.building.join()
        if binder.status != "bound":
            raise SystemExit(f"binding: {binder.status}")
    return made


def time_cluster(cluster: LocalCluster, keys_per_load: int, loads: int, record_dir: Path,
                 model: Path, family: str = "mamba2", device: str = "cpu") -> dict[str, float]:
    from mooncake.store import MooncakeDistributedStore, ReplicateConfig

    def connect(store_class):
        store = store_class()
        if store.setup("127.0.0.1", cluster.metadata_url, 0, 16 << 20, "tcp", "", cluster.master_address) != 0:
            raise SystemExit("cannot connect to the embedded cluster")
        return store

    producer = connect(MooncakeDistributedStore)
    source = KVMemory(fill=True, images=token_images(model, MODEL, 1, 0), family=family)
    source.register(producer)
    keys = keys_of(keys_per_load)
    write_prefix_records(record_dir / "guard-bound", keys, family)
    if any(producer.batch_put_from_multi_buffers(keys, *source.batch(keys_per_load), ReplicateConfig())):
        raise SystemExit("put failed")

    def recording(name: str, load_guard=None):
        return recording_store_class(MooncakeDistributedStore, RecordWriter(record_dir / name),
                                     loads=RecordWriter(record_dir / name, stem="loads"), load_guard=load_guard)

    classes = {"bare": MooncakeDistributedStore, "bare again": MooncakeDistributedStore,
               "recording": recording("recording"),
               "guard": recording("guard", lambda: guard(record_dir, "guard", True, family=family)),
               "guard, no manifest": recording("guard-plain", lambda: guard(record_dir, "guard-plain", False)),
               "guard, bound": recording("guard-bound", lambda: guard(record_dir, "guard-bound", True, model, family))}
    stores, memory = {}, {}
    for name, store_class in classes.items():
        stores[name] = connect(store_class)
        memory[name] = KVMemory(fill=False, device=device)
        memory[name].register(stores[name])
        if name.startswith("guard"):  # (no manifest: an empty one, which describes no region)
            document = {} if name == "guard, no manifest" else manifest(model if name == "guard, bound" else None, family)
            stores[name].audit_describe(document, memory[name].caches)
    samples: dict[str, list[float]] = {name: [] for name in stores}
    names = list(stores)
    for round_index in range(loads + 1):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            addrs, sizes = memory[name].batch(keys_per_load)
            start = time.perf_counter()
            results = stores[name].batch_get_into_multi_buffers(keys, addrs, sizes)
            elapsed = time.perf_counter() - start
            if any(result != LAYERS * PAGE for result in results):
                raise SystemExit(f"{name}: load failed or refused: {results}")
            if round_index:
                samples[name].append(elapsed)
    producer.batch_remove(keys, True)
    for store in [producer, *stores.values()]:
        store.close()
    return {name: median_us(values) for name, values in samples.items()}


def time_puts(cluster: LocalCluster, keys_per_load: int, loads: int, record_dir: Path,
              model: Path, family: str = "mamba2", device: str = "cpu") -> dict[str, float]:
    """The producer's side: one put of `keys_per_load` values from registered KV memory, bare, through
    the put guard (null-block test and records), and through the put guard bound at layer 0 (every
    value's rows decoded under the producer's weights and compared with its hash's prefix record).
    Each round puts fresh keys (the same hashes) and removes them, untimed."""
    from mooncake.store import MooncakeDistributedStore, ReplicateConfig

    write_prefix_records(record_dir / "put-bound", keys_of(keys_per_load), family)
    classes = {"put bare": MooncakeDistributedStore,
               "put, guard": recording_store_class(MooncakeDistributedStore, RecordWriter(record_dir / "put"),
                                                   guard=True),
               "put, guard bound": recording_store_class(MooncakeDistributedStore,
                                                         RecordWriter(record_dir / "put-bound"), guard=True)}
    source = KVMemory(fill=True, images=token_images(model, MODEL, 1, 0), family=family, device=device)
    stores = {}
    for name, store_class in classes.items():
        store = stores[name] = store_class()
        if store.setup("127.0.0.1", cluster.metadata_url, 0, 16 << 20, "tcp", "", cluster.master_address) != 0:
            raise SystemExit("cannot connect to the embedded cluster")
        source.register(store)
        if name == "put, guard bound":
            store.audit_describe(manifest(model, family), source.caches)
            store.audit_put_binder.building.join()
            if store.audit_put_binder.status != "bound":
                raise SystemExit(f"put binding: {store.audit_put_binder.status}")
    samples: dict[str, list[float]] = {name: [] for name in stores}
    names = list(stores)
    for round_index in range(loads + 1):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            keys = keys_of(keys_per_load, f"-put{round_index}-{names.index(name)}")
            start = time.perf_counter()
            results = stores[name].batch_put_from_multi_buffers(keys, *source.batch(keys_per_load), ReplicateConfig())
            elapsed = time.perf_counter() - start
            if any(results):
                raise SystemExit(f"{name}: put failed or withheld: {results}")
            stores[name].batch_remove(keys, True)
            if round_index:
                samples[name].append(elapsed)
    for store in stores.values():
        store.close()
    return {name: median_us(values) for name, values in samples.items()}


def time_check(keys_per_load: int, loads: int, record_dir: Path, model: Path,
               family: str = "mamba2", device: str = "cpu") -> dict[str, float]:
    """The guard's check alone, on values already in memory (what it adds to a load, less the record)."""
    memory = KVMemory(fill=True, images=token_images(model, MODEL, 1, 0), family=family, device=device)
    addrs, sizes = memory.batch(keys_per_load)
    keys, results = keys_of(keys_per_load), [LAYERS * PAGE] * keys_per_load
    write_prefix_records(record_dir / "check-bound", keys, family)
    guards = {"check": guard(record_dir, "check", True, family=family, caches=memory.caches),
              "check, no manifest": guard(record_dir, "check-plain", False),
              "check, bound": guard(record_dir, "check-bound", True, model, family, memory.caches)}
    guards["check, no manifest"].describe({}, memory.caches)  # no region described; the caches, where they are
    swapped = keys[1:] + keys[:1]  # every hash's record names another block's tokens: all refused
    if set(guards["check, bound"].check(swapped, addrs, sizes, results).values()) != {"PREFIX_MISMATCH"}:
        raise SystemExit("binding: a state of other tokens than its record's was not refused")
    samples: dict[str, list[float]] = {name: [] for name in guards}
    for _ in range(loads):
        for name, made in guards.items():
            start = time.perf_counter()
            if made.check(keys, addrs, sizes, results):
                raise SystemExit(f"{name}: a healthy value was refused")
            samples[name].append(time.perf_counter() - start)
    return {name: median_us(values) for name, values in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loads", type=int, default=60, help="timed loads per mode on the cluster (default 60)")
    parser.add_argument("--keys", type=int, default=8, help="keys (1 MiB values) per load (default 8)")
    parser.add_argument("--family", choices=("mamba2", "llama"), default="mamba2",
                        help="the values: a Mamba2 hybrid's state keys (default) or a Llama's attention blocks")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where the consumer's KV memory is (cuda: the CUDA build of Mooncake, loads into HBM)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="load-guard-bench-") as scratch:  # (the model and records: 78 MB)
        record_dir = Path(scratch)
        os.environ.setdefault("MOONCAKE_AUDIT_CACHE", str(record_dir / "cache"))
        model = write_model(record_dir / MODEL, args.family)
        with LocalCluster(holders=1, segment_mb=512) as cluster:
            real = time_cluster(cluster, args.keys, args.loads, record_dir, model, args.family, args.device)
            puts = time_puts(cluster, args.keys, args.loads, record_dir, model, args.family, args.device)
        check = time_check(args.keys, args.loads * 10, record_dir, model, args.family, args.device)
    print(f"{args.keys} keys of {LAYERS * PAGE >> 20} MiB per load ({LAYERS} pages of {PAGE >> 10} KiB); medians of "
          f"{args.loads} loads on the cluster, {args.loads * 10} checks in memory; microseconds per load")
    for name, value in real.items():
        print(f"  cluster  {name:<20} {value:>10.1f}  {value / real['bare']:.3f}x bare")
    for name, value in puts.items():
        print(f"  cluster  {name:<20} {value:>10.1f}  {value / puts['put bare']:.3f}x a bare put")
    for name, value in check.items():
        print(f"  in-place {name:<20} {value:>10.1f}  {value / args.keys:>8.1f} per key  "
              f"{100 * value / real['bare']:.2f}% of a bare load")


if __name__ == "__main__":
    main()
