"""The prefix recorder: the scheduler side of vLLM's MooncakeStoreConnector tells, per chunk hash,
which tokens a state published under it must hold at layer 0 (`audit.prefixrecords`).

A key's last field is the hex of ``request.block_hashes[k // hash_block_size - 1]`` for the boundary
at ``k`` tokens (vLLM 0.32 ``store/worker.py``), so the scheduler, which holds every request's
tokens and block hashes, can say for each hash what its boundary's last ``window`` tokens digest to.
The store wrapper (`audit.recorder.wrapper`) sees only keys and addresses, hence this second hook.
It runs when a request is allocated (its prompt's hashes) and as each step's connector metadata is
built (the hashes its output added since), and writes each hash once per process.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from audit.prefixrecords import prefix_line
from audit.recorder.records import RecordWriter

logger = logging.getLogger("vllm.mooncake_audit")

# The config fields that name layer 0's conv kernel, per family (Mamba1/2, Nemotron-H: conv_kernel;
# Granite, Zamba2, Falcon-H1: mamba_d_conv; Qwen3-Next/3.5 GDN: linear_conv_kernel_dim; LFM2: conv_L_cache)
CONV_KERNEL_FIELDS = ("conv_kernel", "mamba_d_conv", "linear_conv_kernel_dim", "conv_L_cache", "d_conv")
SEEN_LIMIT = 1 << 20  # hashes remembered per process before the memory is cleared (a repeat is only a duplicate line)


def conv_window(hf_config) -> int | None:
    """How many tokens a layer-0 conv state holds (the kernel - 1), or None for a model without one."""
    for name in CONV_KERNEL_FIELDS:
        kernel = getattr(hf_config, name, None)
        if isinstance(kernel, int) and kernel > 1:
            return kernel - 1
    return None


class PrefixRecorder:
    """Writes the prefix records of the requests one scheduler sees."""

    def __init__(self, writer: RecordWriter, window: int, hash_block_size: int):
        self.writer, self.window, self.hash_block_size = writer, window, hash_block_size
        self._seen: set[bytes] = set()
        self._done: dict[str, int] = {}  # request id -> how many of its hashes were recorded

    def record(self, request_id: str, block_hashes: Sequence[bytes], tokens: Sequence[int]) -> None:
        """The request's hashes not recorded yet (each boundary's last `window` tokens)."""
        start = self._done.get(request_id, 0)
        if start >= len(block_hashes):
            return
        lines = []
        for index in range(start, len(block_hashes)):
            boundary = (index + 1) * self.hash_block_size
            if boundary > len(tokens):
                break
            raw = bytes(block_hashes[index])
            if boundary >= self.window and raw not in self._seen:
                self._seen.add(raw)
                lines.append(prefix_line(raw.hex(), self.window, tokens[boundary - self.window:boundary]))
            self._done[request_id] = index + 1
        if len(self._seen) > SEEN_LIMIT:
            self._seen.clear()
        self.writer.write(lines)

    def forget_all_but(self, request_ids) -> None:
        """Drop the counts of requests no longer running (called when they pile up)."""
        if len(self._done) > 2 * len(request_ids) + 1024:
            self._done = {rid: n for rid, n in self._done.items() if rid in request_ids}


def install_prefix_recorder(writer: RecordWriter) -> bool:
    """Wrap MooncakeStoreScheduler so that each request's hashes are recorded (models with a layer-0
    conv state); False where that class is not importable (a vLLM without the connector)."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store import (
            scheduler as module,
        )
    except ImportError:
        return False
    cls = module.MooncakeStoreScheduler
    if getattr(cls, "audit_prefixes", False):
        return True
    init, allocated, build = cls.__init__, cls.update_state_after_alloc, cls.build_connector_meta

    def __init__(self, vllm_config, *args, **kwargs):
        init(self, vllm_config, *args, **kwargs)
        window = conv_window(vllm_config.model_config.hf_text_config)
        hash_block_size = getattr(self, "_hash_block_size", None)
        self.audit_prefix_recorder = (PrefixRecorder(writer, window, int(hash_block_size))
                                      if window and hash_block_size else None)

    def _record(recorder: PrefixRecorder, request) -> None:
        try:
            recorder.record(request.request_id, request.block_hashes, request.all_token_ids)
        except Exception as error:  # noqa: BLE001 (a record must never fail a request)
            logger.warning("mooncake-audit: prefix record of request %s not written (%s)",
                           getattr(request, "request_id", "?"), error)

    def update_state_after_alloc(self, request, *args, **kwargs):
        if (recorder := getattr(self, "audit_prefix_recorder", None)) is not None:
            _record(recorder, request)
        return allocated(self, request, *args, **kwargs)

    def build_connector_meta(self, *args, **kwargs):
        if (recorder := getattr(self, "audit_prefix_recorder", None)) is not None:
            running = getattr(self, "_unfinished_requests", {})
            for request, _ in list(running.values()):
                _record(recorder, request)
            recorder.forget_all_but(running)
        return build(self, *args, **kwargs)

    cls.__init__, cls.update_state_after_alloc, cls.build_connector_meta = (
        __init__, update_state_after_alloc, build_connector_meta)
    cls.audit_prefixes = True
    return True
