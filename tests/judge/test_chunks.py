"""Cross-key verdicts on a real cluster: each case planted in a clean producer's keys, and flagged
exactly (those keys and no others); the clean producer itself gives no finding."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from audit.judge.chunks import ChunkIndex
from audit.keys import vllm_key
from tests.helpers import by_key, run_cli, scan_json

CHUNKS = 48
BOUNDARY_EVERY = 4  # the state groups are published at a prompt's boundary chunk only, as vLLM 0.32.0 does
SIZES = {0: 4096, 1: 6144, 2: 6144}  # group 0 attention, groups 1 and 2 Mamba states


def hybrid_producer(namespace: str, seed: int = 0) -> dict[str, bytes]:
    """What a TP 2 hybrid producer publishes: every chunk's attention group on both ranks, and at
    boundary chunks its two state groups on both ranks. Every value distinct."""
    rng = np.random.default_rng(seed)
    values = {}
    for chunk in range(CHUNKS):
        chunk_hash = f"{seed:02x}{chunk:062x}"
        groups = (0, 1, 2) if chunk % BOUNDARY_EVERY == BOUNDARY_EVERY - 1 else (0,)
        for group in groups:
            for tp_rank in (0, 1):
                key = vllm_key("hybrid-tiny", chunk_hash, tp_rank=tp_rank, group=group, cache_prefix=namespace)
                values[key] = rng.integers(1, 255, SIZES[group], dtype=np.uint8).tobytes()
    return values


def key_of(namespace: str, chunk: int, group: int, tp_rank: int, seed: int = 0) -> str:
    return vllm_key("hybrid-tiny", f"{seed:02x}{chunk:062x}", tp_rank=tp_rank, group=group, cache_prefix=namespace)


def _publish_and_scan(publisher, cli_args, namespace, values):
    for key, value in values.items():
        publisher.put(key, value)
    return scan_json(cli_args, "--prefix", namespace)


def _flagged(document) -> dict[str, list[str]]:
    return {key: record["verdicts"] for key, record in by_key(document).items()}


def test_a_clean_producer_gives_no_finding(publisher, cli_args, namespace):
    code, document = _publish_and_scan(publisher, cli_args, namespace, hybrid_producer(namespace))
    assert code == 0 and document["findings"] == []
    chunks = document["summary"]["chunks"]
    assert (chunks["chunks"], chunks["complete"], chunks["incomplete"], chunks["members_missing"]) == (48, 48, 0, 0)
    sizes = {row["part"]: row["sizes"] for row in chunks["stores"]}
    assert sizes == {0: {"4096": 96}, 1: {"6144": 24}, 2: {"6144": 24}}


def test_a_dropped_tp_rank_flags_its_chunk(publisher, cli_args, namespace):
    values = hybrid_producer(namespace)
    del values[key_of(namespace, 5, 0, 1)]
    code, document = _publish_and_scan(publisher, cli_args, namespace, values)
    assert code == 0  # a warning: exit 1 only with --fail-on warning
    assert _flagged(document) == {key_of(namespace, 5, 0, 0): ["INCOMPLETE_CHUNK"]}
    assert by_key(document)[key_of(namespace, 5, 0, 0)]["severity"] == "warning"
    assert document["summary"]["severities"] == {"error": 0, "warning": 1}
    evidence = by_key(document)[key_of(namespace, 5, 0, 0)]["evidence"]["incomplete_chunk"]
    assert evidence == {"members_missing": 1, "missing": [{"group": 0, "tp_rank": 1, "pcp": 0, "dcp": 0, "pp_rank": 0}]}
    chunks = document["summary"]["chunks"]
    assert (chunks["complete"], chunks["incomplete"], chunks["members_missing"]) == (47, 1, 1)


def test_a_dropped_state_group_flags_its_chunk_and_absent_groups_elsewhere_do_not(publisher, cli_args, namespace):
    values = hybrid_producer(namespace)
    for tp_rank in (0, 1):
        del values[key_of(namespace, 7, 2, tp_rank)]
    code, document = _publish_and_scan(publisher, cli_args, namespace, values)
    flagged = {key_of(namespace, 7, group, tp_rank) for group in (0, 1) for tp_rank in (0, 1)}
    assert code == 0 and _flagged(document) == {key: ["INCOMPLETE_CHUNK"] for key in flagged}
    missing = by_key(document)[key_of(namespace, 7, 1, 0)]["evidence"]["incomplete_chunk"]["missing"]
    assert [(m["group"], m["tp_rank"]) for m in missing] == [(2, 0), (2, 1)]


def test_a_dropped_sidecar_flags_its_companion(publisher, cli_args, namespace):
    """SGLang publishes a page's K and V as two keys: one evicted alone leaves the other useless."""
    rng = np.random.default_rng(3)
    pages = [f"{page:016x}{'ab' * 8}" for page in range(12)]
    values = {f"{namespace}tiny_{page}_0_{part}": rng.integers(1, 255, 2048, dtype=np.uint8).tobytes()
              for page in pages for part in ("k", "v")}
    del values[f"{namespace}tiny_{pages[4]}_0_v"]
    code, document = _publish_and_scan(publisher, cli_args, namespace, values)
    assert code == 0 and _flagged(document) == {f"{namespace}tiny_{pages[4]}_0_k": ["INCOMPLETE_CHUNK"]}
    missing = by_key(document)[f"{namespace}tiny_{pages[4]}_0_k"]["evidence"]["incomplete_chunk"]["missing"]
    assert missing == [{"part": "v", "tp_rank": 0}]


def test_two_dtypes_under_one_name_are_identity_suspects(publisher, cli_args, namespace):
    """A float32 writer's state values (twice the bytes) among a bfloat16 writer's, same names."""
    values = hybrid_producer(namespace)
    rng = np.random.default_rng(5)
    other = {key_of(namespace, 3, group, tp_rank): rng.integers(1, 255, 2 * SIZES[group], dtype=np.uint8).tobytes()
             for group in (1, 2) for tp_rank in (0, 1)}
    values.update(other)
    code, document = _publish_and_scan(publisher, cli_args, namespace, values)
    assert code == 0 and _flagged(document) == {key: ["IDENTITY_SUSPECT"] for key in other}  # size outliers: warnings
    outlier = by_key(document)[key_of(namespace, 3, 1, 0)]["evidence"]["identity"]["size_outlier"]
    assert outlier == {"size": 12288, "dominant_size": 6144, "keys_with_dominant_size": 11, "keys": 12}


def test_a_shard_stored_under_another_rank_is_an_identity_suspect(publisher, cli_args, namespace):
    values = hybrid_producer(namespace)
    values[key_of(namespace, 9, 0, 1)] = values[key_of(namespace, 9, 0, 0)]  # tp 1 put tp 0's shard
    code, document = _publish_and_scan(publisher, cli_args, namespace, values)
    pair = {key_of(namespace, 9, 0, 0), key_of(namespace, 9, 0, 1)}
    assert code == 1 and _flagged(document) == {key: ["SHARED_CONTENT", "IDENTITY_SUSPECT"] for key in pair}
    assert {by_key(document)[key]["severity"] for key in pair} == {"error"}  # the bytes show the mixup
    mixup = by_key(document)[key_of(namespace, 9, 0, 1)]["evidence"]["identity"]["rank_mixup"]
    assert mixup == {"same_bytes_as": [key_of(namespace, 9, 0, 0)]}


@pytest.mark.parametrize("members", [
    [("vllm", 0, 0)],  # a TP 1 producer
    [("vllm", 0, 0), ("vllm", 0, 1)],
])
def test_completeness_needs_no_more_members_than_the_producer_publishes(members):
    keys = [(vllm_key("m", f"{chunk:064x}", tp_rank=tp, group=group), 100)
            for chunk in range(4) for _, group, tp in members]
    judgement = ChunkIndex.of(keys).judge()
    assert judgement.missing == {} and judgement.summary["incomplete"] == 0


def test_lmcache_chunks_expect_every_worker_the_key_names():
    keys = [(f"model@4@{worker}@{'ab' * 8}@bfloat16", 100) for worker in (0, 1, 3)]
    judgement = ChunkIndex.of(keys).judge()
    assert judgement.missing[keys[0][0]] == [{"worker_id": 2}]


def test_chunk_verdicts_reach_metrics_html_explain_and_purge(publisher, cli_args, namespace, tmp_path):
    values = hybrid_producer(namespace)
    del values[key_of(namespace, 5, 0, 1)]
    for key, value in values.items():
        publisher.put(key, value)
    report, prom, page = tmp_path / "report.json", tmp_path / "audit.prom", tmp_path / "report.html"
    result = run_cli("check", *cli_args, "--prefix", namespace, "--format", "json", "--output", str(report),
                     "--prom-file", str(prom), "--no-progress", "--fail-on", "warning")
    assert result.exit_code == 1, result.output
    metrics = prom.read_text()
    assert 'mooncake_audit_chunks{state="incomplete"} 1.0' in metrics
    assert 'mooncake_audit_chunks{state="complete"} 47.0' in metrics
    assert "mooncake_audit_chunk_members_missing 1.0" in metrics
    assert 'mooncake_audit_verdict_keys{severity="warning",verdict="INCOMPLETE_CHUNK"} 1.0' in metrics
    assert 'mooncake_audit_severity_keys{severity="warning"} 1.0' in metrics

    assert run_cli("report", str(report), "--html", str(page)).exit_code == 0
    assert "47 complete, 1 incomplete (1 members missing)" in page.read_text()

    explained = run_cli("explain", key_of(namespace, 5, 0, 0), *cli_args, "--format", "json")
    assert explained.exit_code == 1, explained.output
    document = json.loads(explained.stdout)
    assert document["verdicts"] == ["INCOMPLETE_CHUNK"]
    assert document["chunk"] == {"members_present": [key_of(namespace, 5, 0, 0)],
                                 "missing": [{"group": 0, "tp_rank": 1, "pcp": 0, "dcp": 0, "pp_rank": 0}]}

    dry_run = run_cli("purge", str(report), "--verdict", "INCOMPLETE_CHUNK", *cli_args)
    assert dry_run.exit_code == 0 and dry_run.stdout.split() == ["would-remove", key_of(namespace, 5, 0, 0)]


def test_a_member_evicted_after_a_snapshot_shows_in_its_diff(publisher, cli_args, namespace, tmp_path):
    for key, value in hybrid_producer(namespace).items():
        publisher.put(key, value)
    before = tmp_path / "before.db"
    assert run_cli("snapshot", "--output", str(before), *cli_args, "--prefix", namespace,
                   "--no-progress").exit_code == 0
    assert publisher.store.remove(key_of(namespace, 11, 1, 0), True) == 0  # forced: the snapshot's read lease
    result = run_cli("diff", str(before), "--live", *cli_args, "--format", "json")
    assert result.exit_code == 1, result.output
    changes = {entry["key"]: entry for entry in json.loads(result.stdout)["entries"]}
    incomplete = {key_of(namespace, 11, group, tp_rank) for group in (0, 1, 2) for tp_rank in (0, 1)}
    incomplete.discard(key_of(namespace, 11, 1, 0))
    assert changes[key_of(namespace, 11, 1, 0)]["change"] == "removed"
    assert {key for key, entry in changes.items() if entry["change"] == "verdicts"} == incomplete
    assert all(changes[key]["b"]["verdicts"] == ["INCOMPLETE_CHUNK"] for key in incomplete)


def test_the_writers_checksum_is_verified_on_request(settings, cli_args, namespace):
    """A writer with MOONCAKE_STORE_CHECKSUM=1 stored a CRC-64; the bytes are then changed in the
    holder's memory behind Mooncake's back. Only a reader with the check on sees it."""
    code = textwrap.dedent("""
        import os, sys
        import numpy as np
        from audit.connection import AdminClient, Settings, open_store
        from audit.readers.descriptors import query_replicas
        from audit.readers.engine import RawTransfer
        settings = Settings(master=sys.argv[1], metadata=sys.argv[2], admin=sys.argv[3], local_hostname="127.0.0.1")
        store = open_store(settings)  # reads MOONCAKE_STORE_CHECKSUM=1 from this process's environment
        for name in ("crc-good", "crc-bad"):
            assert store.put(sys.argv[4] + name, bytes([7]) * 8192) == 0
        store.close()
        replica = query_replicas(AdminClient(settings.admin), [sys.argv[4] + "crc-bad"])[sys.argv[4] + "crc-bad"][0]
        raw = RawTransfer(settings)
        garbage = np.full(8192, 0x55, np.uint8)
        assert raw.register_buffer(garbage.ctypes.data, garbage.nbytes) == 0
        assert raw.engine.transfer_sync_write(replica.endpoint, garbage.ctypes.data, replica.address, 8192) == 0
        raw.close()
    """)
    env = {**os.environ, "MOONCAKE_STORE_CHECKSUM": "1"}
    subprocess.run([sys.executable, "-c", code, settings.master, settings.metadata, settings.admin, namespace],
                   env=env, check=True, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))

    def scan(*extra):
        process = subprocess.run([sys.executable, "-m", "cli", "scan", *cli_args, "--prefix", namespace, "--format",
                                  "json", "--no-progress", *extra], capture_output=True, text=True,
                                 env={k: v for k, v in os.environ.items() if k != "MOONCAKE_STORE_CHECKSUM"},
                                 cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
        return process.returncode, json.loads(process.stdout) if process.stdout else process.stderr

    code_plain, plain = scan()
    assert code_plain == 0 and plain["findings"] == []
    code_checked, checked = scan("--verify-writer-checksum")
    assert code_checked == 1 and checked["summary"]["writer_checksum_verified"] is True
    assert {record["key"]: record["verdicts"] for record in checked["findings"]} == {
        namespace + "crc-bad": ["CHECKSUM_MISMATCH"]}
    code_peek, message = scan("--verify-writer-checksum", "--read-mode", "peek")
    assert code_peek == 2 and "needs --read-mode lease" in message


def test_a_layerwise_lmcache_chunk_expects_every_layer():
    keys = [(f"model@1@0@{chunk:x}@half@{layer}", 100) for chunk in range(3) for layer in range(4)]
    keys.remove(("model@1@0@1@half@2", 100))
    judgement = ChunkIndex.of(keys).judge()
    assert judgement.missing["model@1@0@1@half@0"] == [{"part": 2, "worker_id": 0}]
    assert judgement.summary["incomplete"] == 1


def test_an_sglang_mla_page_expects_every_pipeline_stage():
    """`{hash}_{n}_k` with no `_v` beside it: an MLA pool's PP stages (or an MHA pool's TP ranks)."""
    keys = [(f"Qwen3_{page:064x}_{stage}_k", 100) for page in range(3) for stage in (0, 1)]
    keys.remove((f"Qwen3_{1:064x}_1_k", 100))
    judgement = ChunkIndex.of(keys).judge()
    assert judgement.missing == {f"Qwen3_{1:064x}_0_k": [{"part": "k", "shard": 1}]}


def test_an_sglang_page_without_its_mamba_states_is_whole_but_states_without_kv_are_not():
    """SGLang writes a hybrid's Mamba states (and SWA pages) for a prompt's trailing page only:
    however many of the family's pages hold them, a page without them is whole. A page's states
    without its `k` and `v` are not."""
    def page(index: int, parts) -> list:
        return [(f"t_m_{index:064x}_0_{part}", 100) for part in parts]

    keys = [key for index in range(19) for key in page(index, ("k", "v", "temporal", "conv_0"))]
    keys += page(19, ("k", "v"))                       # an inner page of a longer prompt
    keys += page(20, ("temporal", "conv_0", "k"))      # its `v` lost
    judgement = ChunkIndex.of(keys).judge()
    assert judgement.missing == {name: [{"part": "v", "tp_rank": 0}] for name, _ in page(20, ("temporal", "conv_0", "k"))}
    assert judgement.summary["incomplete"] == 1


def test_names_read_as_bytes_index_every_key_as_parsing_it_whole_would():
    """A vLLM key of a known shape is split and hex-checked as bytes, undecoded: each row's slot and
    chunk must be what parsing the whole name gives (`member_of(parse_key(name))`), for hostile
    names too, from a name list and from a KeyTable alike."""
    from audit.producers import member_of, parse_key
    from audit.sources.keytable import KeyTable

    names = [vllm_key("m", tail, tp_rank=rank) for tail in ("9abc", "9ABC", "00ff", "9abg", "9ab é", "9a\udcff", "")
             for rank in (0, 1)]
    names += [vllm_key("m\udcfe-é", "beef"), "m@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@", "@beef", "plain key",
              vllm_key("m", "beef", cache_prefix="tenant,a")]
    table = KeyTable()
    for name in names:
        table.append_listed(name, 64, "127.0.0.1:1", 4096)
    for index in (ChunkIndex.of((name, 64) for name in names), ChunkIndex.of_table(table)):
        got = {index.names(row): (index.slots[slot], chunk) for row, slot, chunk in zip(index.rows, index.slot, index.chunk)}
        expected = {}
        for name in names:
            if (member := member_of(parse_key(name))) is not None:
                expected[name] = ((member.family, member.part, member.rank, member.world), hash(member.chunk))
        assert got == expected
        assert sum(1 for name in got if name.startswith("m@")) == 6  # the three hex tails (either case), both ranks
