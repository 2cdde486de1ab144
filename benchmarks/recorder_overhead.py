"""What the block recorder adds to a put: the wrapper against the bare store call.

Run from the repository root:  python -m benchmarks.recorder_overhead [--puts 100] [--keys 16]

Two layouts shaped like vLLM's KV caches: mamba-130m's recurrent state (24 buffers, one segment of
57,344 bytes each) and a 32-layer K/V-first attention cache (32 buffers of two 32 KiB segments).
For each, per-put microseconds of `batch_put_from_multi_buffers`:

1. on the embedded cluster (TCP loopback): bare client against recording client, guard off and on
   (no key is null-backed, so all move the same bytes), and a second bare client whose difference
   from the first is the noise floor. Modes are interleaved put by put, each first equally often;
   every put uses fresh keys, removed again outside the timing;
2. store stubbed (returns at once): the wrapper's own cost, block derivation and record writing,
   shown per key and as a share of the bare put on the cluster.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

import numpy as np  # noqa: E402

from audit.cluster import LocalCluster  # noqa: E402
from audit.recorder.records import RecordWriter  # noqa: E402
from audit.recorder.wrapper import recording_store_class  # noqa: E402

LAYOUTS = {  # name: (buffers, segments per buffer, segment block length)
    "mamba-130m": (24, 1, 57_344),
    "attn-32L-kv": (32, 2, 32_768),
}
NUM_BLOCKS = 17


class KVCache:
    """Filled KV-cache buffers and the connector's per-key addresses into them."""

    def __init__(self, buffers: int, halves: int, segment_len: int):
        rng = np.random.default_rng(0)
        self.buffers = [rng.integers(0, 256, (halves, NUM_BLOCKS, segment_len), dtype=np.uint8)
                        for _ in range(buffers)]
        self.segment_len = segment_len
        self.bases = [b.ctypes.data + h * b[0].nbytes for b in self.buffers for h in range(halves)]

    def register(self, store) -> None:
        for buffer in self.buffers:
            store.register_buffer(buffer.ctypes.data, buffer.nbytes)

    def batch(self, keys: list[str]) -> tuple[list[list[int]], list[list[int]]]:
        block_ids = [1 + i % (NUM_BLOCKS - 1) for i in range(len(keys))]  # never the null block
        addrs = [[base + block_id * self.segment_len for base in self.bases] for block_id in block_ids]
        return addrs, [[self.segment_len] * len(self.bases) for _ in keys]


class StubStore:
    """The store with its put stubbed out: what remains is the wrapper's own work."""

    def register_buffer(self, buffer_ptr, size):
        return 0

    def batch_put_from_multi_buffers(self, keys, all_buffer_ptrs, all_sizes, config=None):
        return [0] * len(keys)


def median_us(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6


def time_stub(cache: KVCache, keys_per_put: int, puts: int, record_dir: Path) -> dict[str, float]:
    keys = [f"bench@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@{i:032x}" for i in range(keys_per_put)]
    addrs, sizes = cache.batch(keys)
    stores = {"bare": StubStore(),
              "recording": recording_store_class(StubStore, RecordWriter(record_dir / "stub"))(),
              "guard": recording_store_class(StubStore, RecordWriter(record_dir / "stub-guard"), guard=True)()}
    for store in stores.values():
        cache.register(store)
    samples: dict[str, list[float]] = {name: [] for name in stores}
    for _ in range(puts):
        for name, store in stores.items():
            start = time.perf_counter()
            store.batch_put_from_multi_buffers(keys, addrs, sizes)
            samples[name].append(time.perf_counter() - start)
    return {name: median_us(values) for name, values in samples.items()}


def time_cluster(cluster: LocalCluster, cache: KVCache, keys_per_put: int, puts: int,
                 record_dir: Path) -> dict[str, float]:
    from mooncake.store import MooncakeDistributedStore, ReplicateConfig

    classes = {"bare": MooncakeDistributedStore,
               "bare again": MooncakeDistributedStore,  # an A/A control: the noise floor of this comparison
               "recording": recording_store_class(MooncakeDistributedStore, RecordWriter(record_dir / "cluster")),
               "guard": recording_store_class(MooncakeDistributedStore, RecordWriter(record_dir / "cluster-guard"),
                                              guard=True)}
    stores = {}
    for name, store_class in classes.items():
        store = store_class()
        if store.setup("127.0.0.1", cluster.metadata_url, 0, 16 << 20, "tcp", "", cluster.master_address) != 0:
            raise SystemExit("cannot connect to the embedded cluster")
        cache.register(store)
        stores[name] = store
    config = ReplicateConfig()
    samples: dict[str, list[float]] = {name: [] for name in stores}
    names = list(stores)
    for round_index in range(puts + 1):
        shift = round_index % len(names)  # each mode goes first equally often
        for name in names[shift:] + names[:shift]:
            store = stores[name]
            keys = [f"bench-{name.replace(' ', '-')}-{round_index}@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@{i:032x}"
                    for i in range(keys_per_put)]
            addrs, sizes = cache.batch(keys)
            start = time.perf_counter()
            results = store.batch_put_from_multi_buffers(keys, addrs, sizes, config)
            elapsed = time.perf_counter() - start
            if any(result != 0 for result in results):
                raise SystemExit(f"put failed: {results}")
            if round_index:  # the first round warms connections up
                samples[name].append(elapsed)
            store.batch_remove(keys, True)
    for store in stores.values():
        store.close()
    return {name: median_us(values) for name, values in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--puts", type=int, default=100, help="timed puts per mode on the cluster (default 100)")
    parser.add_argument("--keys", type=int, default=16, help="keys per put (default 16)")
    args = parser.parse_args()
    record_dir = Path(tempfile.mkdtemp(prefix="recorder-bench-"))
    print(f"{args.keys} keys per put; medians of {args.puts} puts on the cluster, {args.puts * 10} stubbed; "
          f"records in {record_dir}")
    print(f"{'layout':<12} {'segs':>4} | {'cluster: bare':>13} {'bare again':>10} {'recording':>10} {'guard':>10} | "
          f"{'stubbed: bare':>13} {'recording':>10} {'guard':>10} | {'wrapper/key':>11} {'of bare put':>11}")
    with LocalCluster(holders=1, segment_mb=1024) as cluster:
        for name, shape in LAYOUTS.items():
            cache = KVCache(*shape)
            stub = time_stub(cache, args.keys, args.puts * 10, record_dir)
            real = time_cluster(cluster, cache, args.keys, args.puts, record_dir)
            wrapper = max(stub["recording"], stub["guard"]) - stub["bare"]
            print(f"{name:<12} {len(cache.bases):>4} | {real['bare']:>13.1f} {real['bare again']:>10.1f} "
                  f"{real['recording']:>10.1f} "
                  f"{real['guard']:>10.1f} | {stub['bare']:>13.1f} {stub['recording']:>10.1f} {stub['guard']:>10.1f} | "
                  f"{wrapper / args.keys:>11.2f} {100 * wrapper / real['bare']:>10.2f}%")
    lines = [line for path in record_dir.rglob("blocks-*.jsonl") for line in path.read_text().splitlines()]
    print(f"all times in microseconds per put; records: {len(lines)} lines, "
          f"{sum(map(len, lines)) / max(len(lines), 1) + 1:.0f} bytes per key on average")


if __name__ == "__main__":
    main()
