"""A checkpoint's fingerprint: which weights a model directory holds, from every byte of them.

Layer-0 binding (`audit.judge.binding`) sees other weights only where layer 0 differs; a fine-tune
that kept the embeddings and layer 0 publishes states that bind. The recorder writes the fingerprint
of the directory vLLM loaded into its manifest, and the scan compares it with the ``--model-config``
directory's, once per manifest.

The digest is xxh3_128 over every tensor of every weight file (safetensors: each tensor's name,
dtype, shape and bytes, sorted by name, so the same tensors resharded or with other header metadata
give the same digest; other weight files, ``*.bin`` ``*.pt`` ``*.pth`` ``*.gguf``: their names,
sizes and bytes). The header fingerprint (the tensors' names, dtypes and shapes only) tells "same
architecture, other weights" from "another model". Each file's result is kept
in the cache beside the token images, keyed by (absolute path, size, mtime_ns): a changed mtime
reads the file again (same content, same digest); an unchanged file is never read twice. A lock per
file lets the ranks of one host hash a shared checkpoint once between them.

Streamed in 16 MiB reads (xxhash releases the GIL while it hashes); ``MOONCAKE_AUDIT_FINGERPRINT=off``
turns it off (docs/binding.md: what it costs)."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

import xxhash

from audit.switches import switch

from .checkpoint import INDEX, _header
from .images import cache_dir
from .model import LayoutError

ALGORITHM = "xxh3_128"
FINGERPRINT_ENV = "MOONCAKE_AUDIT_FINGERPRINT"
READ_BYTES = 16 << 20
# vLLM's own preference among weight formats: safetensors first; the first pattern with files wins.
WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf")
INDEXES = {"*.safetensors": INDEX, "*.bin": "pytorch_model.bin.index.json"}
# what vLLM leaves out of a checkpoint it loads (``filter_files_not_needed_for_inference``)
NOT_WEIGHTS = frozenset({"training_args.bin", "optimizer.bin", "optimizer.pt", "scheduler.pt", "scaler.pt"})
_CACHE_VERSION = 1


def fingerprint_enabled(env: Mapping[str, str] = os.environ) -> bool:
    """On unless the operator says ``off`` (a malformed value is a ValueError, never silently off)."""
    return switch(env, FINGERPRINT_ENV, default=True)


@dataclass(frozen=True)
class Fingerprint:
    """What a model directory's weights hash to, and what it took (``hashed_bytes``: read now,
    the rest came from the cache)."""

    algorithm: str
    digest: str        # every tensor's (or file's) bytes
    header: str | None  # names, dtypes and shapes (safetensors only): the architecture
    files: int
    bytes: int
    hashed_files: int
    hashed_bytes: int
    seconds: float

    def as_dict(self) -> dict:
        return asdict(self)


def weight_files(directory: Path) -> list[Path]:
    """The weight files of a model directory (through its index where it has one); [] when none."""
    directory = Path(directory)
    for pattern in WEIGHT_PATTERNS:
        index = directory / INDEXES.get(pattern, "-")
        if index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map") or {}
            return sorted({directory / name for name in weight_map.values()})
        files = sorted(path for path in directory.glob(pattern) if path.is_file() and path.name not in NOT_WEIGHTS)
        if files:
            return files
    return []


def fingerprint(directory: Path, cache: Path | None = None) -> Fingerprint:
    """The fingerprint of `directory`'s weights (LayoutError when it holds none). `cache`: where
    each file's result is kept (default: ``fingerprints/`` beside the token images)."""
    started = time.perf_counter()
    files = weight_files(directory)
    if not files:
        raise LayoutError(f"{directory}: no weight files to fingerprint")
    cache = default_cache() if cache is None else Path(cache)
    entries, headers, total, hashed_files, hashed_bytes = [], [], 0, 0, 0
    for path in files:
        result, hashed = _file_result(path, cache)
        total += result["size"]
        hashed_files += hashed
        hashed_bytes += result["size"] if hashed else 0
        if result["tensors"] is None:
            entries.append(f"file {path.name} {result['size']} {result['digest']}")
        else:
            entries += [f"tensor {name} {dtype} {shape} {digest}" for name, dtype, shape, digest in result["tensors"]]
            headers += [f"{name} {dtype} {shape}" for name, dtype, shape, _ in result["tensors"]]
    return Fingerprint(ALGORITHM, _combine(entries), _combine(headers) if headers else None, len(files), total,
                       hashed_files, hashed_bytes, round(time.perf_counter() - started, 3))


def default_cache() -> Path:
    """``fingerprints/`` beside the token images' cache (``MOONCAKE_AUDIT_CACHE``)."""
    return cache_dir().parent / "fingerprints"


def _combine(lines: list[str]) -> str:
    return xxhash.xxh3_128("\n".join(sorted(lines)).encode()).hexdigest()


def _file_result(path: Path, cache: Path) -> tuple[dict, bool]:
    """One file's digests and whether they were computed now (False: from the cache)."""
    stat = path.stat()
    entry = cache_entry(path, stat, cache)
    if (found := _cached(entry)) is not None:
        return found, False
    with _locked(entry):
        if (found := _cached(entry)) is not None:  # another process hashed it while this one waited
            return found, False
        result = {"size": stat.st_size, "digest": None, "tensors": None}
        if path.suffix == ".safetensors":
            result["tensors"] = _tensor_digests(path)
        else:
            result["digest"] = _file_digest(path)
        with contextlib.suppress(OSError):  # a cache that cannot be written is only slower
            partial = entry.with_name(f".{entry.name}.{os.getpid()}.partial")
            partial.write_text(json.dumps(result))
            os.replace(partial, entry)
    return result, True


def cache_entry(path: Path, stat: os.stat_result, cache: Path) -> Path:
    """Where one weight file's result is kept, as `stat` says the file is (its ``.lock`` beside it)."""
    key = json.dumps([_CACHE_VERSION, str(path.resolve()), stat.st_size, stat.st_mtime_ns])
    return cache / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"


def _cached(entry: Path) -> dict | None:
    """A file's kept result; None when there is none (or only a damaged one: it is hashed again)."""
    try:
        found = json.loads(entry.read_text())
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) and {"size", "digest", "tensors"} <= found.keys() else None


@contextlib.contextmanager
def _locked(entry: Path):
    """Exclusive while one process hashes the file; no lock at all where the cache is not writable."""
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        descriptor = os.open(entry.with_suffix(".lock"), os.O_WRONLY | os.O_CREAT, 0o644)
    except OSError:
        yield
        return
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX)
        yield
    finally:
        os.close(descriptor)


def _file_digest(path: Path) -> str:
    digest = xxhash.xxh3_128()
    buffer = memoryview(bytearray(READ_BYTES))
    with open(path, "rb", buffering=0) as handle:
        while count := handle.readinto(buffer):
            digest.update(buffer[:count])
    return digest.hexdigest()


def _tensor_digests(path: Path) -> list[list]:
    """[name, dtype, shape, digest of its bytes] per tensor, in one sequential pass over the data."""
    start, header = _header(path)
    spans = sorted((entry["data_offsets"][0], entry["data_offsets"][1], name, entry["dtype"],
                    "x".join(map(str, entry["shape"]))) for name, entry in header.items() if name != "__metadata__")
    digests = [xxhash.xxh3_128() for _ in spans]
    end = max((span[1] for span in spans), default=0)
    buffer = memoryview(bytearray(READ_BYTES))
    current, offset = 0, 0  # the first tensor not yet hashed whole; the data offset read up to
    with open(path, "rb", buffering=0) as handle:
        handle.seek(start)
        while offset < end:
            count = handle.readinto(buffer[:min(READ_BYTES, end - offset)])
            if not count:
                raise LayoutError(f"{path}: ends at data byte {offset}, its header says {end}")
            reached = offset + count
            while current < len(spans) and spans[current][0] < reached:
                begin, stop = spans[current][:2]
                low, high = max(begin, offset), min(stop, reached)
                if high > low:
                    digests[current].update(buffer[low - offset:high - offset])
                if stop > reached:
                    break
                current += 1
            offset = reached
    return [[name, dtype, shape, digest.hexdigest()] for (_, _, name, dtype, shape), digest in zip(spans, digests)]
