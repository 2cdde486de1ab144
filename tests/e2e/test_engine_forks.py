"""The harness's engine processes (`harness.EngineForks`: each engine forked from one process that
imported vLLM once): an engine that fails is reported with its own log, one that overruns its time
is ended with everything it started, and the next engine after either runs as any other."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.e2e import harness


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (psutil: vLLM's own dependency, in the venv these tests run in)."""
    import psutil

    return [child.pid for child in psutil.Process(pid).children()]


@pytest.fixture
def forked():
    if os.environ.get(harness.OWN_PROCESS_ENV):
        pytest.skip(f"{harness.OWN_PROCESS_ENV} set: every engine starts afresh")
    return harness._forks()


def test_a_failing_engine_is_reported_with_its_own_log_and_the_next_one_runs(forked, models_dir, tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(harness.EngineFailed) as failed:
        harness.run_engine(missing, None, [[[5, 6, 7]]], tmp_path / "failing", mamba=False, block_size=16,
                           max_tokens=1, timeout_s=120)
    assert "exited 1" in str(failed.value) and "no-such-model" in str(failed.value)
    assert "no-such-model" in (tmp_path / "failing" / "engine.log").read_text()
    run = harness.run_engine(models_dir / "mamba2-tiny", None, [[[5, 6, 7, 8]]], tmp_path / "next", mamba=True,
                             block_size=16, dtype="float32", max_tokens=2, timeout_s=300)
    assert len(run.tokens(0)[0]) == 2 and run.pid not in (None, forked.process.pid)
    assert _children(forked.process.pid) == []


def test_an_engine_past_its_time_is_ended_with_its_processes(forked, models_dir, tmp_path):
    with pytest.raises(subprocess.TimeoutExpired):
        harness.run_engine(models_dir / "mamba2-tiny", None, [[[5, 6, 7, 8]]], tmp_path / "slow", mamba=True,
                           block_size=16, dtype="float32", max_tokens=2, timeout_s=1.0)
    assert _children(forked.process.pid) == []
    assert not (tmp_path / "slow" / "engine.out.json").exists()  # ended, not waited for
    run = harness.run_engine(models_dir / "mamba2-tiny", None, [[[5, 6, 7, 8]]], tmp_path / "after", mamba=True,
                             block_size=16, dtype="float32", max_tokens=2, timeout_s=300)
    assert len(run.tokens(0)[0]) == 2
