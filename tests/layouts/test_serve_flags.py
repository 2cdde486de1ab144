"""The operator's `vllm serve` flags, spelled as vLLM spells them, on the command line and in the
YAML file `vllm serve --config` reads."""

from __future__ import annotations

import json

import pytest

from audit.layouts.model import LayoutError
from audit.layouts.serve_flags import ServeFlags, read_serve_config
from audit.verify.engine import root_cause
from tests.helpers import run_cli
from tests.layouts.test_families import LLAMA_TINY, MAMBA2_TINY


def test_a_vllm_config_file_gives_the_layout_flags(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text("model: /models/llama\ndtype: float32\nkv-cache-dtype: auto\nblock_size: 16\n"
                    "tensor-parallel-size: 2\nmamba-ssm-cache-dtype: float32\nmax-model-len: 4096\n")
    assert read_serve_config(path) == ServeFlags(model_dtype="float32", block_size=16, tp_size=2,
                                                 ssm_dtype="float32")
    given = ServeFlags.given(model_dtype="bfloat16", tp_size=None, kv_cache_dtype="AUTO")
    assert given.over(read_serve_config(path)) == ServeFlags(model_dtype="bfloat16", block_size=16, tp_size=2,
                                                             ssm_dtype="float32")


@pytest.mark.parametrize("text, message", [("- a\n- b\n", "expected a mapping"), ("block-size: big\n", "positive integer"),
                                           ("dtype: [\n", "not YAML")])
def test_a_bad_vllm_config_is_one_line(tmp_path, text, message):
    path = tmp_path / "serve.yaml"
    path.write_text(text)
    with pytest.raises(LayoutError, match=message):
        read_serve_config(path)


def _model(tmp_path, name, config):
    directory = tmp_path / name
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    return str(directory)


def test_layout_takes_vllms_spellings(tmp_path):
    model = _model(tmp_path, "llama", LLAMA_TINY)
    by_flags = run_cli("layout", "--model-config", model, "--dtype", "float32", "--block-size", "16", "-tp", "1",
                       "--format", "json")
    config = tmp_path / "serve.yaml"
    config.write_text("dtype: float32\nblock-size: 16\n")
    by_file = run_cli("layout", "--model-config", model, "--vllm-config", str(config), "--format", "json")
    assert by_flags.exit_code == by_file.exit_code == 0, by_flags.output + by_file.output
    assert by_flags.stdout == by_file.stdout
    regions = json.loads(by_flags.stdout)["layouts"][0]["segments"]["regions"]
    assert {region["dtype"] for region in regions} == {"float32"}
    mamba = _model(tmp_path, "mamba2", MAMBA2_TINY)
    old = run_cli("layout", "--model-config", mamba, "--state-dtype", "float16", "--ssm-dtype", "float32",
                  "--tp-size", "1", "--format", "json")
    new = run_cli("layout", "--model-config", mamba, "--mamba-cache-dtype", "float16",
                  "--mamba-ssm-cache-dtype", "float32", "--tensor-parallel-size", "1", "--format", "json")
    assert old.exit_code == 0 and old.stdout == new.stdout


def test_a_missing_vllm_config_is_exit_2(tmp_path):
    result = run_cli("layout", "--model-config", _model(tmp_path, "llama", LLAMA_TINY), "--vllm-config",
                     str(tmp_path / "absent.yaml"))
    assert result.exit_code == 2 and "absent.yaml" in result.output and "Traceback" not in result.output


def test_the_reference_engines_root_cause_is_named():
    log = "\n".join([
        "INFO 12-01 engine starting",
        "(EngineCore pid=77) ValueError: block_size must be divisible by hash_block_size",
        "Traceback (most recent call last):",
        "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}",
    ])
    assert root_cause(log) == "ValueError: block_size must be divisible by hash_block_size"
    assert root_cause("one\ntwo") == "one | two"


def test_the_root_cause_behind_a_workers_log_prefix_is_named():
    """vLLM's multi-process worker logs its reason behind its process and logger prefixes (issue #42:
    a busy host), then the engine core wraps it twice."""
    reason = ("ValueError: Available memory on node 0 (12.56/15.96 GiB) on startup is less than desired CPU "
              "memory utilization (0.92, 14.69 GiB).")
    log = "\n".join([
        "(VllmWorker-0 pid=20983) INFO 12-03 08:21:22 [cpu_worker.py:70] starting",
        f"(VllmWorker-0 pid=20983) ERROR 12-03 08:21:23 [multiproc_executor.py:953] {reason}",
        "(EngineCore_DP0 pid=20900) ERROR 12-03 08:21:24 [core.py:1100] Exception: WorkerProc initialization "
        "failed due to an exception in a background process. See stack trace for root cause.",
        "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}",
    ])
    assert root_cause(log) == reason
