"""The producer's manifest: what vLLM itself decided about its keys and values, once per engine process.

A scan that guesses a value's layout from a model config can guess wrong (a float32 attention page
of ``b`` tokens has the bytes of ``2b`` bfloat16 tokens). The worker of vLLM's MooncakeStoreConnector
knows: when ``MooncakeStoreWorker.register_kv_caches`` returns, it holds the key metadata of each
KV-cache group the store publishes (model name as in keys, cache_prefix, store namespace, ranks), the
groups' specs (``FullAttentionSpec``; ``MambaSpec`` shapes, dtypes, ``page_size_padded``), each group's
registered segments in registration order with their per-block lengths, and ``kv_caches`` holds each
layer's tensor. The manifest copies those, never recomputes them, into
``manifest-{host}-{pid}.json`` beside the block records (docs/recorder.md has the schema).

The hook is put on the worker class when a connector builds its store (``RecordingStore.__init__``
calls `hook_store_worker`): the worker module is loaded then; no vLLM module is imported here. Writing
is best effort: a failure is logged and never reaches vLLM.

The manifest also carries the fingerprint of the checkpoint vLLM loaded (`audit.layouts.fingerprint`):
written ``"complete": false`` at once, then computed in a background thread and the manifest
rewritten with it, so a 140 GB checkpoint never delays serving (``MOONCAKE_AUDIT_FINGERPRINT=off``:
not computed).
"""

from __future__ import annotations

import functools
import json
import math
import os
import socket
import sys
import threading
import time
from pathlib import Path

from audit.layouts.fingerprint import (
    ALGORITHM,
    FINGERPRINT_ENV,
    fingerprint,
    fingerprint_enabled,
)
from audit.layouts.manifest import (
    MANIFEST_SCHEMA,
    MANIFEST_VERSION,
    decoder_layer,
    layer_name_offset,
    manifest_name,
    stored_dtype,
)
from audit.recorder.records import DEFAULT_TENANT, logger

WORKER_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker"

# vLLM's MambaSpec.mamba_type (MambaAttentionBackendEnum) -> the audit's layout kind
MAMBA_KINDS = {"MAMBA1": "mamba1", "MAMBA2": "mamba2", "GDN_ATTN": "gdn", "SHORT_CONV": "short_conv"}
# A Mamba page packs the layer's states in MambaSpec order (conv first); vLLM names none of them.
STATE_NAMES = ("conv", "ssm")
FINGERPRINT_THREAD = "mooncake-audit-fingerprint"
_writing = threading.Lock()  # the hook and the fingerprint thread rewrite the same manifest


def hook_store_worker(directory: Path) -> bool:
    """Write a manifest into `directory` after every ``MooncakeStoreWorker.register_kv_caches``.

    Wraps the method of the loaded worker class once; False when vLLM's worker module is not loaded
    (a store built by other code: nothing to describe)."""
    worker_class = getattr(sys.modules.get(WORKER_MODULE), "MooncakeStoreWorker", None)
    original = getattr(worker_class, "register_kv_caches", None)
    if original is None:
        return False
    if getattr(original, "audit_manifest_directory", None) is not None:
        return True

    @functools.wraps(original)
    def register_kv_caches(self, kv_caches, *args, **kwargs):
        result = original(self, kv_caches, *args, **kwargs)
        try:
            document = describe_worker(self, kv_caches)
            if document is not None:
                document["fingerprint"] = pending_fingerprint(document.get("model_path"))
                with _writing:
                    logger.info("mooncake-audit manifest written: %s", write_manifest(directory, document))
                fingerprint_in_background(directory, document)
        except Exception:  # a manifest bug must not cost the producer its caches
            logger.exception("mooncake-audit: cannot write the producer's manifest (block records are unaffected)")
            document = None
        describe = getattr(getattr(self, "store", None), "audit_describe", None)
        if describe is not None and document is not None:
            describe(document, kv_caches)  # the load guard's regions: a failure here stops a guarded engine
        return result

    register_kv_caches.audit_manifest_directory = directory
    worker_class.register_kv_caches = register_kv_caches
    return True


def write_manifest(directory: Path, document: dict) -> Path:
    """Atomically: a reader sees the previous manifest or this one, never half of one."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / manifest_name(document["host"], document["pid"])
    partial = path.with_name(f".{path.name}.partial")
    with open(partial, "w", encoding="utf-8") as handle:
        json.dump(document, handle, indent=1)
        handle.write("\n")
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(partial, path)
    return path


def describe_worker(worker, kv_caches: dict) -> dict | None:
    """The manifest of one ``MooncakeStoreWorker`` after it registered `kv_caches`; None when it
    publishes nothing (a capacity-only worker builds no token databases)."""
    databases = getattr(worker, "token_dbs", None)
    if not databases:
        return None
    import vllm
    from vllm.platforms import current_platform

    metadata = databases[0].metadata
    pages = _layer_pages(kv_caches, worker.num_blocks)
    cache_config = worker.cache_config
    groups = [_describe_group(database, group, factor, pages) for database, group, factor in
              zip(databases, worker.coord.kv_cache_groups, worker.group_tp_replication_factors, strict=True)]
    _name_decoder_layers(groups)
    _name_fp8_pages(groups, str(cache_config.cache_dtype))
    return {
        "schema": MANIFEST_SCHEMA, "version": MANIFEST_VERSION, "written_at": time.time(),
        "host": socket.gethostname(), "pid": os.getpid(),
        "vllm_version": vllm.__version__, "platform": current_platform.device_name,
        "device_capability": device_capability(current_platform),
        "model": metadata.model_name, "cache_prefix": metadata.cache_prefix,
        "store_namespace": metadata.store_namespace,
        "tenant": getattr(worker.store, "audit_tenant", DEFAULT_TENANT),
        "kv_role": worker.kv_role, "tp_size": worker.tp_size, "tp_rank": worker.tp_rank,
        "pp_size": worker.pp_size, "pp_rank": worker.pp_rank, "pcp_rank": worker.pcp_rank,
        "dcp_rank": worker.dcp_rank, "num_blocks": worker.num_blocks,
        "cache_dtype": str(cache_config.cache_dtype), "mamba_cache_mode": getattr(cache_config, "mamba_cache_mode", None),
        "model_path": loaded_model_directory(),
        "groups": groups,
    }


def _name_fp8_pages(groups: list[dict], cache_dtype: str) -> None:
    """vLLM keeps an fp8 KV cache (``--kv-cache-dtype fp8``) as uint8: its attention pages are named
    by the fp8 dtype it holds, which the guards read them as (its NaN, its layer-0 rows)."""
    if not cache_dtype.startswith("fp8"):
        return
    for group in groups:
        if (group.get("attention") or {}).get("dtype") == "uint8":
            group["attention"]["dtype"] = stored_dtype("uint8", cache_dtype)


def loaded_model_directory() -> str | None:
    """The directory vLLM loaded its weights from: ``model_config.model`` when it is a directory,
    else the Hugging Face cache's snapshot of that repository and revision (looked up, never
    downloaded); None when neither is on this host. vLLM sets its config around the call."""
    try:
        from vllm.config import get_current_vllm_config_or_none
    except ImportError:
        return None
    config = get_current_vllm_config_or_none()
    model = getattr(getattr(config, "model_config", None), "model", None)
    if not model:
        return None
    if Path(model).is_dir():
        return str(Path(model).resolve())
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(model, revision=config.model_config.revision, local_files_only=True,
                                 cache_dir=getattr(config.load_config, "download_dir", None))
    except Exception:  # noqa: BLE001 (no hub, or not in its cache: the manifest says so)
        return None


def pending_fingerprint(model_path: str | None) -> dict:
    """The manifest's ``fingerprint`` before it is computed, or why it never will be."""
    entry = {"algorithm": ALGORITHM, "model_path": model_path, "complete": False, "digest": None}
    try:
        enabled = fingerprint_enabled()
    except ValueError as error:  # a typo must not cost the producer its manifest
        return {**entry, "note": f"{error} (not fingerprinted)"}
    if not enabled:
        return {**entry, "note": f"{FINGERPRINT_ENV}=off"}
    if model_path is None:
        return {**entry, "note": "the model vLLM loaded is not a directory on this host (not fingerprinted)"}
    return {**entry, "note": "computing"}


def fingerprint_in_background(directory: Path, document: dict) -> threading.Thread | None:
    """Fingerprint the document's model directory in a daemon thread, then rewrite its manifest
    with the result; None when there is nothing to compute."""
    entry = document["fingerprint"]
    if entry.get("note") != "computing":
        return None

    def run() -> None:
        try:
            found = fingerprint(Path(entry["model_path"]))
            done = {**entry, "complete": True, "note": None, **found.as_dict()}
        except Exception as error:  # noqa: BLE001 (the manifest says why; vLLM never sees it)
            done = {**entry, "note": f"cannot fingerprint: {error}"}
        try:
            with _writing:
                document["fingerprint"] = done
                path = write_manifest(directory, document)
            logger.info("mooncake-audit: checkpoint fingerprint in %s: %s", path, done["digest"] or done["note"])
        except Exception:  # noqa: BLE001 (logged; vLLM never sees it)
            logger.exception("mooncake-audit: cannot write the checkpoint's fingerprint into the manifest")

    thread = threading.Thread(target=run, name=FINGERPRINT_THREAD, daemon=True)
    thread.start()
    return thread


def device_capability(platform) -> list[int] | None:
    """The GPU's compute capability ``[major, minor]``, which decides vLLM 0.33's per-GPU rules
    (``audit.layouts.versions``); None where vLLM knows none (its CPU platform, or NVML failed)."""
    try:
        capability = platform.get_device_capability()
    except NotImplementedError:  # a platform class that never learned its device
        return None
    return None if capability is None else [int(capability[0]), int(capability[1])]


def _layer_pages(kv_caches: dict, num_blocks: int) -> dict[str, tuple[int, int, object]]:
    """Per layer: where its block 0 starts, its page's bytes, and the tensor the connector registered
    (a Mamba layer's entry may be a list of views of one storage: the first, as the connector takes)."""
    pages = {}
    for name, value in kv_caches.items():
        tensor = value[0] if isinstance(value, (list, tuple)) else value
        kernel_blocks = max(1, tensor.shape[0] // num_blocks)  # kernel blocks per manager block
        pages[name] = (tensor.data_ptr(), tensor.stride(0) * tensor.element_size() * kernel_blocks, tensor)
    return pages


def _owner(address: int, layers, pages: dict) -> str | None:
    """The layer among `layers` whose block-0 page holds `address`."""
    for name in layers:
        if name in pages:
            start, length, _ = pages[name]
            if start <= address < start + length:
                return name
    return None


def _describe_group(database, group, factor: int, pages: dict) -> dict:
    spec = _uniform_spec(group.kv_cache_spec)
    store_layout = database.store_layout
    entry = {
        "group": database.metadata.group_id, "key_tp_rank": database.metadata.tp_rank,
        # vLLM's own key builder with an empty hash: exactly how this group's keys start
        "key_prefixes": [store_layout.key_for(shard, b"").removesuffix("@") for shard in store_layout.local_shard_ids],
        "tp_replication_factor": factor, "spec": type(group.kv_cache_spec).__name__, "kind": _kind(spec),
        "block_size": group.kv_cache_spec.block_size, "page_size": group.kv_cache_spec.page_size_bytes,
        "page_size_padded": getattr(spec, "page_size_padded", None), "layers": list(group.layer_names),
    }
    if _is_a(spec, "AttentionSpec"):
        entry["attention"] = {"num_kv_heads": spec.num_kv_heads, "head_size": spec.head_size,
                              "head_size_v": getattr(spec, "head_size_v", None) or spec.head_size,
                              "dtype": _dtype_name(spec.dtype)}
    if _is_a(spec, "MambaSpec"):
        entry["mamba_type"] = spec.mamba_type.name
        entry["states"] = _states(spec)
        state_bytes = sum(state["length"] for state in entry["states"])
        entry["padding"] = {"offset": state_bytes, "length": spec.page_size_bytes - state_bytes}
    bases = getattr(store_layout, "kv_caches_base_addr", None)  # rank-local layouts only
    lengths = getattr(store_layout, "block_len", None)
    if not bases or not lengths:
        entry["segments"] = None
        entry["note"] = f"{type(store_layout).__name__}: segments are not rank-local buffers"
        return entry
    everyone = list(pages)
    entry["segments"] = [_describe_segment(index, base, lengths[index % len(lengths)], group.layer_names, everyone,
                                           pages) for index, base in enumerate(bases)]
    return entry


def _describe_segment(index: int, base: int, block_len: int, layers, everyone, pages: dict) -> dict:
    owner = _owner(base, layers, pages)
    if owner is None:  # a slot of another group's layer: read into this group's key all the same
        return {"index": index, "block_len": block_len, "layer": None, "shared_with": _owner(base, everyone, pages)}
    start, _, tensor = pages[owner]
    return {"index": index, "block_len": block_len, "layer": owner, "layer_index": layer_index(owner),
            "offset_in_page": base - start, "dtype": _dtype_name(tensor.dtype),
            "tensor_shape": list(tensor.shape), "tensor_stride": list(tensor.stride())}


def _name_decoder_layers(groups: list[dict]) -> None:
    """Each owned segment's ``decoder_layer``: its layer's index, less the offset vLLM put into a
    Falcon-H1 mixer's name (``num_hidden_layers`` of the model it runs; the manifest's names'
    where vLLM's config is not at hand)."""
    offset = _hidden_layers()
    if offset is None:
        offset = layer_name_offset({"groups": groups})
    for group in groups:
        for segment in group["segments"] or ():
            if segment["layer"] is not None:
                segment["decoder_layer"] = decoder_layer(segment["layer"], offset)


def _hidden_layers() -> int | None:
    """The (text) config's ``num_hidden_layers`` of the model vLLM runs; None when not at hand."""
    try:
        from vllm.config import get_current_vllm_config_or_none
    except ImportError:
        return None
    config = getattr(get_current_vllm_config_or_none(), "model_config", None)
    count = getattr(getattr(config, "hf_text_config", None), "num_hidden_layers", None)
    return count if isinstance(count, int) else None


def _states(spec) -> list[dict]:
    """The states of a Mamba page where vLLM packs them (``MambaBase.bind_kv_cache``: spec order,
    back to back from the page's start; the padding up to ``page_size_padded`` follows)."""
    states, offset = [], 0
    for position, (shape, dtype) in enumerate(zip(spec.shapes, spec.dtypes, strict=True)):
        length = math.prod(shape) * dtype.itemsize
        name = STATE_NAMES[position] if position < len(STATE_NAMES) else f"state{position}"
        states.append({"name": name, "dtype": _dtype_name(dtype), "shape": list(shape), "offset": offset,
                       "length": length})
        offset += length
    return states


def _uniform_spec(spec):
    """A group of per-layer specs that are all alike reads as that one spec."""
    inner = getattr(spec, "kv_cache_specs", None)
    if inner and _is_a(spec, "UniformTypeKVCacheSpecs") and len(set(map(repr, inner.values()))) == 1:
        return next(iter(inner.values()))
    return spec


def _kind(spec) -> str | None:
    """The audit's layout kind (audit.layouts.model.LAYOUT_KINDS); None where it has none."""
    if _is_a(spec, "MambaSpec"):
        return MAMBA_KINDS.get(spec.mamba_type.name)
    if _is_a(spec, "AttentionSpec") and not _is_a(spec, "CrossAttentionSpec"):
        return "attention"
    return None


def _is_a(obj, class_name: str) -> bool:
    """By class name along the MRO: vLLM's classes are never imported here."""
    return any(cls.__name__ == class_name for cls in type(obj).__mro__)


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def layer_index(name: str) -> int | None:
    """vLLM's ``extract_layer_index`` rule: the one integer among a layer name's dotted parts."""
    numbers = [int(part) for part in name.split(".") if part.isdigit()]
    return numbers[0] if len(numbers) == 1 else None
