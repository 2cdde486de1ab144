"""What the load recorder and the load guard add to a consumer's load (issue #29 §6).

Run from the repository root:  python -m benchmarks.load_guard [--loads 60] [--keys 8]

A producer publishes 1 MiB values shaped like a Mamba2 hybrid's state key (16 layers, one 64 KiB
page each: a float32 conv state of 8 KiB, a float32 ssm state of 48 KiB, 8 KiB of zero padding) and a
consumer loads them into its own registered KV memory with `batch_get_into_multi_buffers`, `--keys`
keys a load (a request's hit). Per-load microseconds, modes interleaved load by load, each first
equally often, on one embedded cluster (TCP loopback):

- ``bare``, ``bare again`` (an A/A control: the noise floor), ``recording`` (load records only),
  ``guard`` (records, deny list, in-place check by the consumer's manifest: zero test of each state,
  NaN/Inf screen of each float32 state) and ``guard, no manifest`` (zero test per segment only);
- the guard's own check with the store stubbed, per key, and as a share of a bare load.
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
from audit.recorder.deny import DenyList  # noqa: E402
from audit.recorder.guard import LoadGuard  # noqa: E402
from audit.recorder.records import RecordWriter  # noqa: E402
from audit.recorder.wrapper import recording_store_class  # noqa: E402

LAYERS, PAGE = 16, 64 << 10
STATES = [("conv", 0, 8 << 10), ("ssm", 8 << 10, 48 << 10)]  # float32; the rest of the page is padding
NUM_BLOCKS = 9


def manifest() -> dict:
    return {"groups": [{"group": 1, "kind": "mamba2",
                        "states": [{"name": n, "offset": o, "length": length, "dtype": "float32"}
                                   for n, o, length in STATES],
                        "segments": [{"block_len": PAGE, "layer": f"model.layers.{i}", "offset_in_page": 0}
                                     for i in range(LAYERS)]}]}


class KVMemory:
    """LAYERS registered buffers of NUM_BLOCKS pages; block 0 unused (vLLM's null block)."""

    def __init__(self, fill: bool):
        rng = np.random.default_rng(1)
        self.buffers = []
        for _ in range(LAYERS):
            pages = np.zeros((NUM_BLOCKS, PAGE), np.uint8)
            if fill:
                states = rng.normal(size=(NUM_BLOCKS, (56 << 10) // 4)).astype(np.float32)
                pages[:, :56 << 10] = states.view(np.uint8)
            self.buffers.append(pages)

    def register(self, store) -> None:
        for buffer in self.buffers:
            store.register_buffer(buffer.ctypes.data, buffer.nbytes)

    def batch(self, count: int) -> tuple[list[list[int]], list[list[int]]]:
        blocks = [1 + i % (NUM_BLOCKS - 1) for i in range(count)]
        return ([[buffer[b].ctypes.data for buffer in self.buffers] for b in blocks],
                [[PAGE] * LAYERS for _ in blocks])


def keys_of(count: int, tag: str = "") -> list[str]:
    return [f"bench{tag}@tp_rank:0@pcp0@dcp0@pp_rank:0@group:1@{i:032x}" for i in range(count)]


def median_us(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6


def guard(record_dir: Path, name: str, described: bool) -> LoadGuard:
    made = LoadGuard(DenyList(record_dir / name, RecordWriter(record_dir / name, stem="denied")))
    if described:
        made.describe(manifest(), {})
    return made


def time_cluster(cluster: LocalCluster, keys_per_load: int, loads: int, record_dir: Path) -> dict[str, float]:
    from mooncake.store import MooncakeDistributedStore, ReplicateConfig

    def connect(store_class):
        store = store_class()
        if store.setup("127.0.0.1", cluster.metadata_url, 0, 16 << 20, "tcp", "", cluster.master_address) != 0:
            raise SystemExit("cannot connect to the embedded cluster")
        return store

    producer, source = connect(MooncakeDistributedStore), KVMemory(fill=True)
    source.register(producer)
    keys = keys_of(keys_per_load)
    if any(producer.batch_put_from_multi_buffers(keys, *source.batch(keys_per_load), ReplicateConfig())):
        raise SystemExit("put failed")

    def recording(name: str, load_guard=None):
        return recording_store_class(MooncakeDistributedStore, RecordWriter(record_dir / name),
                                     loads=RecordWriter(record_dir / name, stem="loads"), load_guard=load_guard)

    classes = {"bare": MooncakeDistributedStore, "bare again": MooncakeDistributedStore,
               "recording": recording("recording"),
               "guard": recording("guard", lambda: guard(record_dir, "guard", True)),
               "guard, no manifest": recording("guard-plain", lambda: guard(record_dir, "guard-plain", False))}
    stores, memory = {}, {}
    for name, store_class in classes.items():
        stores[name] = connect(store_class)
        memory[name] = KVMemory(fill=False)
        memory[name].register(stores[name])
        if name == "guard":
            stores[name].audit_describe(manifest(), {})
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


def time_check(keys_per_load: int, loads: int, record_dir: Path) -> dict[str, float]:
    """The guard's check alone, on values already in memory (what it adds to a load, less the record)."""
    memory = KVMemory(fill=True)
    addrs, sizes = memory.batch(keys_per_load)
    keys, results = keys_of(keys_per_load), [LAYERS * PAGE] * keys_per_load
    guards = {"check": guard(record_dir, "check", True), "check, no manifest": guard(record_dir, "check-plain", False)}
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
    args = parser.parse_args()
    record_dir = Path(tempfile.mkdtemp(prefix="load-guard-bench-"))
    with LocalCluster(holders=1, segment_mb=512) as cluster:
        real = time_cluster(cluster, args.keys, args.loads, record_dir)
    check = time_check(args.keys, args.loads * 10, record_dir)
    print(f"{args.keys} keys of {LAYERS * PAGE >> 20} MiB per load ({LAYERS} pages of {PAGE >> 10} KiB); medians of "
          f"{args.loads} loads on the cluster, {args.loads * 10} checks in memory; microseconds per load")
    for name, value in real.items():
        print(f"  cluster  {name:<20} {value:>10.1f}  {value / real['bare']:.3f}x bare")
    for name, value in check.items():
        print(f"  in-place {name:<20} {value:>10.1f}  {value / args.keys:>8.1f} per key  "
              f"{100 * value / real['bare']:.2f}% of a bare load")


if __name__ == "__main__":
    main()
