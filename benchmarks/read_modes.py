"""Throughput of the two read modes, side by side: `lease` (batch_get_into) and `peek` (raw
TransferEngine reads of every replica, descriptors asked before and after). `fetch` reads only;
`scan` is `scan_keys` with the host checker (reads overlap checks, as in a real scan).

One embedded cluster with two holders; each workload is published under its own prefix, then
read whole by each reader in alternating rounds (the round's first reader alternates), so drift
spreads evenly. Logical bytes are the values' sizes; peek also reads every further replica.

    python -m benchmarks.read_modes [--rounds 3] [--keys 1000]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

import numpy as np  # noqa: E402
from mooncake.store import ReplicateConfig  # noqa: E402

from audit.checks.host import HostChecker  # noqa: E402
from audit.cluster import LocalCluster  # noqa: E402
from audit.connection import AdminClient, Settings, open_store  # noqa: E402
from audit.readers.buffers import RegisteredBuffer, plan_batches  # noqa: E402
from audit.readers.lease import LeaseReader  # noqa: E402
from audit.readers import PeekReader  # noqa: E402
from audit.run.scan import scan_keys  # noqa: E402
from audit.sources.listing import AdminListing, KeyFilter  # noqa: E402

BUFFER_BYTES = 256 << 20


def publish(store, prefix: str, count: int, size: int, replicas: int) -> None:
    config = ReplicateConfig()
    config.replica_num = replicas
    per_batch = max(1, min(1000, (64 << 20) // size))
    buffer = RegisteredBuffer(store, per_batch * size)
    buffer.array[:] = np.random.default_rng(0).integers(1, 255, buffer.nbytes, dtype=np.uint8)
    try:
        base = buffer.array.ctypes.data
        for start in range(0, count, per_batch):
            names = [f"{prefix}{i:07d}" for i in range(start, min(start + per_batch, count))]
            for slot in range(len(names)):  # unique values
                buffer.array[slot * size: slot * size + 8] = np.frombuffer(names[slot][-7:].encode() + b"\0", np.uint8)
            codes = store.batch_put_from(names, [base + slot * size for slot in range(len(names))],
                                         [size] * len(names), config)
            if any(code != 0 for code in codes):
                raise RuntimeError(f"publishing {prefix}: {sum(code != 0 for code in codes)} puts failed")
    finally:
        buffer.release()


def read_all(reader, keys) -> float:
    started = time.perf_counter()
    for turn, slots in enumerate(plan_batches(keys, reader.capacity)):
        batch = reader.fetch(slots, turn)
        if any(code != slot.key.size for slot, code in zip(batch.slots, batch.results)):
            raise RuntimeError(f"{reader.mode}: reads failed: {sorted(set(batch.results))[:3]}")
        batch.release()
    return time.perf_counter() - started


def scan_all(reader, keys) -> float:
    started = time.perf_counter()
    records = list(scan_keys(keys, reader, HostChecker()))
    if any(record.xxh3 is None for record in records):
        raise RuntimeError(f"{reader.mode}: some keys were not read")
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--keys", type=int, default=1000, help="1 MiB keys per workload")
    args = parser.parse_args()
    workloads = [  # (prefix, keys, value bytes, replicas)
        ("mib-r1/", args.keys, 1 << 20, 1),
        ("mib-r2/", args.keys, 1 << 20, 2),
        ("4k-r1/", args.keys * 20, 4096, 1),
    ]
    segment_mb = int(sum(n * size * r for _, n, size, r in workloads) / 2 * 1.4 / (1 << 20)) + 128
    with LocalCluster(holders=2, segment_mb=segment_mb) as cluster:
        settings = Settings(master=cluster.master_address, metadata=cluster.metadata_url,
                            admin=cluster.admin_url, local_hostname="127.0.0.1")
        admin = AdminClient(settings.admin)
        store = open_store(settings)
        readers = [LeaseReader(store, BUFFER_BYTES), PeekReader(settings, admin, BUFFER_BYTES)]
        try:
            print(f"{'workload':10} {'keys':>6} {'mode':5} {'fetch s':>8} {'GB/s':>6} {'keys/s':>7} "
                  f"{'scan s':>7} {'GB/s':>6}")
            for prefix, count, size, replicas in workloads:
                publish(store, prefix, count, size, replicas)
                keys = AdminListing(admin, KeyFilter(prefix)).list().keys
                assert len(keys) == count, f"{prefix}: listed {len(keys)} of {count}"
                fetches: dict[str, list[float]] = {reader.mode: [] for reader in readers}
                scans: dict[str, list[float]] = {reader.mode: [] for reader in readers}
                for round_index in range(args.rounds):
                    order = readers if round_index % 2 == 0 else readers[::-1]
                    for reader in order:
                        fetches[reader.mode].append(read_all(reader, keys))
                        scans[reader.mode].append(scan_all(reader, keys))
                for mode in fetches:
                    fetch, scan = statistics.median(fetches[mode]), statistics.median(scans[mode])
                    print(f"{prefix:10} {count:6d} {mode:5} {fetch:8.3f} {count * size / fetch / 1e9:6.2f} "
                          f"{count / fetch:7.0f} {scan:7.3f} {count * size / scan / 1e9:6.2f}")
        finally:
            for reader in readers:
                reader.close()
            store.close()


if __name__ == "__main__":
    main()
