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
    it; with ``"prefix_caching": false`` it is off.

SPEC (JSON object):
  model           model directory or name (its basename is the model field of every key: give the
                  production's)
  prompts         list of prompts, each a list of token ids
  cache_prefix    the reference namespace (keys become ``{cache_prefix}@{model}@...``)
  block_size, dtype, tp, max_model_len, max_num_seqs, mamba_cache_mode, mamba_cache_dtype,
  mamba_ssm_cache_dtype, kv_cache_dtype, prefix_caching, extra (more LLM(...) keyword arguments)
  max_tokens      tokens to generate per prompt (default 1: the prompt's state is what is published)
  out             where the result JSON goes (optional)

The Mooncake config comes from ``MOONCAKE_CONFIG_PATH``, as for any vLLM producer.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time


def engine_kwargs(spec: dict) -> dict:
    """LLM(...) keyword arguments for the reference engine (no vLLM import: testable anywhere)."""
    extra_config = {"cache_prefix": spec["cache_prefix"], "enable_lookup": False}
    kwargs = dict(model=spec["model"], skip_tokenizer_init=True, enforce_eager=True,
                  enable_prefix_caching=bool(spec.get("prefix_caching", True)),
                  max_model_len=int(spec.get("max_model_len", 2048)), seed=int(spec.get("seed", 0)),
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
    return kwargs


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
    llm = LLM(**kwargs)
    ready = time.monotonic()
    params = SamplingParams(temperature=0.0, max_tokens=int(spec.get("max_tokens", 1)), ignore_eos=True,
                            detokenize=False)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in spec["prompts"]], params,
                           use_tqdm=False)
    generated = time.monotonic()
    time.sleep(float(spec.get("settle_s", 1.0)))  # the connector's sending thread puts asynchronously
    result = {"prompts": len(spec["prompts"]), "cache_prefix": spec["cache_prefix"],
              "tokens": [list(o.outputs[0].token_ids) for o in outputs],
              "cached_tokens": [o.num_cached_tokens or 0 for o in outputs],
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
