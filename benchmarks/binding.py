"""Layer-0 binding's cost (issue #40): whole `scan` processes of one Mamba2 (or Llama) store, given the model
directory with its checkpoint (every key bound; its probe kept in the cache from an earlier run, as
for a scan from cron, or built afresh; and with the producer's prefix records, `--block-tables`, so
every key's decoded tokens are also checked against its hash's digest: PREFIX_MISMATCH) against the
same config.json without it (no binding), interleaved, in one run.

    python -m benchmarks.binding                    # 160 keys of 9.7 MB (1.55 GB), 5 pairs
    python -m benchmarks.binding --keys 8 --runs 1  # a smoke run
    python -m benchmarks.binding --geometry small --keys 1000000 --runs 2 --no-fresh-probe  # a million keys
    python -m benchmarks.binding --device cuda --before DIR  # on a GPU host, and DIR's scan beside it
    python -m benchmarks.binding --family llama --keys 1000  # an attention store: V and K bound
    python -m benchmarks.binding --family llama --geometry small --keys 1000000 --runs 2 --no-fresh-probe

`--geometry small` is the same vocabulary and layer-0 rule on a one-layer Mamba2 of hidden 32 (values of
a few hundred bytes), so that a million keys fit this machine: binding's per-key cost against a scan's.

The model is mamba2-130m's geometry (24 layers, hidden 768, d_inner 1536, one group, d_state 128,
24 heads of 64, vocabulary 50,288) with random bfloat16 weights: its checkpoint holds the tensors
layer 0's images need (embeddings 77 MB, layer 0's norm and in_proj). Each value is what vLLM on a
GPU publishes for it at TP 1 (conv and ssm state bfloat16, 9.7 MB): layer 0's conv rows are the
images of three random tokens rounded to bfloat16, every other byte a plausible state. One
`audit.cluster.LocalCluster` holds them. Both commands are `python -m cli scan --model-config DIR
--dtype bfloat16 --mamba-ssm-cache-dtype bfloat16 --format json`, timed from spawn to reaped exit
(`benchmarks.paired.run`), in turn A B C D, D C B A, ...; every run's report is checked (no finding, and
the summary's binding says the model was bound, or is absent).

`--family llama` is an attention store instead (with `--geometry small`, the same Llama cut to one layer
and one KV head, 8 KiB a key, so that a million keys fit this machine): `benchmarks.load_guard`'s Llama (16 layers, 8 KV heads of
64, hidden 512, a 32,000-token vocabulary, random float32 weights with ``k_proj``), each key a block of
16 tokens as vLLM's CPU backend publishes it at TP 1 (16 float32 pages of 64 KiB, 1 MiB): layer 0's V the
images of 16 random tokens, its first KV head's K their K at the block's start, every other byte a
plausible float32; the records name each block's tokens and start. Scanned with `--dtype float32
--block-size 16`, so V's rows, their tokens' digest and K at its positions are all checked.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

from benchmarks.common import machine, state_like, text_table  # noqa: E402
from benchmarks.load_guard import LLAMA  # noqa: E402
from benchmarks.paired import run  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
NAME = "mamba2-130m"
CONFIG = {"model_type": "mamba2", "architectures": ["Mamba2ForCausalLM"], "hidden_size": 768, "expand": 2,
          "n_groups": 1, "state_size": 128, "num_heads": 24, "head_dim": 64, "conv_kernel": 4,
          "num_hidden_layers": 24, "vocab_size": 50288, "layer_norm_epsilon": 1e-5, "torch_dtype": "bfloat16"}
GEOMETRIES = {"130m": CONFIG, "small": {**CONFIG, "hidden_size": 32, "state_size": 4, "num_heads": 2, "head_dim": 32,
                                         "num_hidden_layers": 1}}
FLAGS = {"mamba2": ["--dtype", "bfloat16", "--mamba-ssm-cache-dtype", "bfloat16"],
         "llama": ["--dtype", "float32", "--block-size", "16"]}
ATTENTION_NAME = "llama-bench"
ATTENTION_GEOMETRIES = {"130m": LLAMA, "small": {**LLAMA, "num_hidden_layers": 1, "num_key_value_heads": 1}}
PUT_BATCH = 1000  # keys put at once (as benchmarks.scale does: 4,096 at once failed with TRANSFER_FAIL)


def model_dirs(root: Path, config: dict) -> tuple[Path, Path]:
    """The model directory with its checkpoint, and one with only its config.json (same name)."""
    from tests.helpers import write_safetensors

    bound, unbound = root / "bound" / NAME, root / "unbound" / NAME
    for path in (bound, unbound):
        path.mkdir(parents=True)
        (path / "config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(40)
    hidden, inner = config["hidden_size"], config["expand"] * config["hidden_size"]
    rows = 2 * inner + 2 * config["n_groups"] * config["state_size"] + config["num_heads"]
    write_safetensors(bound / "model.safetensors", {
        "backbone.embeddings.weight": rng.standard_normal((config["vocab_size"], hidden), dtype=np.float32) * 0.02,
        "backbone.layers.0.norm.weight": 1 + 0.1 * rng.standard_normal(hidden, dtype=np.float32),
        "backbone.layers.0.mixer.in_proj.weight": rng.standard_normal((rows, hidden), dtype=np.float32) * 0.03,
    }, bfloat16=True)
    return bound, unbound


def attention_model_dirs(root: Path, config: dict) -> tuple[Path, Path]:
    """`benchmarks.load_guard`'s Llama of `config` with its checkpoint (V and K at layer 0), and its
    config.json alone."""
    from benchmarks.load_guard import write_model

    bound, unbound = root / "bound" / ATTENTION_NAME, root / "unbound" / ATTENTION_NAME
    write_model(bound, "llama", config)
    unbound.mkdir(parents=True)
    (unbound / "config.json").write_text(json.dumps(config))
    return bound, unbound


def _bfloat16(values: np.ndarray) -> np.ndarray:
    """float32 rounded to bfloat16 (to nearest, ties to even), as uint16 words."""
    bits = values.astype(np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


@contextmanager
def _put_buffer(cluster, rows: int, size: int):
    """A writer on `cluster` and a buffer of `rows` values of `size` bytes registered with it once: each
    batch is put from it (`_put`)."""
    from audit.connection import Settings
    from audit.workload import Publisher

    publisher = Publisher(Settings(master=cluster.master_address, metadata=cluster.metadata_url,
                                   admin=cluster.admin_url, local_hostname="127.0.0.1"))
    buffer = np.empty((rows, size), np.uint8)
    if publisher.store.register_buffer(buffer.ctypes.data, buffer.nbytes) != 0:
        publisher.close()
        raise SystemExit("register_buffer failed")
    try:
        yield publisher.store, buffer
    finally:
        publisher.store.unregister_buffer(buffer.ctypes.data)
        publisher.close()


def _put(store, buffer: np.ndarray, names: list[str]) -> None:
    """The buffer's first values put under `names`, one a row."""
    size = buffer.shape[1]
    codes = store.batch_put_from(names, [buffer.ctypes.data + slot * size for slot in range(len(names))], [size] * len(names))
    if any(code != 0 for code in codes):
        raise SystemExit(f"{sum(code != 0 for code in codes)} puts failed (first {min(codes)})")


def publish(cluster, bound: Path, keys: int, records: Path) -> int:
    """`keys` values of the model's layout, layer 0's conv rows the bfloat16 images of random tokens;
    each key's hash and its tokens' digest written to `records` as a producer's prefix records."""
    from audit.judge.plan import load_layouts
    from audit.layouts.weights import token_images
    from audit.prefixrecords import prefix_line
    from audit.producers.vllm import vllm_key

    (layout,) = load_layouts(model_configs=[bound], model_dtype="bfloat16", ssm_dtype="bfloat16")
    conv = next(region for segment, region in layout.regions() if segment.layer == 0 and region.name == "conv")
    images = token_images(bound, NAME, 1, 0)
    every_image = _bfloat16(images.images(np.arange(images.vocab_size)))  # (vocab, columns): each token's rows
    rng = np.random.default_rng(41)
    records.mkdir(parents=True, exist_ok=True)
    with _put_buffer(cluster, PUT_BATCH, layout.size) as (store, buffer), \
            (records / "prefixes-bench-0-0000.jsonl").open("w") as lines:
        for first in range(0, keys, PUT_BATCH):
            count = min(PUT_BATCH, keys - first)
            values = buffer[:count]
            values[:] = state_like(rng, count * layout.size).reshape(count, layout.size)
            tokens = rng.integers(0, images.vocab_size, (count, 3))
            values[:, conv.offset:conv.offset + conv.length] = every_image[tokens].view(np.uint8).reshape(count, -1)
            hashes = [hashlib.sha256(index.to_bytes(8, "little")).hexdigest()  # as vLLM's: sha256, uniform
                      for index in range(first, first + count)]
            lines.writelines(prefix_line(digest, 3, its_tokens) + "\n" for digest, its_tokens in zip(hashes, tokens))
            _put(store, buffer, [vllm_key(NAME, digest) for digest in hashes])
    return layout.size


def attention_size(config: dict) -> tuple[int, int]:
    """A key's float32 page a layer (KV heads x (K|V) x 16 tokens x head) and the key's size."""
    from benchmarks.load_guard import BLOCK_TOKENS

    page = config["num_key_value_heads"] * 2 * BLOCK_TOKENS * config["head_dim"] * 4
    return page, config["num_hidden_layers"] * page


def publish_attention(cluster, bound: Path, keys: int, records: Path, config: dict) -> int:
    """`keys` blocks of 16 random tokens at random block starts, each a float32 page a layer as vLLM's
    CPU backend publishes them (layer 0's V their images, its first head's K their K at the start);
    each key's hash, tokens and start written to `records` as a producer's prefix records."""
    from audit.layouts.weights import token_images
    from audit.prefixrecords import prefix_line
    from audit.producers.vllm import vllm_key
    from benchmarks.load_guard import BLOCK_TOKENS, turned_keys

    (page_bytes, size), kv_heads, head = attention_size(config), config["num_key_value_heads"], config["head_dim"]
    images = token_images(bound, ATTENTION_NAME, 1, 0)
    rng = np.random.default_rng(41)
    records.mkdir(parents=True, exist_ok=True)
    batch = max(1, min(PUT_BATCH, (64 << 20) // size))  # at most 64 MiB
    with _put_buffer(cluster, batch, size) as (store, buffer), \
            (records / "prefixes-bench-0-0000.jsonl").open("w") as lines:
        for first in range(0, keys, batch):
            count = min(batch, keys - first)
            buffer[:count] = rng.standard_normal((count, size // 4), dtype=np.float32).view(np.uint8)
            hashes = [hashlib.sha256(index.to_bytes(8, "little")).hexdigest() for index in range(first, first + count)]
            for slot, chunk_hash in enumerate(hashes):
                tokens = rng.integers(0, images.vocab_size, BLOCK_TOKENS).tolist()
                start = BLOCK_TOKENS * int(rng.integers(0, 256))
                page = buffer[slot, :page_bytes].view(np.float32).reshape(kv_heads, 2, BLOCK_TOKENS, head)
                page[:, 1] = images.images(tokens).reshape(BLOCK_TOKENS, kv_heads, head).transpose(1, 0, 2)
                page[0, 0] = np.ascontiguousarray(turned_keys(images, tokens, start).T).reshape(BLOCK_TOKENS, head)
                lines.write(prefix_line(chunk_hash, None, None, tokens, start) + "\n")
            _put(store, buffer, [vllm_key(ATTENTION_NAME, digest) for digest in hashes])
    return size


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=160)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--geometry", choices=GEOMETRIES, default="130m",
                        help="the Mamba2's; with --family llama, small is one layer of one KV head")
    parser.add_argument("--family", choices=FLAGS, default="mamba2", help="a Mamba2 store, or a Llama's attention blocks")
    parser.add_argument("--fresh-probe", action=argparse.BooleanOptionalAction, default=True,
                        help="also time a scan that builds the probe afresh")
    parser.add_argument("--device", default="auto", help="the scans' --device (cuda: values read into GPU memory)")
    parser.add_argument("--before", type=Path, help="a checkout whose scan with binding is timed too (\"binding, before\")")
    args = parser.parse_args()
    from audit.cluster import LocalCluster

    attention = args.family == "llama"
    with tempfile.TemporaryDirectory(prefix="bench-binding-") as scratch:
        if attention:
            config = ATTENTION_GEOMETRIES[args.geometry]
            (bound, unbound), name = attention_model_dirs(Path(scratch), config), ATTENTION_NAME
            value_size = attention_size(config)[1]
        else:
            (bound, unbound), name = model_dirs(Path(scratch), GEOMETRIES[args.geometry]), NAME
            from audit.judge.plan import load_layouts

            (layout,) = load_layouts(model_configs=[bound], model_dtype="bfloat16", ssm_dtype="bfloat16")
            value_size = layout.size
        segment_mb = int(args.keys * (value_size + 64) * 1.3 / (1 << 20)) + 256  # headroom: a full segment evicts
        with LocalCluster(holders=1, segment_mb=segment_mb) as cluster:
            records = Path(scratch) / "records"
            started = time.perf_counter()
            size = (publish_attention(cluster, bound, args.keys, records, config) if attention
                    else publish(cluster, bound, args.keys, records))
            print(f"published {args.keys:,} keys of {size:,} B in {time.perf_counter() - started:.0f} s",
                  file=sys.stderr)
            env, inherited = dict(os.environ), os.environ.get("PYTHONPATH")  # (a GPU host's bundle: its Mooncake)
            env.pop("PYTHONDONTWRITEBYTECODE", None)  # every checkout runs from cached bytecode

            def command(model_dir: Path, out: str, *extra: str) -> list[str]:
                return [sys.executable, "-m", "cli", "scan", "--master", cluster.master_address, "--metadata",
                        cluster.metadata_url, "--admin", cluster.admin_url, "--local-hostname", "127.0.0.1",
                        "--model-config", str(model_dir), *FLAGS[args.family], "--format", "json", "--no-progress",
                        "--output", str(Path(scratch) / out), "--device", args.device, *extra]

            cache = Path(scratch) / "cache"
            arms = {"binding": (bound, (), ROOT), "binding and prefix records": (bound, ("--block-tables", str(records)), ROOT),
                    "binding, probe not kept": (bound, (), ROOT), "no binding": (unbound, (), ROOT)}
            if not args.fresh_probe:
                del arms["binding, probe not kept"]
            if args.before is not None:
                arms["binding, before"] = (bound, (), args.before.resolve())
                arms["binding and prefix records, before"] = (bound, ("--block-tables", str(records)), args.before.resolve())
            measured: dict[str, list[dict]] = {label: [] for label in arms}
            for round_ in range(args.runs + 1):  # the first round warms caches, unmeasured
                order = list(arms.items())
                for label, (model_dir, extra, root) in (order if round_ % 2 else order[::-1]):
                    kept = cache / (f"fresh-{round_}" if label == "binding, probe not kept" else "kept")
                    report = Path(scratch) / "report.json"
                    report.unlink(missing_ok=True)
                    result = run(command(model_dir, report.name, *extra),
                                 {**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), inherited])),
                                  "MOONCAKE_AUDIT_CACHE": str(kept)}, root)
                    if not report.exists():
                        raise SystemExit(f"{label}: no report (exit {result['code']}): {result['stderr'][-800:]}")
                    summary = json.loads(report.read_text())["summary"]
                    assert summary["keys_scanned"] == args.keys and summary["findings"] == 0, summary
                    assert (summary.get("binding", {}).get("bound") == [name]) == (label != "no binding"), summary
                    if extra:  # every key's hash has its record, and every state held its tokens
                        assert summary["binding"]["prefix_records"]["hashes"] == args.keys, summary
                    if attention and label != "no binding":  # and every page's K was checked at its positions
                        assert summary["binding"].get("k_checked") == args.keys, summary["binding"]
                    if round_:
                        measured[label].append(result)
    lines = []
    for label, runs in measured.items():
        lines.append([label, f"{statistics.median(r['wall'] for r in runs):.3f}",
                      f"{min(r['wall'] for r in runs):.3f}-{max(r['wall'] for r in runs):.3f}",
                      f"{statistics.median(r['cpu'] for r in runs):.2f}", f"{statistics.median(r['rss_mib'] for r in runs):.0f}"])
    print(f"{args.keys} keys x {size:,} B ({args.keys * size / 1e9:.2f} GB), {args.runs} rounds, --device "
          f"{args.device}; {machine()}")
    print(text_table(["scan", "wall s (median)", "min-max", "cpu s", "peak RSS MiB"], lines))
    for label in (label for label in measured if label != "no binding"):
        ratios = [a["wall"] / b["wall"] for a, b in zip(measured[label], measured["no binding"])]
        print(f"{label} / no binding, round by round: median {statistics.median(ratios):.3f} "
              f"(min {min(ratios):.3f}, max {max(ratios):.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
