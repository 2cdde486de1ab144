"""The producer's manifest, written inside the connector's worker: what it copies, where, and that it
never costs vLLM anything when it fails. vLLM's objects are stand-ins laid out as 0.32.0 lays them
(tests/recorder/fake_vllm.py); the real thing runs in tests/e2e/test_manifest_e2e.py."""

from __future__ import annotations

import fcntl
import json
import sys
import threading
import types

import pytest

from audit.blocktables import read_block_tables
from audit.layouts.fingerprint import cache_entry, default_cache, fingerprint
from audit.layouts.manifest import manifest_files, read_manifests
from audit.recorder import manifest as manifest_module
from audit.recorder.blocks import KeyBlocks
from audit.recorder.manifest import (
    WORKER_MODULE,
    describe_worker,
    hook_store_worker,
    layer_index,
    write_manifest,
)
from audit.recorder.records import RecordWriter, key_lines
from audit.recorder.wrapper import recording_store_class
from tests.helpers import tiny_mamba2_checkpoint
from tests.recorder import fake_vllm


@pytest.fixture
def fake_vllm_installed(monkeypatch):
    fake_vllm.install_fake_vllm(monkeypatch)


def test_the_manifest_copies_what_the_worker_registered(fake_vllm_installed):
    worker, kv_caches = fake_vllm.hybrid_worker(store=types.SimpleNamespace(audit_tenant="team-a"))
    document = describe_worker(worker, kv_caches)

    assert (document["schema"], document["version"]) == ("mooncake-audit/manifest", 1)
    assert {name: document[name] for name in ("model", "cache_prefix", "store_namespace", "tenant", "tp_size",
                                              "tp_rank", "pp_rank", "platform", "vllm_version")} == {
        "model": "falcon-h1-tiny", "cache_prefix": "", "store_namespace": "", "tenant": "team-a", "tp_size": 1,
        "tp_rank": 0, "pp_rank": 0, "platform": "cpu", "vllm_version": "0.32.0"}
    attention, mamba = document["groups"]
    assert attention["kind"] == "attention" and attention["spec"] == "FullAttentionSpec"
    assert attention["key_prefixes"] == ["falcon-h1-tiny@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0"]
    assert attention["attention"] == {"num_kv_heads": 1, "head_size": 64, "head_size_v": 64, "dtype": "float32"}
    assert (attention["block_size"], attention["page_size"]) == (64, 32768)
    assert [(s["index"], s["layer"], s["layer_index"], s["block_len"], s["dtype"], s["tensor_shape"][1:])
            for s in attention["segments"]] == [(0, "model.layers.0.attn", 0, 32768, "float32", [1, 64, 128]),
                                                (1, "model.layers.1.attn", 1, 32768, "float32", [1, 64, 128])]
    assert mamba["kind"] == "mamba2" and mamba["mamba_type"] == "MAMBA2" and mamba["page_size_padded"] == 32768
    assert mamba["states"] == [
        {"name": "conv", "dtype": "float32", "shape": [3, 160], "offset": 0, "length": 1920},
        {"name": "ssm", "dtype": "float32", "shape": [8, 16, 16], "offset": 1920, "length": 8192}]
    assert mamba["padding"] == {"offset": 10112, "length": 32768 - 10112}
    # each buffer holds one layer of each group: the same two segments, owned by the Mamba layers here
    assert [(s["layer"], s["offset_in_page"]) for s in mamba["segments"]] == [("model.2.mixer", 0),
                                                                              ("model.3.mixer", 0)]


@pytest.mark.parametrize("device, capability, recorded", [
    ("cpu", None, None), ("cuda", (9, 0), [9, 0]), ("cuda", (10, 3), [10, 3]), ("cuda", (8, 9), [8, 9])])
def test_the_manifest_names_the_gpu_by_its_compute_capability(monkeypatch, device, capability, recorded):
    """vLLM 0.33's rules differ between GPUs, so the manifest keeps ``current_platform``'s
    ``get_device_capability()`` beside its device name. The platform is a stand-in
    (``fake_vllm.FakePlatform``: a device name and a capability, nothing else)."""
    fake_vllm.install_fake_vllm(monkeypatch, version="0.33.0", platform=device, capability=capability)
    document = describe_worker(*fake_vllm.hybrid_worker())
    assert (document["platform"], document["device_capability"], document["vllm_version"]) == (
        device, recorded, "0.33.0")
    assert document["version"] == 1  # a field added, none changed meaning: old readers read it


def test_a_platform_that_cannot_say_its_capability_records_none():
    class Unknowing:
        def get_device_capability(self, device_id: int = 0):
            raise NotImplementedError  # vLLM's CudaPlatformBase before a concrete platform

    assert manifest_module.device_capability(Unknowing()) is None


def test_a_segment_no_layer_of_the_group_owns_names_the_layer_it_belongs_to(fake_vllm_installed):
    attention = fake_vllm.FullAttentionSpec(block_size=64, num_kv_heads=1, head_size=64, dtype=fake_vllm.BFLOAT16)
    conv = fake_vllm.MambaSpec(block_size=64, shapes=((2, 64),), dtypes=(fake_vllm.BFLOAT16,),
                               page_size_padded=attention.page_size_bytes,
                               mamba_type=fake_vllm.MambaAttentionBackendEnum.SHORT_CONV)
    worker, kv_caches = fake_vllm.build_worker(
        "lfm2-like", [(["model.layers.0.conv", "model.layers.2.conv"], conv), (["model.layers.1.attn"], attention)],
        [["model.layers.0.conv", "model.layers.2.conv"], ["model.layers.1.attn"]])
    conv_group, attention_group = describe_worker(worker, kv_caches)["groups"]
    assert conv_group["kind"] == "short_conv" and [s["name"] for s in conv_group["states"]] == ["conv"]
    assert [s["layer"] for s in attention_group["segments"]] == ["model.layers.1.attn", None]
    assert attention_group["segments"][1]["shared_with"] == "model.layers.2.conv"


@pytest.mark.parametrize("hidden_layers", [None, 2])
def test_the_manifest_names_each_segments_decoder_layer(fake_vllm_installed, monkeypatch, hidden_layers):
    """vLLM names Falcon-H1's decoder layer i's mixer ``model.{L + i}.mixer``: the manifest says
    which decoder layer each is, by the ``num_hidden_layers`` of the config vLLM runs, or by the
    names where that config is not at hand."""
    if hidden_layers is not None:
        config = types.ModuleType("vllm.config")
        text_config = types.SimpleNamespace(num_hidden_layers=hidden_layers)
        config.get_current_vllm_config_or_none = lambda: types.SimpleNamespace(
            model_config=types.SimpleNamespace(hf_text_config=text_config))
        monkeypatch.setitem(sys.modules, "vllm.config", config)
    attention, mamba = describe_worker(*fake_vllm.hybrid_worker())["groups"]
    assert [(s["layer"], s["layer_index"], s["decoder_layer"]) for s in mamba["segments"]] == [
        ("model.2.mixer", 2, 0), ("model.3.mixer", 3, 1)]
    assert [(s["layer_index"], s["decoder_layer"]) for s in attention["segments"]] == [(0, 0), (1, 1)]


def test_layer_index_follows_vllms_rule():
    assert layer_index("model.layers.12.self_attn.attn") == 12
    assert layer_index("model.2.mixer") == 2
    assert layer_index("model.layers.1.experts.3") is None  # two integers: vLLM refuses, so do we


def test_the_manifest_is_written_atomically_and_read_back(fake_vllm_installed, tmp_path):
    worker, kv_caches = fake_vllm.hybrid_worker()
    path = write_manifest(tmp_path / "records", describe_worker(worker, kv_caches))

    assert path.name.startswith("manifest-") and path.name.endswith(".json")
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # no partial file left behind
    assert manifest_files([path.parent]) == [path]
    manifests = read_manifests([path.parent])
    assert [(layout.group, layout.kind, layout.size) for layout in manifests.layouts] == [
        (0, "attention", 65536), (1, "mamba2", 65536)]


def _fake_worker_module(monkeypatch, register_kv_caches):
    module = types.ModuleType(WORKER_MODULE)

    class MooncakeStoreWorker:
        """Stands in for vLLM's worker class; the test gives it `register_kv_caches`."""

    MooncakeStoreWorker.register_kv_caches = register_kv_caches
    module.MooncakeStoreWorker = MooncakeStoreWorker
    monkeypatch.setitem(sys.modules, WORKER_MODULE, module)
    return MooncakeStoreWorker


def test_building_a_recording_store_hooks_the_workers_registration_once(fake_vllm_installed, monkeypatch, tmp_path):
    worker, kv_caches = fake_vllm.hybrid_worker()
    calls = []
    worker_class = _fake_worker_module(monkeypatch, lambda self, caches: calls.append(caches) or "registered")
    store_class = recording_store_class(object, RecordWriter(tmp_path))
    store_class()
    store_class()  # a second store: still one hook
    hooked = worker_class.register_kv_caches
    assert hooked.audit_manifest_directory == tmp_path

    monkeypatch.setattr(manifest_module, "describe_worker", lambda self, caches: describe_worker(worker, caches))
    assert hooked(object(), kv_caches) == "registered" and calls == [kv_caches]
    (path,) = tmp_path.glob("manifest-*.json")
    assert json.loads(path.read_text())["model"] == "falcon-h1-tiny"


def test_a_failing_manifest_never_reaches_vllm(monkeypatch, tmp_path, caplog):
    worker_class = _fake_worker_module(monkeypatch, lambda self, caches: "registered")
    assert hook_store_worker(tmp_path)
    monkeypatch.setattr(manifest_module, "describe_worker", lambda self, caches: 1 / 0)

    assert worker_class.register_kv_caches(object(), {}) == "registered"
    assert "cannot write the producer's manifest" in caplog.text
    assert not list(tmp_path.glob("manifest-*"))


def test_without_vllms_worker_nothing_is_hooked(monkeypatch, tmp_path):
    monkeypatch.delitem(sys.modules, WORKER_MODULE, raising=False)
    assert hook_store_worker(tmp_path) is False


class SetupStore:
    """A store whose setup() takes what MooncakeDistributedStore's does."""

    def setup(self, *args, **kwargs):
        return 0


@pytest.mark.parametrize("call", [
    lambda store: store.setup("h", "meta", 0, 1 << 20, "tcp", "", "master", tenant_id="team-a"),
    lambda store: store.setup("h", "meta", 0, 1 << 20, "tcp", "", "master", None, False, "", "team-a"),
    lambda store: store.setup({"local_hostname": "h", "metadata_server": "meta", "tenant_id": "team-a"}),
], ids=["keyword", "positional", "dict"])
def test_the_tenant_setup_joins_is_in_every_record(tmp_path, call):
    store = recording_store_class(SetupStore, RecordWriter(tmp_path))()
    assert store.audit_tenant == "default"
    assert call(store) == 0
    assert store.audit_tenant == "team-a"


def test_records_name_a_tenant_only_when_it_is_not_the_default(tmp_path):
    blocks = [KeyBlocks(1, [3])]
    default = json.loads(key_lines(["k"], blocks, [0], [[16]], set(), 1.0, 7)[0])
    tenant = json.loads(key_lines(["k"], blocks, [0], [[16]], set(), 1.0, 7, tenant="team-a")[0])
    assert "tenant" not in default and tenant["tenant"] == "team-a"
    (tmp_path / "blocks-h-7-0000.jsonl").write_text(json.dumps(tenant) + "\n")
    (tmp_path / "manifest-h-7.json").write_text("{}")  # a manifest beside them is no block table
    tables = read_block_tables([tmp_path, tmp_path / "manifest-h-7.json"])
    assert tables.get("k").tenant == "team-a" and tables.summary(None)["tenants"] == {"team-a": 1}


def _vllm_config_loading(monkeypatch, model) -> None:
    """``vllm.config.get_current_vllm_config_or_none``, as vLLM sets it around register_kv_caches."""
    config = types.ModuleType("vllm.config")
    current = types.SimpleNamespace(model_config=types.SimpleNamespace(model=str(model), revision=None),
                                    load_config=types.SimpleNamespace(download_dir=None))
    config.get_current_vllm_config_or_none = lambda: current
    monkeypatch.setitem(sys.modules, "vllm.config", config)


def test_the_manifest_carries_the_checkpoints_fingerprint_computed_without_holding_vllm(fake_vllm_installed,
                                                                                        monkeypatch, tmp_path):
    model = tmp_path / "mamba-tiny"
    tiny_mamba2_checkpoint(model)
    monkeypatch.setenv("MOONCAKE_AUDIT_CACHE", str(tmp_path / "cache"))
    _vllm_config_loading(monkeypatch, model)
    worker, kv_caches = fake_vllm.hybrid_worker()
    worker_class = _fake_worker_module(monkeypatch, lambda self, caches: "registered")
    assert hook_store_worker(tmp_path / "records")
    monkeypatch.setattr(manifest_module, "describe_worker", lambda self, caches: describe_worker(worker, caches))
    weights = model / "model.safetensors"
    lock = cache_entry(weights, weights.stat(), default_cache()).with_suffix(".lock")
    lock.parent.mkdir(parents=True)
    with open(lock, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another rank is hashing this file: the thread waits, vLLM does not
        assert worker_class.register_kv_caches(object(), kv_caches) == "registered"
        (path,) = (tmp_path / "records").glob("manifest-*.json")
        first = json.loads(path.read_text())
        assert first["model_path"] == str(model.resolve())
        assert first["fingerprint"] == {"algorithm": "xxh3_128", "model_path": str(model.resolve()),
                                        "complete": False, "digest": None, "note": "computing"}
    (thread,) = [thread for thread in threading.enumerate() if thread.name == manifest_module.FINGERPRINT_THREAD]
    thread.join(timeout=60)

    document = json.loads(path.read_text())
    expected = fingerprint(model)  # from the cache the thread filled
    carried = document["fingerprint"]
    assert (carried["complete"], carried["note"], carried["algorithm"]) == (True, None, "xxh3_128")
    assert (carried["digest"], carried["header"], carried["files"], carried["bytes"]) == (
        expected.digest, expected.header, 1, weights.stat().st_size)
    assert (carried["hashed_files"], expected.hashed_files) == (1, 0)
    assert document["written_at"] == first["written_at"] and document["groups"] == first["groups"]
    assert read_manifests([path.parent]).manifests[0].document["fingerprint"]["digest"] == expected.digest


@pytest.mark.parametrize("setting, model, note", [
    ("off", "checkpoint", "MOONCAKE_AUDIT_FINGERPRINT=off"),
    ("maybe", "checkpoint", "MOONCAKE_AUDIT_FINGERPRINT='maybe': expected on or off (1 or 0) (not fingerprinted)"),
    ("on", "org/not-downloaded-here", "the model vLLM loaded is not a directory on this host (not fingerprinted)"),
])
def test_a_fingerprint_turned_off_or_out_of_reach_is_said_and_never_started(fake_vllm_installed, monkeypatch,
                                                                            tmp_path, setting, model, note):
    if model == "checkpoint":
        model = tmp_path / "mamba-tiny"
        tiny_mamba2_checkpoint(model)
    monkeypatch.setenv("MOONCAKE_AUDIT_FINGERPRINT", setting)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _vllm_config_loading(monkeypatch, model)
    document = describe_worker(*fake_vllm.hybrid_worker())
    document["fingerprint"] = manifest_module.pending_fingerprint(document["model_path"])
    assert document["fingerprint"]["note"] == note and document["fingerprint"]["complete"] is False
    assert manifest_module.fingerprint_in_background(tmp_path, document) is None
    assert not list(tmp_path.glob("manifest-*"))


def test_a_checkpoint_that_cannot_be_fingerprinted_is_said_in_the_manifest(fake_vllm_installed, monkeypatch,
                                                                           tmp_path):
    (tmp_path / "empty").mkdir()
    _vllm_config_loading(monkeypatch, tmp_path / "empty")
    document = describe_worker(*fake_vllm.hybrid_worker())
    document["fingerprint"] = manifest_module.pending_fingerprint(document["model_path"])
    manifest_module.fingerprint_in_background(tmp_path / "records", document).join(timeout=60)
    (path,) = (tmp_path / "records").glob("manifest-*.json")
    carried = json.loads(path.read_text())["fingerprint"]
    assert carried["complete"] is False and carried["digest"] is None
    assert carried["note"] == f"cannot fingerprint: {tmp_path / 'empty'}: no weight files to fingerprint"
