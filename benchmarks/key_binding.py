"""What binding layer 0's rotary K adds (issue #40): in the load guard, and in the scan's judging of
attention pages, each against the same code on the same checkpoint less ``k_proj`` (K not bound).

Run from the repository root:  python -m benchmarks.key_binding [--calls 3000] [--pages 1000] [--rounds 5]

The model and the values are `benchmarks.load_guard`'s Llama (8 KV heads of 64, hidden 512, a
32,000-token vocabulary, random weights; 1 MiB values of 16 float32 pages, layer 0's V the images of
the block's tokens and its first KV head's K their K at the block's start, transposed as vLLM's CPU
backend keeps it), with every key's prefix record and start. Both are function timings in one
process, the two checkpoints in turn, medians:

- ``guard``: `LoadGuard.check` of one load of 8 keys (its zero and NaN check, V's binding, K's);
- ``scan``: `bind_values` of `--pages` values (V's binding, the prefix check, K's).

Every call's verdicts are checked: nothing refused, nothing flagged, every page's K checked.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks import load_guard as guarded

V_ONLY = ("model.embed_tokens.weight", "model.layers.0.input_layernorm.weight", "model.layers.0.self_attn.v_proj.weight")


def checkpoints(root: Path) -> tuple[Path, Path]:
    """The Llama with ``k_proj``, and the same tensors less it (same name, so the same keys bind)."""
    from audit.layouts.checkpoint import Checkpoint
    from tests.helpers import write_safetensors

    with_k = guarded.write_model(root / "k" / "llama-bench", "llama")
    without_k = root / "v" / "llama-bench"
    without_k.mkdir(parents=True)
    shutil.copy(with_k / "config.json", without_k / "config.json")
    tensors = Checkpoint(with_k)
    write_safetensors(without_k / "model.safetensors", {name: tensors.tensor(name) for name in V_ONLY})
    return with_k, without_k


def time_guard(root: Path, with_k: Path, without_k: Path, memory, calls: int) -> tuple[float, float]:
    addrs, sizes = memory.batch(8)
    keys, results = guarded.keys_of(8), [guarded.LAYERS * guarded.PAGE] * 8
    for name in ("k", "v"):  # (each guard reads its own directory's records)
        guarded.write_prefix_records(root / "records" / name, keys, "llama")
    both = [guarded.guard(root / "records", name, True, model, "llama", memory.caches)
            for name, model in (("k", with_k), ("v", without_k))]
    if both[0].binder.images.keys is None or both[1].binder.images.keys is not None:
        raise SystemExit("the two checkpoints do not bind K and V alone")
    samples: list[list[float]] = [[], []]
    for _ in range(calls):
        for guard, times in zip(both, samples):
            started = time.perf_counter()
            refused = guard.check(keys, addrs, sizes, results)
            times.append(time.perf_counter() - started)
            if refused:
                raise SystemExit(f"a healthy load was refused: {refused}")
    return statistics.median(samples[0]), statistics.median(samples[1])


def time_scan(root: Path, with_k: Path, without_k: Path, memory, pages: int, rounds: int) -> tuple[float, float]:
    import numpy as np

    from audit.judge.binding import Bindings, Values, bind_values
    from audit.judge.key import judge_read
    from audit.judge.plan import load_layouts
    from audit.prefixtable import read_prefix_records
    from audit.records import KeyInfo

    layout = next(layout for layout in load_layouts(model_configs=[with_k], kv_cache_dtype="float32", block_size=16,
                                                    model_dtype="float32", tp_given=True) if layout.tp_size == 1)
    blocks = [1 + i % (guarded.NUM_BLOCKS - 1) for i in range(pages)]
    values = [np.concatenate([memory.buffers[layer][block] for layer in range(guarded.LAYERS)])[:layout.size]
              for block in blocks]
    keys = guarded.keys_of(pages, "scan")
    guarded.write_prefix_records(root / "records" / "scan", keys, "llama")
    table = read_prefix_records([root / "records" / "scan"])

    def judged(model: Path) -> float:
        records = [judge_read(KeyInfo(key, layout.size), layout.size, None) for key in keys]
        for record in records:
            record.verdicts.clear()
        bindings = Bindings.of([model], layout.model)
        bindings.prefixes = table
        images = bindings.images(layout.model, 1, 0)  # (the tables built before the clock, as a scan's first batch does)
        for warmed in ("table", "table_squares", "probe_signs", "twins"):
            getattr(images, warmed)
        started = time.perf_counter()
        bind_values(records, Values.listed(values), [(layout,)] * pages, bindings)
        elapsed = time.perf_counter() - started
        if any(record.verdicts for record in records) or bindings.k_checked != (pages if model == with_k else 0):
            raise SystemExit("the scan flagged a healthy page, or did not check every page's K")
        return elapsed / pages

    samples: list[list[float]] = [[], []]
    for _ in range(rounds):
        for model, times in zip((with_k, without_k), samples):
            times.append(judged(model))
    return statistics.median(samples[0]), statistics.median(samples[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--pages", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    from audit.layouts.weights import token_images

    with tempfile.TemporaryDirectory(prefix="key-binding-") as scratch:
        root = Path(scratch)
        os.environ.setdefault("MOONCAKE_AUDIT_CACHE", str(root / "cache"))  # (its tables are its own)
        with_k, without_k = checkpoints(root)
        memory = guarded.KVMemory(fill=True, images=token_images(with_k, guarded.MODEL, 1, 0), family="llama")
        guard_k, guard_v = time_guard(root, with_k, without_k, memory, args.calls)
        scan_k, scan_v = time_scan(root, with_k, without_k, memory, args.pages, args.rounds)
    print(f"guard, a load of 8 keys: with K {guard_k * 1e6:.1f} us, without {guard_v * 1e6:.1f} us, "
          f"K {(guard_k - guard_v) * 1e6:.1f} us")
    print(f"scan, a page: with K {scan_k * 1e6:.1f} us, without {scan_v * 1e6:.1f} us, K {(scan_k - scan_v) * 1e6:.1f} us")


if __name__ == "__main__":
    main()
