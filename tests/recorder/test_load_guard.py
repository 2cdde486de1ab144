"""The consumer side of the recorder against a real cluster: load records, the load guard, its deny
list, and the hook on the connector's receiving thread.

A producer (`KVProducer`, as in test_recorder.py) publishes real blocks, some from the null block;
a consumer registers its own KV memory and loads them the connector's way
(``batch_get_into_multi_buffers`` into its blocks). vLLM's receiving thread is stood in for by a
class carrying vLLM 0.32.0's names and semantics (``_handle_request``, ``_report_load_error``: a
request failed whole only with more than one group), since the e2e suite runs the real one.
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import numpy as np
import pytest

import mooncake.store
from audit.checks.loaded import LoadedRegion, combine, refusal
from audit.connection import open_store
from audit.keys import vllm_key
from audit.recorder import loads as loads_module
from audit.recorder.deny import DenyList
from audit.recorder.guard import LoadGuard, group_regions
from audit.recorder.plugin import RecorderSettings, install
from audit.recorder.records import RecordWriter
from audit.recorder.wrapper import REFUSED_RESULT
from tests.helpers import gpu_host, interpreted
from tests.recorder.test_recorder import ORIGINAL_STORE, KVProducer

SEGMENT = 4096
KERNEL_DEVICES = [  # where the guard's kernel path runs: CPU tensors under the interpreter, or a GPU
    pytest.param("cpu", marks=pytest.mark.skipif(not interpreted(), reason="CPU tensors through the kernel: the interpreter")),
    pytest.param("cuda", marks=pytest.mark.skipif(not gpu_host() or interpreted(), reason="pins a GPU host"))]


def keys_of(namespace: str, names: list[str], group: int = 0) -> list[str]:
    return [vllm_key("mamba2-tiny", f"{namespace.encode().hex()}{name}", tp_rank=0, group=group,
                     cache_prefix=namespace) for name in names]


class KVConsumer:
    """A consumer's KV memory: one registered buffer per layer; loads land in block `block_id`."""

    def __init__(self, store, layers: int = 4, num_blocks: int = 8):
        self.store = store
        self.buffers = [np.zeros((num_blocks, SEGMENT), np.uint8) for _ in range(layers)]
        for buffer in self.buffers:
            assert store.register_buffer(buffer.ctypes.data, buffer.nbytes) == 0

    def load(self, keys: list[str], block_ids: list[int]) -> list[int]:
        addrs = [[buffer[block].ctypes.data for buffer in self.buffers] for block in block_ids]
        sizes = [[SEGMENT] * len(self.buffers) for _ in keys]
        return self.store.batch_get_into_multi_buffers(keys, addrs, sizes)

    def value(self, block_id: int) -> bytes:
        return b"".join(buffer[block_id].tobytes() for buffer in self.buffers)


def load_records(directory: Path) -> list[dict]:
    return [json.loads(line) for path in sorted(directory.glob("loads-*.jsonl")) for line in path.read_text().splitlines()]


@pytest.fixture
def stores(settings, tmp_path, monkeypatch):
    """Open stores the connector's way after the plugin installed the recorder with the given settings."""
    monkeypatch.setattr(mooncake.store, "MooncakeDistributedStore", ORIGINAL_STORE)
    opened = []

    def opener(directory: Path, **options):
        monkeypatch.setattr(mooncake.store, "MooncakeDistributedStore", ORIGINAL_STORE)
        install(RecorderSettings(directory, guard=False, max_bytes=64 << 20, keep_files=0, **options))
        opened.append(open_store(settings))
        return opened[-1]

    yield opener
    for store in opened:
        store.close()


@pytest.fixture
def published(settings, namespace):
    """Six keys of a producer: blocks 1-4 real, two from the null block (all zero)."""
    producer_store = open_store(settings)
    producer = KVProducer(producer_store, layers=4, num_blocks=8, block_len=SEGMENT)
    keys = keys_of(namespace, ["a1", "a2", "a3", "a4", "z1", "z2"])
    assert producer.publish(keys, [1, 2, 3, 4, 0, 0]) == [0] * 6
    yield keys, producer
    producer_store.close()


def test_unguarded_loads_are_recorded_and_pass_through(stores, published, tmp_path):
    keys, producer = published
    store = stores(tmp_path / "rec")
    consumer = KVConsumer(store)

    assert consumer.load(keys, [1, 2, 3, 4, 5, 6]) == [4 * SEGMENT] * 6  # the zero keys too: nothing refuses
    assert consumer.value(5) == bytes(4 * SEGMENT) and consumer.value(1) == producer.value(1)
    records = load_records(tmp_path / "rec")
    assert [r["key"] for r in records] == keys
    assert {(r["bytes"], r["rc"], r.get("refused")) for r in records} == {(4 * SEGMENT, 4 * SEGMENT, None)}


def test_the_guard_refuses_exactly_the_zero_values_and_denies_them_for_good(stores, published, tmp_path):
    keys, producer = published
    store = stores(tmp_path / "rec", load_guard=True)
    consumer = KVConsumer(store)

    results = consumer.load(keys, [1, 2, 3, 4, 5, 6])

    assert results == [4 * SEGMENT] * 4 + [REFUSED_RESULT] * 2
    assert [consumer.value(b) for b in (1, 2, 3, 4)] == [producer.value(b) for b in (1, 2, 3, 4)]
    refused = {r["key"]: r["reason"] for r in load_records(tmp_path / "rec") if r.get("refused")}
    assert refused == {keys[4]: "ZERO_VALUE", keys[5]: "ZERO_VALUE"}  # no layout known: the whole value
    assert store.audit_load_guard.refusals == 2
    # looked up again (the rescheduled request), a refused key is absent; a good one is kept
    assert store.batch_is_exist(keys) == [1, 1, 1, 1, 0, 0]
    # and loaded again it is refused without a read
    assert consumer.load(keys[4:], [7, 7]) == [REFUSED_RESULT] * 2
    assert [r["reason"] for r in load_records(tmp_path / "rec")[-2:]] == ["DENIED", "DENIED"]


def test_the_deny_list_is_shared_by_every_process_writing_into_the_directory(stores, published, tmp_path):
    keys, _ = published
    loading_rank = stores(tmp_path / "rec", load_guard=True)  # TP rank 1 loads ...
    KVConsumer(loading_rank).load(keys, [1, 2, 3, 4, 5, 6])
    # ... and rank 0, another process, answers the scheduler's lookup: its guard reads rank 1's refusals
    other = DenyList(tmp_path / "rec", RecordWriter(tmp_path / "elsewhere", stem="denied"))
    other.refresh()
    assert [other.reason(k) for k in keys] == [None] * 4 + ["DENIED"] * 2


def test_keys_the_put_records_call_null_backed_are_refused_without_a_read(stores, settings, namespace, tmp_path):
    # a producer whose null block is not zero: no byte check can tell, its put records can
    producer_store = stores(tmp_path / "producer")  # records its puts
    producer = KVProducer(producer_store, layers=2, num_blocks=4, block_len=SEGMENT)
    for buffer in producer.buffers:
        buffer[0, 0] = 7
    keys = keys_of(namespace, ["good", "null"])
    assert producer.publish(keys, [1, 0]) == [0, 0]

    consumer_store = stores(tmp_path / "consumer", load_guard=True, put_records=(tmp_path / "producer",))
    consumer = KVConsumer(consumer_store, layers=2)

    assert consumer.load(keys, [1, 2]) == [2 * SEGMENT, REFUSED_RESULT]
    assert consumer.value(2) == bytes(2 * SEGMENT)  # never read into the consumer's block
    assert [r.get("reason") for r in load_records(tmp_path / "consumer")] == [None, "NULL_BACKED"]


def test_a_layout_refuses_a_zero_state_and_nan_but_not_zero_padding(stores, settings, namespace, tmp_path):
    """The consumer's manifest says where the states are: conv (float32) then ssm (float32), then padding."""
    store_ = open_store(settings)
    producer = KVProducer(store_, layers=2, num_blocks=4, block_len=SEGMENT)
    states = [(0, 1024), (1024, 2048)]
    for buffer in producer.buffers:
        values = np.random.default_rng(1).normal(size=(4, 3072 // 4)).astype(np.float32)
        buffer[0, :, :3072] = values.view(np.uint8).reshape(4, 3072)
        buffer[0, :, 3072:] = 0  # the page's padding
    producer.buffers[1][0, 2, 1024:3072] = 0                                   # block 2: layer 1's ssm zero
    producer.buffers[0][0, 3, 8:12] = np.array([np.nan], np.float32).view(np.uint8)  # block 3: a NaN
    keys = keys_of(namespace, ["ok", "ssm0", "nan"], group=1)
    assert producer.publish(keys, [1, 2, 3]) == [0] * 3
    store_.close()
    store = stores(tmp_path / "rec", load_guard=True)
    document = {"groups": [{"group": 1, "states": [{"name": n, "offset": o, "length": n_, "dtype": "float32",
                                                     "shape": [n_ // 256, 64]}
                                                    for n, (o, n_) in zip(("conv", "ssm"), states)],
                            "segments": [{"index": i, "block_len": SEGMENT, "layer": f"layers.{i}", "offset_in_page": 0}
                                         for i in range(2)]}]}
    store.audit_describe(document, {})
    consumer = KVConsumer(store, layers=2)

    assert consumer.load(keys, [1, 2, 3])[0] == 2 * SEGMENT
    assert {r["key"]: r.get("reason") for r in load_records(tmp_path / "rec")} == {
        keys[0]: None, keys[1]: "ZERO_STATE", keys[2]: "NONFINITE"}


def test_group_regions_from_a_manifest():
    document = {"groups": [
        {"group": 0, "kind": "attention", "attention": {"dtype": "bfloat16"},
         "segments": [{"block_len": 512, "layer": "l.0"}, {"block_len": 512, "layer": "l.0"}]},
        {"group": 1, "kind": "mamba2", "states": [{"offset": 0, "length": 96, "dtype": "bfloat16"},
                                                  {"offset": 96, "length": 256, "dtype": "float32"}],
         "segments": [{"block_len": 512, "layer": "l.1", "offset_in_page": 0}, {"block_len": 512, "layer": None}]},
        {"group": 2, "segments": None}]}
    regions = group_regions(document)
    assert regions[0] == [[LoadedRegion(0, 512, "bfloat16", False)]] * 2
    assert regions[1] == [[LoadedRegion(0, 96, "bfloat16", True), LoadedRegion(96, 256, "float32", True),
                           LoadedRegion(352, 160, None, False)], [LoadedRegion(0, 512, None, False)]]
    assert 2 not in regions


def test_the_device_answer_equals_the_host_answer():
    """`combine` over per-region flags (what the Triton kernel gives on a GPU) equals `refusal`."""
    rng = np.random.default_rng(3)
    cases = []
    for kind in ("live", "zero-state", "zero-value", "nan", "zero-padding-only"):
        page = rng.normal(size=128).astype(np.float32).view(np.uint8).copy()
        page[384:] = 0
        if kind == "zero-state":
            page[128:384] = 0
        if kind == "zero-value":
            page[:] = 0
        if kind == "nan":
            page[200:204] = np.array([np.inf], np.float32).view(np.uint8)
        cases.append((kind, page))
    regions = [LoadedRegion(0, 128, "float32", True), LoadedRegion(128, 256, "float32", True),
               LoadedRegion(384, 128, None, False)]
    host = [refusal([page], [regions]) for _, page in cases]
    assert host == [None, "ZERO_STATE", "ZERO_VALUE", "NONFINITE", None]
    zero, nonfinite, states, value_of = [], [], [], []
    for value, (_, page) in enumerate(cases):
        for offset, length, dtype, state in regions:
            data = page[offset:offset + length]
            zero.append(not data.any())
            nonfinite.append(dtype == "float32" and not np.isfinite(data.view(np.float32)).all())
            states.append(state)
            value_of.append(value)
    assert combine(zero, nonfinite, states, value_of, len(cases)) == host
    order = np.random.default_rng(4).permutation(len(zero))  # regions in any order: counted per value
    assert combine(*(np.asarray(column)[order] for column in (zero, nonfinite, states, value_of)), len(cases)) == host


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_the_triton_kernel_flags_equal_the_host_checks(device):
    torch = pytest.importorskip("torch")
    pytest.importorskip("triton")
    from audit.checks.loaded import device_region_flags

    data = np.random.default_rng(5).normal(size=1024).astype(np.float32).view(np.uint8).copy()
    data[1024:2048] = 0
    data[2048 + 16:2048 + 20] = np.array([np.nan], np.float32).view(np.uint8)
    buffer = torch.from_numpy(data).to(device)
    zero, nonfinite = device_region_flags([buffer], [0] * 3, [0, 1024, 2048], [1024, 1024, 1024],
                                          ["float32", "float32", None])
    assert (zero.tolist(), nonfinite.tolist()) == ([False, True, False], [False, False, False])  # no dtype, no NaN test
    assert [a.tolist() for a in device_region_flags([buffer], [0], [2048], [1024], ["float32"])] == [[False], [True]]


# ---- the receiving thread ------------------------------------------------------------------------


class ReceivingThread:
    """vLLM 0.32.0's KVCacheStoreRecvingThread, as far as the guard depends on it: `_handle_request`
    loads a request's keys and reports negative results through `_report_load_error`, which fails
    the request only with several KV-cache groups (`_is_hma_required`)."""

    def __init__(self, consumer: KVConsumer, groups: int):
        self.consumer = consumer
        self._is_hma_required = groups > 1
        self.failed_requests: set[str] = set()
        self.invalid_block_ids: set[int] = set()

    def set_failed_request(self, req_id):
        self.failed_requests.add(req_id)

    def _report_load_error(self, req_id, block_ids):
        if self._is_hma_required:
            self.set_failed_request(req_id)
        else:
            self.invalid_block_ids.update(block_ids)

    def _handle_request(self, req_meta):
        results = self.consumer.load(req_meta.keys, req_meta.block_ids)
        failed = [b for b, rc in zip(req_meta.block_ids, results) if rc < 0]
        if failed:
            self._report_load_error(req_meta.req_id, failed)


@pytest.fixture
def vllm_worker_module(monkeypatch):
    module = types.ModuleType(loads_module.WORKER_MODULE)
    module.KVCacheStoreRecvingThread = type("KVCacheStoreRecvingThread", (ReceivingThread,), {})
    monkeypatch.setitem(sys.modules, loads_module.WORKER_MODULE, module)
    return module


@pytest.mark.parametrize("groups", [1, 2], ids=["one-group", "hybrid"])
def test_a_refused_load_fails_its_request_whole_and_names_it(stores, published, tmp_path, vllm_worker_module, groups):
    keys, _ = published
    store = stores(tmp_path / "rec", load_guard=True)
    thread = vllm_worker_module.KVCacheStoreRecvingThread(KVConsumer(store), groups)
    request = types.SimpleNamespace

    thread._handle_request(request(req_id="7-b9212f4a", keys=keys[:2], block_ids=[1, 2]))
    thread._handle_request(request(req_id="8-0c0ffee1", keys=[keys[2], keys[4]], block_ids=[3, 4]))

    assert thread.failed_requests == {"8-0c0ffee1"} and thread.invalid_block_ids == set()
    served = {(r["key"], r["request_id"], r["vllm_request_id"], r.get("reason")) for r in load_records(tmp_path / "rec")}
    assert served == {(keys[0], "7", "7-b9212f4a", None), (keys[1], "7", "7-b9212f4a", None),
                      (keys[2], "8", "8-0c0ffee1", None), (keys[4], "8", "8-0c0ffee1", "ZERO_VALUE")}


def test_an_ordinary_load_failure_keeps_vllms_own_handling(stores, settings, namespace, tmp_path, vllm_worker_module):
    store = stores(tmp_path / "rec", load_guard=True)
    thread = vllm_worker_module.KVCacheStoreRecvingThread(KVConsumer(store), 1)
    absent = keys_of(namespace, ["never-put"])
    thread._handle_request(types.SimpleNamespace(req_id="9-00000000", keys=absent, block_ids=[5]))
    assert thread.failed_requests == set() and thread.invalid_block_ids == {5}  # vLLM's rule, untouched


def test_a_guard_asked_for_on_an_unknown_vllm_stops_the_engine(stores, tmp_path, monkeypatch):
    module = types.ModuleType(loads_module.WORKER_MODULE)
    module.KVCacheStoreRecvingThread = type("KVCacheStoreRecvingThread", (), {"_handle_request": lambda self, m: None})
    monkeypatch.setitem(sys.modules, loads_module.WORKER_MODULE, module)
    with pytest.raises(loads_module.HookError, match="load path is unknown"):
        stores(tmp_path / "rec", load_guard=True)
    stores(tmp_path / "rec2")  # recording alone does not need the hook


def test_load_guard_settings_from_the_environment(tmp_path):
    settings = RecorderSettings.from_env({"MOONCAKE_AUDIT_LOAD_GUARD": "1", "XDG_STATE_HOME": str(tmp_path),
                                          "MOONCAKE_AUDIT_LOAD_GUARD_RECORDS": f"{tmp_path}/a:{tmp_path}/b"})
    assert settings.load_guard and not settings.guard
    assert settings.put_records == (tmp_path / "a", tmp_path / "b")
    with pytest.raises(ValueError):
        RecorderSettings.from_env({"MOONCAKE_AUDIT_LOAD_GUARD": "sometimes"})


def test_api_request_ids():
    assert loads_module.api_request_id("10-b9212f4a") == "10"
    assert loads_module.api_request_id("cmpl-abc-0-1a2b3c4d") == "cmpl-abc-0"
    assert loads_module.api_request_id("plain") == "plain" and loads_module.api_request_id(None) is None


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_the_kernel_path_of_the_guard_judges_a_batch_as_the_host_path_does(tmp_path, device):
    """The GPU path (`LoadGuard._check_on_device`: byte views of the caches' storages, every region of
    a batch through the Triton kernel), on a GPU or by the interpreter on CPU tensors, refuses exactly
    what the host path refuses (reading the same pages, copied to the host where they are on a GPU)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("triton")
    rng = np.random.default_rng(11)
    layers = [torch.from_numpy(rng.normal(size=(4, 1024)).astype(np.float32)) for _ in range(2)]  # 4 pages of 4 KiB
    for layer in layers:
        layer[:, 768:] = 0                      # each page: conv 1 KiB, ssm 2 KiB, then 1 KiB of padding
    layers[1][2, 256:768] = 0                   # page 2: layer 1's ssm zero
    layers[0][3, 5] = float("inf")              # page 3: an Inf in layer 0's conv
    document = {"groups": [{"group": 0, "states": [{"offset": 0, "length": 1024, "dtype": "float32"},
                                                   {"offset": 1024, "length": 2048, "dtype": "float32"}],
                            "segments": [{"block_len": 4096, "layer": f"l.{i}", "offset_in_page": 0} for i in range(2)]}]}
    layers[0][1, :768] = 0                      # page 1, layer 0: conv and ssm zero, and so the whole page
    keys = [f"m@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@{i:04x}" for i in range(4)]
    # and keys of a group the manifest does not describe (each segment one state region): the same pages
    keys += [f"m@tp_rank:0@pcp0@dcp0@pp_rank:0@group:9@{i:04x}" for i in range(4)]
    sizes = [[4096, 4096]] * 8
    verdicts = {}
    for in_kernel, pages in ((True, [layer.to(device) for layer in layers]), (False, layers)):
        guard = LoadGuard(DenyList(tmp_path / str(in_kernel), RecordWriter(tmp_path / str(in_kernel), stem="denied")))
        guard.describe(document, {"l.0": pages[0], "l.1": pages[1]}, in_kernel=in_kernel if device == "cpu" else None)
        assert bool(guard.memory.storages) is in_kernel
        addrs = [[layer[page].data_ptr() for layer in pages] for page in range(4)] * 2
        verdicts[in_kernel] = guard.check(keys, addrs, sizes, [8192] * 8)
    assert verdicts[True] == verdicts[False] == {1: "ZERO_STATE", 2: "ZERO_STATE", 3: "NONFINITE", 5: "ZERO_STATE"}
