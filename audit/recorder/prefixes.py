"""The prefix recorder: the scheduler side of vLLM's MooncakeStoreConnector tells, per chunk hash,
which tokens a state published under it must hold at layer 0 (`audit.prefixrecords`).

A key's last field is the hex of ``request.block_hashes[k // hash_block_size - 1]`` for the boundary
at ``k`` tokens (vLLM 0.32 ``store/worker.py``), so the scheduler, which holds every request's
tokens and block hashes, can say for each hash what its boundary's last ``window`` tokens digest to.
Where layer 0 is attention, its KV block holds the V of the block's own tokens, from the block's start
to the boundary (a partial tail block, keyed at a boundary inside its block, holds only those), so
each hash names that window too, and the block's start (its K is turned to those positions). The store wrapper (`audit.recorder.wrapper`) sees only keys and addresses, hence this second hook.
It runs when a request is allocated (its prompt's hashes) and as each step's connector metadata is
built (the hashes its output added since), and writes each hash once per process. A hash whose
windows hold a position vLLM fed an embedding rather than a token (a multimodal item's placeholder,
prompt embeddings: `supplied_positions`) is recorded as such (`supplied_line`), with no digest: its
rows there are no token's image, and the scan and the guards claim nothing of them.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from audit.prefixrecords import prefix_line, supplied_line
from audit.recorder.manifest import layer_index
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


def layer0_attention_block_size(kv_cache_config) -> int | None:
    """The block size of the KV-cache group holding layer 0, where that group is attention (its
    blocks hold tokens' KV); None where layer 0 holds a recurrent state or is not found."""
    for group in getattr(kv_cache_config, "kv_cache_groups", None) or ():
        if any(layer_index(name) == 0 for name in group.layer_names):
            spec = group.kv_cache_spec
            inner = getattr(spec, "kv_cache_specs", None)  # a UniformTypeKVCacheSpecs: its layer 0's own
            if inner:
                spec = next((s for name, s in inner.items() if layer_index(name) == 0), spec)
            attention = any(cls.__name__ == "AttentionSpec" for cls in type(spec).__mro__)
            return int(spec.block_size) if attention else None
    return None


def supplied_positions(request) -> list[tuple[int, int]]:
    """The prompt positions (start, end) whose layer-0 input vLLM takes from an embedding, not a
    token: each multimodal item's placeholder range (``mm_features[i].mm_position``; all of it,
    where its ``is_embed`` mask may spare a few), and the whole prompt of a request given prompt
    embeddings."""
    ranges = [(int(feature.mm_position.offset), int(feature.mm_position.offset) + int(feature.mm_position.length))
              for feature in getattr(request, "mm_features", None) or ()]
    if getattr(request, "prompt_embeds", None) is not None:
        ranges.append((0, int(request.num_prompt_tokens)))
    return ranges


class PrefixRecorder:
    """Writes the prefix records of the requests one scheduler sees: per hash, the last `window`
    tokens before its boundary (a conv state's), the tokens of its `kv_block_size` block up to the
    boundary (an attention block's), or both; a None names no such window."""

    def __init__(self, writer: RecordWriter, window: int | None, hash_block_size: int,
                 kv_block_size: int | None = None):
        self.writer, self.window, self.hash_block_size = writer, window, hash_block_size
        self.kv_block_size = kv_block_size
        self._seen: set[bytes] = set()
        self._done: dict[str, int] = {}  # request id -> how many of its hashes were recorded

    def record(self, request_id: str, block_hashes: Sequence[bytes], tokens: Sequence[int],
               supplied: Sequence[tuple[int, int]] = ()) -> None:
        """The request's hashes not recorded yet; `supplied`: its positions fed embeddings
        (`supplied_positions`)."""
        start = self._done.get(request_id, 0)
        if start >= len(block_hashes):
            return
        lines = []
        window, kv_block = self.window, self.kv_block_size
        for index in range(start, len(block_hashes)):
            boundary = (index + 1) * self.hash_block_size
            if boundary > len(tokens):
                break
            raw = bytes(block_hashes[index])
            conv = window is not None and boundary >= window
            if (conv or kv_block) and raw not in self._seen:
                self._seen.add(raw)
                start = (boundary - 1) // kv_block * kv_block if kv_block else None
                first = min(boundary - window if conv else boundary, boundary if start is None else start)
                if any(begin < boundary and first < end for begin, end in supplied):
                    lines.append(supplied_line(raw.hex()))
                else:
                    lines.append(prefix_line(
                        raw.hex(), window if conv else None, tokens[boundary - window:boundary] if conv else None,
                        tokens[start:boundary] if kv_block else None, start))
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
    conv state or layer-0 attention); False where that class is not importable (a vLLM without the connector)."""
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
        kv_block_size = layer0_attention_block_size(getattr(self, "kv_cache_config", None))
        hash_block_size = getattr(self, "_hash_block_size", None)
        self.audit_prefix_recorder = (PrefixRecorder(writer, window, int(hash_block_size), kv_block_size)
                                      if (window or kv_block_size) and hash_block_size else None)

    def _record(recorder: PrefixRecorder, request) -> None:
        try:
            recorder.record(request.request_id, request.block_hashes, request.all_token_ids,
                            supplied_positions(request))
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
