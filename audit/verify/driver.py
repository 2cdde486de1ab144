"""The reference producer: run prompts through vLLM and publish their states under a cache prefix.

Run by `mooncake-audit verify --engine PYTHON` as ``PYTHON -m audit.verify.driver SPEC.json`` (or
``PYTHON path/to/driver.py SPEC.json``), in a child process whose python has vLLM. This module
imports vLLM inside `main` only: the audit package itself never depends on it.

The engine is set up so that every state it publishes is its own recomputation:
  - the MooncakeStoreConnector publishes under ``cache_prefix`` (the reference namespace), and
    never looks keys up in the store (``enable_lookup: false``), so nothing is read back, from
    production or from an earlier reference run;
  - prompts run one at a time (``max_num_seqs`` 1 unless the spec says otherwise), so no
    production batch composition is reproduced by accident;
  - local prefix caching stays on by default, because vLLM's align-mode Mamba boundary puts need
    it; with ``"prefix_caching": false`` it is off;
  - each prompt is cut at every block boundary (`cut_prompts`): vLLM 0.32 publishes a Mamba state
    only at the end of a prompt (a prompt ending exactly on a boundary publishes the block before),
    so the prompt is also run cut one token after each multiple of the block size; with the local
    prefix cache each cut computes only its last block. Cuts equal to an earlier one are dropped.

SPEC (JSON object):
  model           model directory or name (its basename is the model field of every key: give the
                  production's)
  prompts         list of prompts, each a list of token ids
  cache_prefix    the reference namespace (keys become ``{cache_prefix}@{model}@...``)
  block_size, dtype, tp, max_model_len, max_num_seqs, mamba_cache_mode, mamba_cache_dtype,
  mamba_ssm_cache_dtype, kv_cache_dtype, prefix_caching, extra (more LLM(...) keyword arguments;
                  any other key of the spec not named here is one too: `verify --engine-arg NAME=JSON`)
  max_tokens      tokens to generate per prompt (default 1: the prompt's state is what is published)
  cut_at_boundaries  run every prompt cut at each block boundary too (default true)
  cut_block_size  the block size to cut at (default: the engine's own, after start-up: its Mamba
                  block size, else its block size); cut_block_size_from says where it came from
  out             where the result JSON goes (optional)

The engine's memory is sized to its work (`sized_to_work`), not to vLLM's default share of the
machine or the GPU (92%): a reference runs beside production, where that share is not free.

The Mooncake config comes from ``MOONCAKE_CONFIG_PATH``, as for any vLLM producer.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import sys
import time
from array import array


# The spec's own keys; every other key is one more LLM(...) keyword argument (`--engine-arg`).
SPEC_KEYS = frozenset({
    "model", "prompts", "cache_prefix", "block_size", "dtype", "tp", "max_model_len", "max_num_seqs",
    "mamba_cache_mode", "mamba_cache_dtype", "mamba_ssm_cache_dtype", "kv_cache_dtype", "prefix_caching",
    "extra", "max_tokens", "cut_at_boundaries", "cut_block_size", "cut_block_size_from", "out", "seed",
    "settle_s", "generate_batch"})
# The LLM(...) arguments that size an engine's memory: given any of them, the operator sizes it.
MEMORY_ARGS = ("kv_cache_memory_bytes", "num_gpu_blocks_override", "gpu_memory_utilization")
DEFAULT_MAX_MODEL_LEN = 2048
# The share of the GPU memory free at start that a reference may ask vLLM to check for (never the
# default 92% of the whole device: a serving engine may hold most of it).
FREE_GPU_SHARE = 0.9
HEADROOM = 4  # blocks for this many whole requests at once


def engine_kwargs(spec: dict) -> dict:
    """LLM(...) keyword arguments for the reference engine (no vLLM import: testable anywhere)."""
    extra_config = {"cache_prefix": spec["cache_prefix"], "enable_lookup": False}
    longest = max((len(prompt) for prompt in spec.get("prompts") or ()), default=0)
    max_model_len = int(spec.get("max_model_len") or max(DEFAULT_MAX_MODEL_LEN,
                                                         longest + int(spec.get("max_tokens", 1))))
    kwargs = dict(model=spec["model"], skip_tokenizer_init=True, enforce_eager=True,
                  enable_prefix_caching=bool(spec.get("prefix_caching", True)),
                  max_model_len=max_model_len, seed=int(spec.get("seed", 0)),
                  max_num_seqs=int(spec.get("max_num_seqs", 1)),
                  kv_transfer_config={"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both",
                                      "kv_connector_extra_config": extra_config})
    for name in ("block_size", "dtype", "mamba_cache_mode", "mamba_cache_dtype", "mamba_ssm_cache_dtype",
                 "kv_cache_dtype"):
        if spec.get(name):
            kwargs[name] = spec[name]
    if int(spec.get("tp", 1)) > 1:
        kwargs.update(tensor_parallel_size=int(spec["tp"]), distributed_executor_backend="mp")
    kwargs.update(spec.get("extra") or {})
    kwargs.update({name: value for name, value in spec.items() if name not in SPEC_KEYS})
    return kwargs


def sized_to_work(kwargs: dict, block_size: int, layers: int, gpu_memory: tuple[int, int] | None) -> dict:
    """The memory arguments for an engine that runs `max_num_seqs` requests of up to `max_model_len`
    tokens and no more: ``num_gpu_blocks_override`` blocks, enough for every KV-cache group of such
    requests at once (one group per layer at most), so that vLLM allocates only those; an explicit
    ``kv_cache_memory_bytes`` so that it neither profiles nor checks for its default share of the
    machine (vLLM's CPU worker refuses to start when that share is not free); on a GPU
    (`gpu_memory` = (free, total) bytes), a ``gpu_memory_utilization`` within what is free now.
    Empty when the operator gave any memory argument: theirs stand."""
    if any(name in kwargs for name in MEMORY_ARGS):
        return {}
    per_request = -(-int(kwargs["max_model_len"]) // max(1, int(block_size)))
    # HEADROOM: the local prefix cache keeps earlier cuts' blocks while later cuts run
    blocks = HEADROOM * max(1, int(layers)) * per_request * int(kwargs.get("max_num_seqs", 1)) + 1  # + the null block
    sized = {"num_gpu_blocks_override": blocks, "kv_cache_memory_bytes": 1 << 20}
    if gpu_memory is not None:
        free, total = gpu_memory
        sized["gpu_memory_utilization"] = max(0.01, round(FREE_GPU_SHARE * free / total, 2) if total else 0.01)
    return sized


def engine_memory(kwargs: dict) -> dict:
    """`sized_to_work` for the engine `kwargs` describe: vLLM's own resolved config (the block size it
    will run with, a hybrid's raised block included) and layer count; the GPU's free memory."""
    if any(name in kwargs for name in MEMORY_ARGS):
        return {}
    from vllm.engine.arg_utils import EngineArgs

    config = EngineArgs(**kwargs).create_engine_config()
    layers = getattr(config.model_config.hf_text_config, "num_hidden_layers", None) or 1
    gpu_memory = None
    import torch

    if torch.cuda.is_available():
        gpu_memory = torch.cuda.mem_get_info()
    return sized_to_work(kwargs, config.cache_config.block_size, layers, gpu_memory)


def boundary_cuts(length: int, block_size: int) -> list[int]:
    """The lengths to run a prompt of `length` tokens at: one token after each multiple of the block
    size (a prompt of ``k * block_size + 1`` tokens publishes the state of its first ``k`` blocks),
    then the whole prompt (unless it is the last cut). Ascending, so each cut reuses the one before."""
    if block_size <= 0:
        raise ValueError(f"block size {block_size}: must be positive")
    cuts = [k * block_size + 1 for k in range(1, (length - 1) // block_size + 1)]
    if length > 0 and (not cuts or cuts[-1] != length):
        cuts.append(length)
    return cuts


def cut_prompts(prompts: list[list[int]], block_size: int | None) -> list[tuple[int, int]]:
    """The requests the reference runs, as (prompt index, length) in order: each prompt's cuts
    (`boundary_cuts`; the whole prompt only, when `block_size` is None), prompt after prompt. A cut
    whose tokens equal an earlier request's (a prefix two prompts share, a prompt given twice) is
    dropped: it would publish the same keys. Compared by length and a digest of the tokens."""
    seen: set[tuple[int, bytes]] = set()
    requests = []
    for index, prompt in enumerate(prompts):
        digest, position = hashlib.blake2b(digest_size=16), 0
        for cut in (boundary_cuts(len(prompt), block_size) if block_size else [len(prompt)]):
            digest.update(array("q", prompt[position:cut]).tobytes())
            position = cut
            identity = (cut, digest.copy().digest())
            if identity not in seen:
                seen.add(identity)
                requests.append((index, cut))
    return requests


def engine_block_sizes(llm) -> dict:
    """The block sizes the engine resolved (after start-up: vLLM may raise a hybrid's block)."""
    try:
        cache = llm.llm_engine.vllm_config.cache_config
    except AttributeError:  # another vLLM's engine layout: the spec's cut_block_size is needed then
        return {"block_size": None, "mamba_block_size": None}
    return {"block_size": getattr(cache, "block_size", None),
            "mamba_block_size": getattr(cache, "mamba_block_size", None)}


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m audit.verify.driver SPEC.json", file=sys.stderr)
        return 2
    with open(argv[0]) as handle:
        spec = json.load(handle)
    if not spec.get("cache_prefix"):
        print("driver: the spec needs a non-empty cache_prefix (never publish into production's names)",
              file=sys.stderr)
        return 2
    started = time.monotonic()
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kwargs = engine_kwargs(spec)
    kwargs["kv_transfer_config"] = KVTransferConfig(**kwargs["kv_transfer_config"])
    memory = engine_memory(kwargs)
    llm = LLM(**kwargs, **memory)
    ready = time.monotonic()
    params = SamplingParams(temperature=0.0, max_tokens=int(spec.get("max_tokens", 1)), ignore_eos=True,
                            detokenize=False)
    prompts = spec["prompts"]
    sizes = engine_block_sizes(llm)
    cut = bool(spec.get("cut_at_boundaries", True))
    block_size = (spec.get("cut_block_size") or sizes["mamba_block_size"] or sizes["block_size"]) if cut else None
    if cut and not block_size:
        print("driver: cannot read the engine's block size to cut the prompts at: give cut_block_size "
              "(verify --block-size)", file=sys.stderr)
        return 2
    requests = cut_prompts(prompts, int(block_size) if block_size else None)
    counts = {"prompt": 0, "cached": 0}
    batch = int(spec.get("generate_batch", 256))  # requests per generate call: bounded memory, same order
    for start in range(0, len(requests), batch):
        chunk = requests[start:start + batch]
        outputs = llm.generate([TokensPrompt(prompt_token_ids=list(prompts[i][:n])) for i, n in chunk], params,
                               use_tqdm=False)
        counts["prompt"] += sum(n for _, n in chunk)
        counts["cached"] += sum(o.num_cached_tokens or 0 for o in outputs)
    generated = time.monotonic()
    time.sleep(float(spec.get("settle_s", 1.0)))  # the connector's sending thread puts asynchronously
    result = {"prompts": len(prompts), "requests": len(requests), "cache_prefix": spec["cache_prefix"],
              "cut_at_boundaries": cut, "block_size": int(block_size) if block_size else None,
              "block_size_from": (spec.get("cut_block_size_from") or "spec") if spec.get("cut_block_size")
              else ("engine" if cut else None),
              "engine_block_size": sizes["block_size"], "engine_mamba_block_size": sizes["mamba_block_size"],
              "token_counts": {**counts, "computed": counts["prompt"] - counts["cached"]},
              "memory": memory or "the operator's",
              "seconds": {"engine_start": round(ready - started, 1), "generate": round(generated - ready, 1)}}
    if spec.get("out"):
        with open(spec["out"], "w") as handle:
            json.dump(result, handle)
    else:
        print(json.dumps(result))
    with contextlib.suppress(Exception):  # best effort: the process exits next anyway
        llm.llm_engine.engine_core.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
