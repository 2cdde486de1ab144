"""One vLLM engine, run in its own process by the e2e tests: ``python tests/e2e/producer.py SPEC.json``.

The parent (tests/e2e/harness.py) sets the environment (Mooncake config, recorder, shims, vLLM CPU
settings) before starting it: vLLM and its plugins read it as the engine starts. SPEC is a JSON object:

  model          the model directory (its basename is the model field of every key)
  batches        a list of batches, each a list of prompts (lists of token ids) or a sized batch
                 (``{"sized": {"count", "blocks", "extra", "seed"}}``: `count` random prompts of
                 ``blocks`` of the engine's own block size plus ``extra`` tokens, made once the engine
                 has said its block size: vLLM raises a hybrid's block by rules that depend on the CPU);
                 each batch is one ``LLM.generate`` call, in order
  max_tokens     greedy tokens per prompt
  block_size     or null (vLLM's choice)
  dtype          LLM(dtype=...), or null for "auto"
  mamba_ssm_cache_dtype  LLM(mamba_ssm_cache_dtype=...), or absent for vLLM's choice
  kv_cache_dtype LLM(kv_cache_dtype=...) ("fp8": the attention pages in float8_e4m3fn), or absent for "auto"
  mamba          serve with mamba_cache_mode="align"
  retention_none prefix_cache_retention_interval=None (every Mamba block kept; needed for the bug)
  tp             tensor_parallel_size (>1 uses the mp executor: the parent must set
                 VLLM_ENABLE_V1_MULTIPROCESSING=1)
  connector      false: no KV transfer (a cold reference)
  drain          wait (up to 60 s) until every rank's connector has sent what it queued, before
                 shutdown (drain_sends); otherwise only settle_s (default 1 s)
  out            where the result JSON goes
  kv_connector   the KVTransferConfig connector (default MooncakeStoreConnector; LMCacheConnectorV1 for
                 tests/e2e/test_lmcache_e2e.py), kv_connector_extra_config its extra config
  kv_transfer_params  per batch, per prompt: the request's kv_transfer_params (SamplingParams.extra_args),
                 or null (LMCache's ``lmcache.tag.*`` request tags)
  settle_s       seconds to wait after the last batch before shutdown (default 1)
  kv_role        the connector's role (default kv_both; kv_consumer for a consumer that never puts)
  kv_load_failure_policy  KVTransferConfig's ("recompute" | "fail"), or absent for vLLM's default
  logprobs       top-n logprobs per generated token (each prompt's result then has "logprobs": per
                 token, the chosen token's logprob, and "finish_reason")

The result: {"batches": [[{"tokens": [...], "cached_tokens": n}, ...], ...], "prompts": [[[...], ...], ...]
(every batch's prompts, sized ones made), "seconds": {...}}.

``python tests/e2e/producer.py --serve``: a process that imports vLLM once and forks one child per
request, each child then a producer as above (its own working directory, environment, log and
process group), so that each engine does not pay vLLM's import (6-7 s here) again. A request is one
line of JSON on stdin, ``{"spec", "cwd", "env", "log"}``; the answers are ``pid N`` once the child
runs and ``exit N RC`` once it has ended (RC negative: the signal that ended it). Nothing vLLM reads
from the environment at import differs between engines (only its logging level, the same for all);
what they set apart (the connector's config, the recorder, the guards, the multiprocessing switch,
the shims) is read when the engine starts, in the child. The harness sends an engine whose
``PYTHONPATH`` differs (stand-in modules) to a process of its own instead.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import sys
import time


def main(spec_path: str) -> int:
    spec = json.loads(open(spec_path).read())
    started = time.monotonic()
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    imported = time.monotonic()
    kwargs = dict(model=spec["model"], skip_tokenizer_init=True, enforce_eager=True, enable_prefix_caching=True,
                  max_model_len=spec.get("max_model_len", 2048), seed=0, max_num_seqs=8)
    if spec.get("dtype"):
        kwargs["dtype"] = spec["dtype"]
    if spec.get("block_size"):
        kwargs["block_size"] = spec["block_size"]
    if spec.get("mamba_ssm_cache_dtype"):
        kwargs["mamba_ssm_cache_dtype"] = spec["mamba_ssm_cache_dtype"]
    if spec.get("kv_cache_dtype"):
        kwargs["kv_cache_dtype"] = spec["kv_cache_dtype"]
    if spec.get("mamba"):
        kwargs["mamba_cache_mode"] = "align"
    if spec.get("retention_none"):
        kwargs["prefix_cache_retention_interval"] = None
    if spec.get("connector", True):
        transfer = dict(kv_connector=spec.get("kv_connector") or "MooncakeStoreConnector",
                        kv_role=spec.get("kv_role") or "kv_both",
                        kv_connector_extra_config=spec.get("kv_connector_extra_config") or {})
        if spec.get("kv_load_failure_policy"):
            transfer["kv_load_failure_policy"] = spec["kv_load_failure_policy"]
        kwargs["kv_transfer_config"] = KVTransferConfig(**transfer)
    if spec.get("tp", 1) > 1:
        kwargs.update(tensor_parallel_size=spec["tp"], distributed_executor_backend="mp")
    llm = LLM(**kwargs)
    ready = time.monotonic()
    try:
        result_layout = describe(llm)
    except Exception as error:  # a description is a by-product: never fail the run for it
        result_layout = {"error": repr(error)}
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True, detokenize=False,
                            logprobs=spec.get("logprobs"))
    batches = [made(batch, llm.llm_engine.vllm_config.cache_config.block_size) for batch in spec["batches"]]
    result = {"batches": [], "prompts": batches, "vllm": result_layout, "pid": os.getpid()}
    per_batch_params = spec.get("kv_transfer_params") or [None] * len(spec["batches"])
    for batch, transfer in zip(batches, per_batch_params):
        batch_params = params if not transfer else [
            params if not t else SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True,
                                                detokenize=False, extra_args={"kv_transfer_params": t})
            for t in transfer]
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], batch_params, use_tqdm=False)
        result["batches"].append([_outcome(o, bool(spec.get("logprobs"))) for o in outputs])
    generated = time.monotonic()
    if spec.get("drain"):
        try:
            result["unsent_after_drain"] = llm.collective_rpc(drain_sends, args=(60.0,))
        except Exception as error:  # fall back on the settle time below
            result["unsent_after_drain"] = repr(error)
    # Saves are asynchronous (the connector's sending thread): give them a moment before teardown.
    time.sleep(spec.get("settle_s", 1.0))
    result["seconds"] = {"import": round(imported - started, 1), "engine_start": round(ready - imported, 1),
                         "generate": round(generated - ready, 1)}
    with open(spec["out"], "w") as out:
        json.dump(result, out)
    with contextlib.suppress(Exception):  # best effort: the process exits next anyway
        llm.llm_engine.engine_core.shutdown()
    if spec.get("kv_connector") == "LMCacheConnectorV1":
        # LMCache 0.5.6 leaves non-daemon threads (health monitor, its event loop) behind: the
        # interpreter would wait on them for ever. The result is written and the engine shut down.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


def made(batch, block_size: int) -> list[list[int]]:
    """A batch's prompts: as given, or a sized batch's made for the engine's block size."""
    if not isinstance(batch, dict):
        return batch
    sized = batch["sized"]
    rng = random.Random(sized["seed"])
    length = sized["blocks"] * block_size + sized["extra"]
    return [[rng.randrange(3, 512) for _ in range(length)] for _ in range(sized["count"])]


def _outcome(output, logprobs: bool) -> dict:
    completion = output.outputs[0]
    outcome = {"tokens": list(completion.token_ids), "cached_tokens": output.num_cached_tokens or 0}
    if logprobs:
        outcome["finish_reason"] = completion.finish_reason
        outcome["logprobs"] = [float(step[token].logprob) if step and token in step else None
                               for token, step in zip(completion.token_ids, completion.logprobs or [])]
    return outcome


def drain_sends(worker, timeout_s: float) -> int:
    """Runs in every worker (LLM.collective_rpc): wait until the MooncakeStoreConnector's sending thread
    has handled every store job queued so far; returns the jobs still queued (0: drained). Shutdown
    aborts the engine without that wait: at TP 2, with a fixed 1 s, rank 0 lost 2 of its 4 Mamba2 puts."""
    from vllm.distributed.kv_transfer.kv_transfer_state import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return 0
    thread = getattr(getattr(get_kv_transfer_group(), "connector_worker", None), "kv_send_thread", None)
    if thread is None:
        return 0
    deadline = time.monotonic() + timeout_s
    while thread.request_queue.unfinished_tasks and time.monotonic() < deadline:
        time.sleep(0.05)
    return thread.request_queue.unfinished_tasks


def describe(llm) -> dict:
    """What vLLM resolved: dtypes, block size, page padding and (in-process) every KV cache group's spec."""
    config = llm.llm_engine.vllm_config
    cache, model = config.cache_config, config.model_config
    info = {"model_type": getattr(model.hf_config, "model_type", None), "dtype": str(model.dtype),
            "block_size": cache.block_size, "cache_dtype": str(cache.cache_dtype),
            "mamba_cache_dtype": str(cache.mamba_cache_dtype), "mamba_ssm_cache_dtype": str(cache.mamba_ssm_cache_dtype),
            "mamba_page_size_padded": cache.mamba_page_size_padded, "mamba_cache_mode": cache.mamba_cache_mode,
            "tp": config.parallel_config.tensor_parallel_size}
    try:  # only in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) is the engine core reachable
        kv_cache_config = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config
    except AttributeError:
        return info
    info["num_blocks"] = kv_cache_config.num_blocks
    groups = []
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        entry = {"spec": type(spec).__name__, "layers": list(group.layer_names), "block_size": spec.block_size,
                 "page_size_bytes": spec.page_size_bytes}
        for name in ("shapes", "dtypes", "page_size_padded", "num_kv_heads", "head_size", "dtype", "mamba_type"):
            if hasattr(spec, name):
                value = getattr(spec, name)
                entry[name] = value if isinstance(value, (int, type(None))) else str(value) if not isinstance(
                    value, tuple) else [list(v) if isinstance(v, tuple) else str(v) for v in value]
        if hasattr(spec, "real_page_size_bytes"):
            entry["real_page_size_bytes"] = spec.real_page_size_bytes
        groups.append(entry)
    info["kv_cache_groups"] = groups
    tensors = []
    for tensor in kv_cache_config.kv_cache_tensors:
        tensors.append({name: (value if isinstance(value, (int, float, type(None))) else
                               list(value) if isinstance(value, (list, tuple)) else str(value))
                        for name, value in vars(tensor).items()})
    info["kv_cache_tensors"] = tensors
    return info


def serve() -> int:
    """The ``--serve`` loop (see the module's docstring); returns when stdin closes. A child returns
    from here by raising SystemExit with its producer's exit status: the interpreter then exits as a
    producer run on its own does (atexit handlers, threads joined)."""
    from vllm import LLM, SamplingParams  # noqa: F401  (what every child would import first)
    from vllm.config import KVTransferConfig  # noqa: F401
    from vllm.inputs import TokensPrompt  # noqa: F401

    print("ready", flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _become_producer(request)
        print(f"pid {pid}", flush=True)
        _, status = os.waitpid(pid, 0)
        print(f"exit {pid} {os.waitstatus_to_exitcode(status)}", flush=True)
    return 0


def _become_producer(request: dict) -> None:
    """In a forked child: the request's process group, directory, log, environment and arguments,
    then `main` on its spec; never returns."""
    os.setpgid(0, 0)  # the harness ends an engine that overruns by its group: its workers too
    os.chdir(request["cwd"])
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    stdin = os.open(os.devnull, os.O_RDONLY)
    os.dup2(stdin, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.close(stdin)
    sys.stdin = open(os.devnull)  # (the loop's stdin is the serving process's, not this engine's)
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = [__file__, request["spec"]]
    code = 1
    try:
        code = main(request["spec"])
    except SystemExit as done:
        code = 0 if done.code is None else done.code if isinstance(done.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    raise SystemExit(code)


if __name__ == "__main__":
    sys.exit(serve() if sys.argv[1:] == ["--serve"] else main(sys.argv[1]))
