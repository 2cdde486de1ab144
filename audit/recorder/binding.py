"""Layer-0 binding in the guards: a state whose layer-0 conv rows are not images of tokens under
the process's own weights is ``WEIGHTS_MISMATCH``; one whose rows are images of other tokens than
those the process's own scheduler recorded for the key's chunk hash (its request's tokens at that
boundary, `audit.recorder.prefixes`) is ``PREFIX_MISMATCH``. The load guard refuses such a value
(`audit.recorder.guard`), the put guard withholds it (`audit.recorder.wrapper`).

The weights are those vLLM loaded (the manifest's ``model_path``); the token-image table is built
(or read from the user's cache) in a daemon thread once the process has described its caches, so
vLLM never waits for it, and until it is ready nothing is bound (`status` says so). The scheduler
writes a request's prefix records when it allocates it, before the worker loads or computes, so
they are on disk when its values are checked; a key without one is judged on its weights alone.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import json
import logging
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from audit.prefixrecords import PREFIX_RECORD_PREFIX, PrefixRecords, parse_prefix_record
from audit.recorder.deny import RecordTail

logger = logging.getLogger("vllm.mooncake_audit")

_GROUP = re.compile(r"@group:(\d+)@")
REFRESH_S = 0.02  # the prefix records are read again at most this often (only when a key's hash is missing)
CAPACITY = 1 << 16  # prefix records kept (about 20 MB): a request's hashes are recorded just before its loads
WEIGHTS_MISMATCH = "WEIGHTS_MISMATCH"
PREFIX_MISMATCH = "PREFIX_MISMATCH"


def cache_tensors(kv_caches: dict):
    """Every tensor of vLLM's `kv_caches` (a layer's value is a tensor or a list of them)."""
    for value in kv_caches.values():
        yield from value if isinstance(value, (list, tuple)) else (value,)


@functools.lru_cache(maxsize=64)
def _byte_array(size: int) -> type:
    return ctypes.c_uint8 * size


def host_bytes(address: int, size: int) -> np.ndarray:
    """`size` bytes of host memory at `address` (a KV-cache page), as a uint8 view: no copy."""
    return np.frombuffer(_byte_array(size).from_address(address), dtype=np.uint8)


@dataclass(frozen=True)
class Layer0Conv:
    """Where a group's keys hold layer 0's conv state: which segment, and the state's place in it."""

    segment: int
    offset: int
    length: int
    dtype: str
    shape: tuple[int, ...]


class StateBinder:
    def __init__(self, directory: Path):
        self._tail = RecordTail([Path(directory)], f"{PREFIX_RECORD_PREFIX}*.jsonl*")
        self.prefixes = PrefixRecords()
        self.conv: dict[int, Layer0Conv] = {}
        self.images = None
        self.status = "not described yet"
        self.building: threading.Thread | None = None  # the thread building the images (joined by tests)
        self._refreshed = -REFRESH_S

    def describe(self, document: dict, *, background: bool = True) -> threading.Thread | None:
        """The consumer's manifest: each group's layer-0 conv state, and the weights it loaded."""
        self.conv = {}
        for group in document.get("groups") or []:
            conv = next((s for s in group.get("states") or () if s.get("name") == "conv"), None)
            segment = next((s for s in group.get("segments") or () if s.get("layer_index") == 0), None)
            if conv is not None and segment is not None and not segment.get("offset_in_page"):
                self.conv[int(group["group"])] = Layer0Conv(int(segment["index"]), int(conv["offset"]),
                                                            int(conv["length"]), conv["dtype"], tuple(conv["shape"]))
        model_path = document.get("model_path")
        if not self.conv or not model_path:
            self.status = "no layer-0 conv state" if not self.conv else "the loaded model is not a directory here"
            return None
        self.status = "building the token images"

        def build() -> None:
            from audit.layouts import LayoutError
            from audit.layouts.weights import token_images

            try:
                images = token_images(Path(model_path), document.get("model") or Path(model_path).name,
                                      int(document.get("tp_size") or 1), int(document.get("tp_rank") or 0))
                for warmed in ("table", "probe_signs", "twins"):  # built here, off vLLM's path
                    getattr(images, warmed)
            except (LayoutError, OSError, ValueError) as error:
                self.status = f"not bound: {error}"
                return
            self.images, self.status = images, "bound"
            logger.info("mooncake-audit guard: layer-0 binding ready (%s)", model_path)

        if not background:
            build()
            return None
        self.building = threading.Thread(target=build, name="mooncake-audit-token-images", daemon=True)
        self.building.start()
        return self.building

    def refusals(self, keys: Sequence[str], loaded: Sequence[int],
                 segment_bytes: Callable[[int, int], np.ndarray]) -> dict[int, str]:
        """Of the `loaded` values (indices into `keys`), those to refuse: index -> reason.
        `segment_bytes(index, segment)` gives a loaded value's segment as host bytes."""
        images = self.images
        if images is None:
            return {}
        from audit.checks.binding import ROW_TOLERANCE, nearest_tokens
        from audit.checks.floats import decode_floats

        by_conv: dict[Layer0Conv, list[tuple[int, np.ndarray]]] = {}  # one decode per state geometry
        for index in loaded:
            match = _GROUP.search(keys[index])
            conv = self.conv.get(int(match.group(1)) if match else 0)
            if conv is not None:
                data = segment_bytes(index, conv.segment)[conv.offset:conv.offset + conv.length]
                if len(data) == conv.length:
                    by_conv.setdefault(conv, []).append((index, data))
        members, rows = [], []
        for conv, values in by_conv.items():
            numbers = decode_floats(np.stack([data for _, data in values]), conv.dtype)
            if numbers is None or numbers.size != len(values) * int(np.prod(conv.shape)):
                continue
            states = numbers.reshape(len(values), *conv.shape).astype(np.float32, copy=False)
            if states.shape[1] > states.shape[2]:  # a "DS" layout: (dim, state_len)
                states = states.transpose(0, 2, 1)
            if states.shape[2] != images.columns:
                continue
            members += [(index, states.shape[1]) for index, _ in values]
            rows.append(states.reshape(-1, states.shape[2]))
        if not members:
            return {}
        from audit.judge.prefixes import prefix_matches

        decoded, distances = nearest_tokens(np.concatenate(rows), images)
        tokens, near = decoded.tolist(), (distances <= ROW_TOLERANCE).tolist()
        hashes = {index: keys[index].rpartition("@")[2] for index, _ in members}
        if any(self.prefixes.get(chunk_hash) is None for chunk_hash in hashes.values()):
            self._refresh()
        found, start = {}, 0
        for index, count in members:
            end = start + count
            expected = self.prefixes.get(hashes[index])
            if not all(near[start:end]):
                found[index] = WEIGHTS_MISMATCH
            elif expected is not None and prefix_matches(tokens[start:end], expected, images.twins) is False:
                found[index] = PREFIX_MISMATCH
            start = end
        return found

    def _refresh(self) -> None:
        """The prefix records written since the last read (at most every REFRESH_S: a key without a
        record is judged on its weights alone); past CAPACITY hashes, the oldest half goes."""
        if time.monotonic() - self._refreshed < REFRESH_S:
            return
        self._refreshed = time.monotonic()

        for line in self._tail.lines():
            try:
                self.prefixes.add(*parse_prefix_record(json.loads(line)))
            except (ValueError, TypeError):
                self.prefixes.skipped += 1
        digests = self.prefixes.digests
        if len(digests) > CAPACITY:
            for stale in list(itertools.islice(digests, len(digests) - CAPACITY // 2)):
                del digests[stale]
