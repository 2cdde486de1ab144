"""Layouts from the producer's manifest: exact layouts from what vLLM registered, and a scan that
uses them instead of a model config's inference (issue #19 §1)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from audit.errors import AuditError
from audit.judge.plan import CheckPlan, load_layouts
from audit.keys import vllm_key
from audit.layouts.infer import observed_sizes
from audit.layouts.manifest import FROM_MANIFEST, manifest_platform, read_manifest, read_manifests, segment_layer
from audit.layouts.model import LayoutError
from audit.records import KeyInfo
from audit.recorder.manifest import describe_worker, write_manifest
from tests.helpers import by_key, run_cli, scan_json
from tests.recorder import fake_vllm

LLAMA_CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 128,
                "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 2,
                "num_key_value_heads": 1, "head_dim": 64, "torch_dtype": "bfloat16", "vocab_size": 512}


@pytest.fixture
def fake_vllm_installed(monkeypatch):
    fake_vllm.install_fake_vllm(monkeypatch)


def llama_worker(tp_rank: int = 0, tp_size: int = 1):
    """A tiny Llama served in float32 with block 32: 2 layers of one 64-wide KV head, 16,384 B pages."""
    spec = fake_vllm.FullAttentionSpec(block_size=32, num_kv_heads=1, head_size=64, dtype=fake_vllm.FLOAT32)
    layers = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    return fake_vllm.build_worker("llama-tiny", [(layers, spec)], [layers], tp_rank=tp_rank, tp_size=tp_size)


def written(directory: Path, worker_and_caches, pid: int = 1) -> Path:
    document = describe_worker(*worker_and_caches)
    document["pid"] = pid  # one file per engine process
    return write_manifest(directory, document)


def test_attention_segments_are_kv_regions_of_the_registered_tensor(fake_vllm_installed, tmp_path):
    (layout,) = read_manifest(written(tmp_path, llama_worker())).layouts
    assert (layout.model, layout.group, layout.kind, layout.tp_size, layout.size) == ("llama-tiny", 0, "attention",
                                                                                      1, 32768)
    assert [(s.name, s.layer, s.offset, s.length) for s in layout.segments] == [("layers.0", 0, 0, 16384),
                                                                               ("layers.1", 1, 16384, 16384)]
    assert [(r.name, r.kind, r.dtype, r.shape) for _, r in layout.regions()] == [("kv", "kv", "float32",
                                                                                 (1, 32, 128))] * 2


def test_mamba_pages_are_states_then_padding_and_other_groups_slots_unused(fake_vllm_installed, tmp_path):
    attention, mamba = read_manifest(written(tmp_path, fake_vllm.hybrid_worker())).layouts
    assert attention.kind == "attention" and mamba.kind == "mamba2"
    assert [(r.name, r.kind, r.offset, r.length, r.dtype, r.shape) for r in mamba.segments[1].regions] == [
        ("conv", "state", 32768, 1920, "float32", (3, 160)),
        ("ssm", "state", 34688, 8192, "float32", (8, 16, 16)),
        ("padding", "padding", 42880, 22656, "raw", (22656,))]

    conv = fake_vllm.MambaSpec(block_size=64, shapes=((2, 64),), dtypes=(fake_vllm.BFLOAT16,),
                               page_size_padded=16384, mamba_type=fake_vllm.MambaAttentionBackendEnum.SHORT_CONV)
    kv = fake_vllm.FullAttentionSpec(block_size=64, num_kv_heads=1, head_size=64, dtype=fake_vllm.BFLOAT16)
    worker = fake_vllm.build_worker("lfm2-like", [(["m.layers.0.conv", "m.layers.2.conv"], conv),
                                                  (["m.layers.1.attn"], kv)],
                                    [["m.layers.0.conv", "m.layers.2.conv"], ["m.layers.1.attn"]])
    _, attention = read_manifest(written(tmp_path / "lfm2", worker)).layouts
    assert [(s.name, [r.name for r in s.regions]) for s in attention.segments] == [("layers.1", ["kv"]),
                                                                                  ("unused.1", ["unused"])]


REAL_MANIFESTS = json.loads((Path(__file__).parents[1] / "e2e" / "observed.json").read_text())["runs"]


def older_recorders(document: dict) -> dict:
    """A real manifest as a recorder before ``decoder_layer`` wrote it."""
    for group in document["groups"]:
        for segment in group["segments"] or ():
            segment.pop("decoder_layer", None)
    return document


@pytest.mark.parametrize("run", ["manifest-falcon-h1-tiny", "clean-falcon-h1-tiny"])
def test_falcon_h1s_mixers_are_their_decoder_layers_in_an_old_recorders_manifest(tmp_path, run):
    """A real vLLM 0.32's Falcon-H1 manifest, written before the recorder kept ``decoder_layer``:
    vLLM names decoder layer i's mixer ``model.{2 + i}.mixer`` (2 hidden layers), and its layout
    puts layer 0's conv state in segment 0, where the binding finds it."""
    from audit.judge.binding import layer0_region

    path = tmp_path / "manifest-vm-1.json"
    path.write_text(json.dumps(older_recorders(REAL_MANIFESTS[run]["manifest"])))
    attention, mamba = read_manifest(path).layouts
    assert [(s.name, s.layer) for s in mamba.segments] == [("layers.0", 0), ("layers.1", 1)]
    assert [(s.name, s.layer) for s in attention.segments] == [("layers.0", 0), ("layers.1", 1)]
    conv = layer0_region(mamba, "conv")
    assert (conv.name, conv.offset, conv.shape) == ("conv", 0, (3, 160))


def test_every_real_manifests_layers_are_their_decoder_layers():
    """Read off the names, only Falcon-H1's offset ones move: every other family's decoder layer is
    its name's index."""
    for run, entry in REAL_MANIFESTS.items():
        if not entry.get("manifest"):
            continue
        document = older_recorders(entry["manifest"])
        offset = 2 if document["model"].startswith("falcon-h1") else 0
        for group in document["groups"]:
            for segment in group["segments"] or ():
                if segment["layer"] is not None:
                    moved = segment["layer_index"] - (offset if ".layers." not in segment["layer"] else 0)
                    assert segment_layer(document, segment) == moved, (run, segment["layer"])


def test_the_manifests_decoder_layer_wins_over_the_names(tmp_path):
    document = json.loads(json.dumps(REAL_MANIFESTS["manifest-falcon-h1-tiny"]["manifest"]))
    for segment, decoder in zip(document["groups"][1]["segments"], (1, 0)):
        segment["decoder_layer"] = decoder
    path = tmp_path / "manifest-vm-1.json"
    path.write_text(json.dumps(document))
    _, mamba = read_manifest(path).layouts
    assert [s.layer for s in mamba.segments] == [1, 0]


def test_ranks_of_one_deployment_give_one_layout_and_two_deployments_are_refused(fake_vllm_installed, tmp_path):
    written(tmp_path, llama_worker(tp_rank=0, tp_size=2), pid=1)
    written(tmp_path, llama_worker(tp_rank=1, tp_size=2), pid=2)
    manifests = read_manifests([tmp_path])
    assert len(manifests.manifests) == 2 and len(manifests.layouts) == 1
    assert manifests.layouts[0].tp_size == 2

    written(tmp_path, llama_worker(tp_rank=0, tp_size=1), pid=3)
    with pytest.raises(LayoutError, match="different layouts .*two producers under one model name"):
        read_manifests([tmp_path])


def test_a_manifest_the_audit_cannot_read_is_one_clear_error(tmp_path):
    cases = {"not-json": "{", "other": json.dumps({"schema": "something/else", "version": 1}),
             "newer": json.dumps({"schema": "mooncake-audit/manifest", "version": 2}),
             "truncated": json.dumps({"schema": "mooncake-audit/manifest", "version": 1, "groups": [{}]})}
    for name, text in cases.items():
        path = tmp_path / f"manifest-{name}.json"
        path.write_text(text)
        with pytest.raises(LayoutError) as error:
            read_manifest(path)
        assert str(path) in str(error.value) and "\n" not in str(error.value), name
    assert "version 2; this audit reads version 1" in _message(tmp_path / "manifest-newer.json")
    assert "missing field" in _message(tmp_path / "manifest-truncated.json")
    assert read_manifests([tmp_path / "empty"]) is None


def _message(path: Path) -> str:
    with pytest.raises(LayoutError) as error:
        read_manifest(path)
    return str(error.value)


def test_the_plan_takes_the_manifest_instead_of_the_configs_inference(fake_vllm_installed, tmp_path):
    config_dir = tmp_path / "llama-tiny"
    config_dir.mkdir()
    (config_dir / "config.json").write_text(json.dumps(LLAMA_CONFIG))
    records = tmp_path / "records"
    written(records, llama_worker())
    plan = CheckPlan(layouts=load_layouts(model_configs=[config_dir]))
    assert plan.requests and plan.layouts[0].regions().__next__()[1].dtype == "bfloat16"  # vLLM's CPU guess

    plan.use_manifests([records])
    assert not plan.requests
    (layout,) = plan.layouts
    assert {region.dtype for _, region in layout.regions()} == {"float32"}
    keys = [KeyInfo(vllm_key("llama-tiny", f"{i:064x}"), 32768) for i in range(3)]
    (row,) = plan.fit_sizes(keys)
    assert row["status"] == "from_manifest" and row["from"] == FROM_MANIFEST
    assert row["manifest"].startswith(str(records)) and row["layout_size"] == row["dominant_size"] == 32768
    assert row["assumed"]["kv_dtype"] == "float32" and row["assumed"]["platform"] == "cpu"
    assert plan.manifests.rows(observed_sizes(keys)) == [row]


@pytest.mark.parametrize("device, capability, platform", [
    ("cuda", (9, 0), "sm90"), ("cuda", (10, 0), "sm100"), ("cuda", (10, 3), "sm100"), ("cuda", (12, 0), "sm120"),
    ("cuda", (8, 0), "cuda"), ("cuda", None, "cuda"), ("cpu", None, "cpu"), ("rocm", (9, 4), "rocm")])
def test_the_manifest_settles_the_gpu_its_capability_names(monkeypatch, tmp_path, device, capability, platform):
    """The reading a manifest settles names the audit's platform of the producer's GPU (the rules
    of vLLM 0.33 differ between SM90, SM100 and SM120), and the report's manifest row says it too."""
    fake_vllm.install_fake_vllm(monkeypatch, version="0.33.0", platform=device, capability=capability)
    records = tmp_path / "records"
    written(records, llama_worker())
    plan = CheckPlan()
    plan.use_manifests([records])
    keys = [KeyInfo(vllm_key("llama-tiny", f"{i:064x}"), 32768) for i in range(3)]
    (row,) = plan.fit_sizes(keys)
    assert (row["assumed"]["platform"], row["assumed"]["vllm_version"]) == (platform, "0.33.0")
    (manifest,) = read_manifests([records]).manifests
    assert (manifest.summary()["platform"], manifest.summary()["device_capability"]) == (
        platform, None if capability is None else list(capability))


def test_a_manifest_written_before_the_capability_was_recorded_reads_as_before(fake_vllm_installed, tmp_path):
    document = describe_worker(*llama_worker())
    del document["device_capability"]
    document["platform"] = "cuda"
    records = tmp_path / "records"
    write_manifest(records, document)
    (manifest,) = read_manifests([records]).manifests
    assert manifest_platform(document) == manifest.summary()["platform"] == "cuda"  # any CUDA GPU, as before
    assert [layout.size for layout in manifest.layouts] == [32768]


def test_conflicting_manifests_stop_the_plan_with_one_line(fake_vllm_installed, tmp_path):
    written(tmp_path, llama_worker(tp_size=2), pid=1)
    written(tmp_path, llama_worker(tp_size=1), pid=2)
    with pytest.raises(AuditError, match="give model 'llama-tiny' group 0 different layouts"):
        CheckPlan().use_manifests([tmp_path])


def test_the_layout_command_shows_the_manifests_layout(fake_vllm_installed, tmp_path):
    written(tmp_path, llama_worker())
    result = run_cli("layout", "--block-tables", str(tmp_path))
    assert result.exit_code == 0, result.output
    assert "llama-tiny group 0 (attention, TP 1): 32,768 bytes per key" in result.output
    assert "from the producer's manifest" in result.output and "float32" in result.output
    document = json.loads(run_cli("layout", "--block-tables", str(tmp_path), "--format", "json").stdout)
    assert document["layouts"][0]["model"] == "llama-tiny"
    missing = run_cli("layout", "--block-tables", str(tmp_path / "nothing"))
    assert missing.exit_code == 2 and "no manifest-*.json" in missing.output


def test_a_scan_with_the_records_directory_reads_float32_keys_as_the_producer_wrote_them(
        fake_vllm_installed, tmp_path, publisher, cli_args, namespace):
    """Keys of a float32 Llama, with a bfloat16 config.json: the manifest settles the dtype."""
    config_dir = tmp_path / "llama-tiny"
    config_dir.mkdir()
    (config_dir / "config.json").write_text(json.dumps(LLAMA_CONFIG))
    records = tmp_path / "records"
    written(records, llama_worker())
    rng = np.random.default_rng(19)
    keys = [vllm_key("llama-tiny", f"{i:064x}", cache_prefix=namespace) for i in range(4)]
    publisher.put_many((key, rng.standard_normal(8192).astype(np.float32)) for key in keys)

    code, report = scan_json(cli_args, "--prefix", namespace, "--model-config", str(config_dir),
                             "--block-tables", str(records), "--all")
    assert code == 0, report["summary"]
    assert all(not by_key(report)[key]["verdicts"] for key in keys)
    (row,) = report["summary"]["layout_inference"]
    assert (row["status"], row["from"], row["keys"]) == ("from_manifest", FROM_MANIFEST, 4)
    (summary,) = report["summary"]["manifests"]
    assert summary["model"] == "llama-tiny" and summary["groups"][0]["kind"] == "attention"


def test_explain_reads_a_key_with_the_manifests_layout(fake_vllm_installed, tmp_path, publisher, cli_args,
                                                       namespace):
    records = tmp_path / "records"
    written(records, llama_worker())
    key = vllm_key("llama-tiny", "ab" * 32, cache_prefix=namespace)
    publisher.put(key, np.random.default_rng(5).standard_normal(8192).astype(np.float32))
    result = run_cli("explain", *cli_args, key, "--block-tables", str(records), "--format", "json")
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    assert {region["dtype"] for region in document["regions"]} == {"float32"}
    assert document["layout_inference"][0]["status"] == "from_manifest"
    human = run_cli("explain", *cli_args, key, "--block-tables", str(records))
    assert "layout from_manifest: the producer's manifest" in human.output
