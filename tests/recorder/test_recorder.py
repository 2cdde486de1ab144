"""The recorder and guard against a real cluster, driven by a producer making the connector's calls.

`KVProducer` does what vLLM's MooncakeStoreConnector does on the producer side, without vLLM: one
registered buffer per layer holding `num_blocks` blocks (blocks-first, or K/V-first with two
segments per buffer), and per key one address per segment, ``segment_base + block_id * block_len``.
The store is built the way the connector builds it, by looking the class up in ``mooncake.store``
after the plugin replaced it.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest

import mooncake.store
from audit.blocktables import read_block_tables
from audit.connection import AdminClient, open_store
from audit.keys import vllm_key
from audit.recorder.plugin import RecorderSettings, install, register
from audit.recorder.records import RecordWriter
from audit.recorder.wrapper import WITHHELD_RESULT, recording_store_class

ROOT = Path(__file__).resolve().parents[2]
ORIGINAL_STORE = mooncake.store.MooncakeDistributedStore


class KVProducer:
    """KV-cache memory laid out like vLLM's, publishing blocks the way the connector does."""

    def __init__(self, store, layers: int = 4, num_blocks: int = 8, block_len: int = 4096, kv_first: bool = False):
        rng = np.random.default_rng(layers * 1000 + num_blocks)
        halves = 2 if kv_first else 1
        self.store = store
        self.buffers = [rng.integers(0, 256, (halves, num_blocks, block_len // halves), dtype=np.uint8)
                        for _ in range(layers)]
        for buffer in self.buffers:
            buffer[:, 0] = 0  # the null block, all zero as vLLM allocates it
            assert store.register_buffer(buffer.ctypes.data, buffer.nbytes) == 0
        self.segment_len = block_len // halves
        self.segment_bases = [buffer.ctypes.data + half * buffer[0].nbytes
                              for buffer in self.buffers for half in range(halves)]

    def addresses(self, block_id: int) -> list[int]:
        return [base + block_id * self.segment_len for base in self.segment_bases]

    def value(self, block_id: int) -> bytes:
        return b"".join(buffer[half, block_id].tobytes() for buffer in self.buffers for half in range(len(buffer)))

    def publish(self, keys: list[str], block_ids: list[int]) -> list[int]:
        addrs = [self.addresses(block_id) for block_id in block_ids]
        sizes = [[self.segment_len] * len(self.segment_bases) for _ in keys]
        return self.store.batch_put_from_multi_buffers(keys, addrs, sizes, mooncake.store.ReplicateConfig())


class SpyStore:
    """Stands in for MooncakeDistributedStore where only what reaches the put matters."""

    def __init__(self):
        self.calls: list[tuple] = []
        self.result: list[int] | None = None
        self.error: Exception | None = None

    def register_buffer(self, buffer_ptr, size):
        return 0

    def unregister_buffer(self, buffer_ptr):
        return 0

    def batch_put_from_multi_buffers(self, keys, all_buffer_ptrs, all_sizes, config=None):
        self.calls.append((keys, all_buffer_ptrs, all_sizes, config))
        if self.error is not None:
            raise self.error
        return self.result if self.result is not None else [0] * len(keys)


def chunk_keys(namespace: str, count: int) -> list[str]:
    """vLLM keys of `count` chunks, TP rank 1, in this test's namespace."""
    return [vllm_key("mamba-130m-hf", f"{namespace.encode().hex()}{i:08x}", tp_rank=1, cache_prefix=namespace)
            for i in range(count)]


def read_records(directory: Path) -> dict[str, dict]:
    records = {}
    for path in sorted(directory.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            records[record["key"]] = record
    return records


@pytest.fixture
def record_dir(tmp_path) -> Path:
    return tmp_path / "records"


@pytest.fixture
def open_recording_store(settings, record_dir, monkeypatch):
    """A store opened the connector's way after the plugin installed the recorder (guard on or off)."""
    monkeypatch.setattr(mooncake.store, "MooncakeDistributedStore", ORIGINAL_STORE)  # restored afterwards
    stores = []

    def opener(guard: bool):
        install(RecorderSettings(record_dir, guard=guard, max_bytes=64 << 20, keep_files=0))
        stores.append(open_store(settings))
        return stores[-1]

    yield opener
    for store in stores:
        store.close()


@pytest.mark.parametrize("kv_first", [False, True], ids=["blocks-first", "kv-first"])
def test_records_name_the_exact_block_of_every_segment(open_recording_store, record_dir, namespace, kv_first):
    store = open_recording_store(guard=False)
    assert type(store).__name__ == "RecordingMooncakeDistributedStore"
    producer = KVProducer(store, layers=3, num_blocks=8, kv_first=kv_first)
    block_ids = [0, 3, 0, 5, 7, 1]
    keys = chunk_keys(namespace, len(block_ids))

    assert producer.publish(keys, block_ids) == [0] * len(keys)

    segments = 6 if kv_first else 3
    records = read_records(record_dir)
    assert set(records) == set(keys)
    for key, block_id in zip(keys, block_ids):
        record = records[key]
        assert record["block_ids"] == [block_id] * segments
        assert (record["segments"], record["rc"], record["pid"], record["tp_rank"]) == (segments, 0, os.getpid(), 1)
        assert "withheld" not in record and "note" not in record
    tables = read_block_tables([record_dir])
    assert {key for key, entry in tables.entries.items() if entry.null_backed} == {keys[0], keys[2]}
    assert tables.entries[keys[3]].block_ids == (5,) * segments
    # Without the guard everything is published as before, the null-block keys included (the bug).
    for key, block_id in zip(keys, block_ids):
        assert store.get(key) == producer.value(block_id)


def test_guard_withholds_exactly_the_null_backed_keys(open_recording_store, settings, record_dir, namespace):
    store = open_recording_store(guard=True)
    producer = KVProducer(store, layers=4, num_blocks=6)
    block_ids = [2, 0, 4, 0, 0, 5]
    keys = chunk_keys(namespace, len(block_ids))
    null_backed = {key for key, block_id in zip(keys, block_ids) if block_id == 0}

    results = producer.publish(keys, block_ids)

    assert results == [WITHHELD_RESULT if key in null_backed else 0 for key in keys]
    assert store.batch_is_exist(keys) == [0 if key in null_backed else 1 for key in keys]
    listed = set(AdminClient(settings.admin).all_keys_body().decode().splitlines())
    assert listed & set(keys) == set(keys) - null_backed
    for key, block_id in zip(keys, block_ids):
        if key not in null_backed:
            assert store.get(key) == producer.value(block_id)
    records = read_records(record_dir)
    for key in keys:
        withheld = {"withheld": True, "reason": "NULL_BLOCK_ID", "rc": WITHHELD_RESULT}
        assert ({name: records[key].get(name) for name in withheld} == withheld) == (key in null_backed)
    tables = read_block_tables([record_dir])  # withheld puts stored nothing: never a key's source
    assert not any(entry.null_backed for entry in tables.entries.values())
    assert set(tables.entries) == set(keys) - null_backed and tables.failed_puts == len(null_backed)


def test_guard_drops_the_group_ids_of_withheld_keys(open_recording_store, settings, record_dir, namespace):
    """vLLM's enable_group_semantics: one group id per key in the ReplicateConfig, which Mooncake
    checks against the key count; a batch with a withheld key must still store the good ones."""
    store = open_recording_store(guard=True)
    producer = KVProducer(store, layers=2, num_blocks=6)
    block_ids = [3, 0, 4]
    keys = chunk_keys(namespace, len(block_ids))
    config = mooncake.store.ReplicateConfig()
    config.group_ids = [f"group-{i}" for i in range(len(keys))]
    addrs = [producer.addresses(block_id) for block_id in block_ids]
    sizes = [[producer.segment_len] * len(a) for a in addrs]

    results = store.batch_put_from_multi_buffers(keys, addrs, sizes, config)

    assert results == [0, WITHHELD_RESULT, 0]
    assert store.batch_is_exist(keys) == [1, 0, 1]
    assert config.group_ids == ["group-0", "group-1", "group-2"]  # the caller's config is left as it was


def test_guard_with_every_key_withheld_never_calls_the_put(tmp_path):
    store = recording_store_class(SpyStore, RecordWriter(tmp_path), guard=True)()
    store.register_buffer(1 << 20, 1 << 16)

    assert store.batch_put_from_multi_buffers(["a", "b"], [[1 << 20]] * 2, [[4096]] * 2) == [WITHHELD_RESULT] * 2
    assert store.calls == []


def test_batch_put_from_is_recorded_and_guarded_like_the_multi_buffer_put(open_recording_store, record_dir,
                                                                         namespace):
    store = open_recording_store(guard=True)
    producer = KVProducer(store, layers=1, num_blocks=5, block_len=8192)
    keys = chunk_keys(namespace, 3)
    block_ids = [4, 0, 1]
    ptrs = [producer.addresses(block_id)[0] for block_id in block_ids]

    assert store.batch_put_from(keys, ptrs, [8192] * 3) == [0, WITHHELD_RESULT, 0]

    records = read_records(record_dir)
    assert [records[key]["block_ids"] for key in keys] == [[4], [0], [1]]
    assert [records[key].get("withheld", False) for key in keys] == [False, True, False]
    assert store.batch_is_exist(keys) == [1, 0, 1]
    assert store.get(keys[0]) == producer.value(4)


def test_underivable_blocks_keep_their_offsets_and_say_why(open_recording_store, record_dir, namespace):
    store = open_recording_store(guard=False)
    producer = KVProducer(store, layers=2, num_blocks=8, block_len=4096, kv_first=True)
    unregistered = np.ones(4096, np.uint8)
    keys = chunk_keys(namespace, 3)
    k_then_v = producer.addresses(3)
    addrs = [
        [k_then_v[0] + 8, *k_then_v[1:]],  # not at a block boundary
        [unregistered.ctypes.data, *k_then_v[1:]],  # outside every registered buffer
        [k_then_v[0], k_then_v[1] + 2 * 2048, *k_then_v[2:]],  # K of block 3 with V of block 5
    ]
    sizes = [[2048] * 4] * 3

    assert store.batch_put_from_multi_buffers(keys, addrs, sizes) == [0, 0, 0]

    records = read_records(record_dir)
    notes = [records[key]["note"] for key in keys]
    assert [records[key]["block_ids"] for key in keys] == [None] * 3
    assert "not a multiple of its size" in notes[0]
    assert "outside every registered buffer" in notes[1]
    assert "disagree on the block id" in notes[2]
    base = producer.buffers[0].ctypes.data
    assert records[keys[0]]["offsets"][0] == 3 * 2048 + 8
    assert records[keys[1]]["offsets"][0] is None
    assert records[keys[2]]["offsets"][:2] == [3 * 2048, k_then_v[1] + 2 * 2048 - base]
    assert records[keys[0]]["sizes"] == [2048] * 4


def test_keys_placed_differently_in_one_put_are_each_exact(tmp_path):
    store = recording_store_class(SpyStore, RecordWriter(tmp_path))()
    first, second = 1 << 20, 2 << 20
    keys = ["first-region", "second-region", "both", "fewer-segments"]
    addrs = [[first + 3 * 512], [second + 5 * 512], [first + 512, second + 512], [second]]
    sizes = [[512], [512], [512, 512], [512]]

    store.batch_put_from_multi_buffers(keys[:1], addrs[:1], sizes[:1])
    assert read_records(tmp_path)["first-region"]["note"] == "no buffer registered"
    store.register_buffer(first, 8 * 512)
    store.register_buffer(second, 8 * 512)
    store.batch_put_from_multi_buffers(keys[:2], addrs[:2], sizes[:2])
    store.batch_put_from_multi_buffers(keys, addrs, sizes)

    records = read_records(tmp_path)
    assert [records[key]["block_ids"] for key in keys] == [[3], [5], [1, 1], [0]]


def test_other_calls_pass_through(open_recording_store, record_dir, namespace):
    store = open_recording_store(guard=True)
    recording_class = type(store)
    overridden = {"setup", "register_buffer", "unregister_buffer", "batch_put_from_multi_buffers", "batch_put_from",
                  "batch_get_into_multi_buffers", "batch_get_into", "batch_is_exist"}
    assert isinstance(store, ORIGINAL_STORE)
    assert store.audit_tenant == "default"  # setup passed through, no tenant asked for
    for name in dir(ORIGINAL_STORE):
        if not name.startswith("_") and name not in overridden:
            assert getattr(recording_class, name) is getattr(ORIGINAL_STORE, name), name
    key, value = namespace + "plain", bytes(range(256)) * 64

    assert store.put(key, value) == 0
    assert store.is_exist(key) == 1 and store.batch_is_exist([key, key + "-absent"]) == [1, 0]
    assert store.get_size(key) == len(value) and store.get(key) == value
    target = np.zeros(len(value), np.uint8)
    assert store.register_buffer(target.ctypes.data, target.nbytes) == 0
    assert store.batch_get_into_multi_buffers([key], [[target.ctypes.data]], [[len(value)]]) == [len(value)]
    assert target.tobytes() == value
    assert store.unregister_buffer(target.ctypes.data) == 0
    assert store.remove(key, force=True) == 0 and store.is_exist(key) == 0  # force: the reads hold a lease
    # only the zero-copy puts and gets are recorded: here one load, served to no request
    (loads,) = record_dir.glob("loads-*.jsonl")
    (line,) = [json.loads(text) for text in loads.read_text().splitlines()]
    assert {k: line[k] for k in ("key", "bytes", "rc", "request_id", "vllm_request_id")} == {
        "key": key, "bytes": len(value), "rc": len(value), "request_id": None, "vllm_request_id": None}
    assert sorted(p.name.split("-")[0] for p in record_dir.iterdir()) == ["loads"]


def test_put_arguments_and_result_pass_through_unchanged(tmp_path):
    store = recording_store_class(SpyStore, RecordWriter(tmp_path), guard=True)()
    store.register_buffer(1 << 20, 1 << 16)
    keys, addrs, sizes, config = ["a", "b"], [[(1 << 20) + 4096]] * 2, [[4096]] * 2, object()
    store.result = [0, -704]

    assert store.batch_put_from_multi_buffers(keys, addrs, sizes, config) is store.result

    (call,) = store.calls
    assert all(passed is given for passed, given in zip(call, (keys, addrs, sizes, config)))
    assert [record["rc"] for record in read_records(tmp_path).values()] == [0, -704]


def test_records_are_json_whatever_the_key(tmp_path):
    store = recording_store_class(SpyStore, RecordWriter(tmp_path))()
    store.register_buffer(1 << 20, 1 << 16)
    keys = ['quote"back\\slash', "line\nbreak", "клю@tp_rank:007@ч", "\x1b[31m"]

    store.batch_put_from_multi_buffers(keys, [[(1 << 20) + 8192]] * 4, [[4096]] * 4)

    records = read_records(tmp_path)
    assert list(records) == keys and all(record["block_ids"] == [2] for record in records.values())
    assert records[keys[2]]["tp_rank"] == 7 and "tp_rank" not in records[keys[0]]


def test_a_failing_put_is_recorded_and_still_raises(tmp_path):
    store = recording_store_class(SpyStore, RecordWriter(tmp_path))()
    store.register_buffer(1 << 20, 1 << 16)
    store.error = RuntimeError("transfer engine down")

    with pytest.raises(RuntimeError, match="transfer engine down"):
        store.batch_put_from_multi_buffers(["a"], [[1 << 20]], [[4096]])

    (record,) = read_records(tmp_path).values()
    assert record["rc"] is None and record["error"] == "RuntimeError: transfer engine down"
    assert record["block_ids"] == [0]


def test_unwritable_records_never_fail_the_put(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    writer = RecordWriter(blocker / "records")
    store = recording_store_class(SpyStore, writer)()

    assert store.batch_put_from_multi_buffers(["a", "b"], [[64]] * 2, [[8]] * 2) == [0, 0]
    assert writer.lost_records == 2


def test_records_rotate_by_size(tmp_path):
    writer = RecordWriter(tmp_path, max_bytes=2000)
    for batch in range(200):
        writer.write([json.dumps({"key": f"k{batch}-{i}", "block_ids": [batch, i], "rc": 0}) for i in range(3)])
    writer.close()

    files = sorted(tmp_path.glob("*.jsonl"))
    assert len(files) > 5 and files == writer.paths
    assert all(0 < path.stat().st_size <= 2000 for path in files)
    assert all(path.name.startswith("blocks-") and f"-{os.getpid()}-" in path.name for path in files)
    tables = read_block_tables([tmp_path])
    assert tables.records == 600 and len(tables.entries) == 600

    kept = RecordWriter(tmp_path / "kept", max_bytes=2000, keep_files=2)
    for batch in range(60):
        kept.write([json.dumps({"key": f"k{batch}-{i}", "block_ids": [batch, i], "rc": 0}) for i in range(3)])
    assert sorted((tmp_path / "kept").glob("*.jsonl")) == kept.paths and len(kept.paths) == 2
    assert "k59-2" in kept.paths[-1].read_text()


def test_a_forked_child_writes_its_own_file(tmp_path):
    writer = RecordWriter(tmp_path)
    writer.write(['{"key": "parent-before", "block_ids": [1]}'])
    child = os.fork()
    if child == 0:
        writer.write(['{"key": "child", "block_ids": [2]}'])
        os._exit(0)
    os.waitpid(child, 0)
    writer.write(['{"key": "parent-after", "block_ids": [3]}'])

    by_file = {path.name: path.read_text() for path in tmp_path.glob("*.jsonl")}
    assert len(by_file) == 2
    (child_file,) = [name for name in by_file if f"-{child}-" in name]
    assert '"child"' in by_file[child_file] and "parent" not in by_file[child_file]


def test_plugin_without_the_environment_does_nothing_and_imports_nothing():
    env = {name: value for name, value in os.environ.items() if not name.startswith("MOONCAKE_AUDIT_")}
    probe = ("import sys; from audit.recorder.plugin import register; register(); "
             "print(sorted(m for m in sys.modules if m.startswith(('mooncake', 'audit.recorder.', 'numpy'))))")
    result = subprocess.run([sys.executable, "-c", probe], env=env, cwd=ROOT, capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip() == "['audit.recorder.plugin']"


def test_plugin_installs_the_recorder_once(monkeypatch, tmp_path):
    monkeypatch.setattr(mooncake.store, "MooncakeDistributedStore", ORIGINAL_STORE)
    monkeypatch.setenv("MOONCAKE_AUDIT_RECORD", str(tmp_path))
    monkeypatch.setenv("MOONCAKE_AUDIT_GUARD", "1")

    register()
    installed = mooncake.store.MooncakeDistributedStore
    register()

    assert mooncake.store.MooncakeDistributedStore is installed
    assert issubclass(installed, ORIGINAL_STORE) and installed is not ORIGINAL_STORE
    assert installed.audit_guard and installed.audit_writer.directory == tmp_path


def test_settings_from_the_environment(tmp_path):
    assert RecorderSettings.from_env({}) is None
    assert RecorderSettings.from_env({"MOONCAKE_AUDIT_GUARD": "0", "MOONCAKE_AUDIT_RECORD": ""}) is None
    recording = RecorderSettings.from_env({"MOONCAKE_AUDIT_RECORD": str(tmp_path), "MOONCAKE_AUDIT_RECORD_MAX_MB": "8",
                                           "MOONCAKE_AUDIT_RECORD_KEEP": "3"})
    assert recording == RecorderSettings(tmp_path, guard=False, max_bytes=8 << 20, keep_files=3)
    guard_only = RecorderSettings.from_env({"MOONCAKE_AUDIT_GUARD": "1", "XDG_STATE_HOME": str(tmp_path)})
    assert guard_only.guard and guard_only.directory == tmp_path / "mooncake-audit" / "records"
    for bad in ({"MOONCAKE_AUDIT_GUARD": "maybe"}, {"MOONCAKE_AUDIT_GUARD": "1", "MOONCAKE_AUDIT_RECORD_MAX_MB": "0"},
                {"MOONCAKE_AUDIT_RECORD": "x", "MOONCAKE_AUDIT_RECORD_KEEP": "-1"}):
        with pytest.raises(ValueError):
            RecorderSettings.from_env(bad)


def test_the_vllm_entry_point_is_declared():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    entry = project["project"]["entry-points"]["vllm.general_plugins"]["mooncake_audit"]
    module, _, function = entry.partition(":")
    assert getattr(importlib.import_module(module), function) is register


def test_vllm_loads_the_plugin(monkeypatch, tmp_path):
    vllm_plugins = pytest.importorskip("vllm.plugins")
    monkeypatch.setattr(mooncake.store, "MooncakeDistributedStore", ORIGINAL_STORE)
    monkeypatch.setattr(vllm_plugins, "plugins_loaded", False)
    monkeypatch.setenv("MOONCAKE_AUDIT_RECORD", str(tmp_path))
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)

    vllm_plugins.load_general_plugins()

    assert mooncake.store.MooncakeDistributedStore.audit_writer.directory == tmp_path


def test_a_scan_with_the_recorded_tables_flags_exactly_the_null_backed_keys(open_recording_store, record_dir,
                                                                            namespace, cli_args):
    from tests.helpers import by_key, scan_json

    store = open_recording_store(guard=False)
    producer = KVProducer(store, layers=3, num_blocks=6, block_len=4096)
    keys = chunk_keys(namespace, 6)
    block_ids = [3, 0, 5, 0, 1, 2]  # the buggy save path: two chunks resolved to NULL_BLOCK_ID
    assert producer.publish(keys, block_ids) == [0] * 6
    _, report = scan_json(cli_args, "--prefix", namespace, "--block-tables", str(record_dir), "--all")
    records = by_key(report)
    assert {key for key in keys if "NULL_BACKED" in records[key]["verdicts"]} == {keys[1], keys[3]}
    assert records[keys[1]]["evidence"]["block_table"]["block_ids"] == [0, 0, 0]
    assert records[keys[0]]["verdicts"] == [] and records[keys[0]]["evidence"]["block_table"]["block_ids"] == [3, 3, 3]
    assert report["summary"]["block_tables"]["null_backed_keys"] == 2
