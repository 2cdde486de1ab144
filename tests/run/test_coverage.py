"""Coverage on real clusters: what the master holds against what was audited, in every report format.

Store A is a multi-tenant master (a quota file, FACTS §9) with two holders: 12 keys in the default
tenant (2 of them with two memory replicas) and 12 in `team-a`, published through the recorder,
4 of them all zeros. Tests read store A and never change it, so its numbers hold for each of them.
"""

from __future__ import annotations

import http.client
import json
from urllib.parse import urlsplit

import numpy as np
import pytest
import xxhash

from audit.cluster import LocalCluster
from audit.recorder.records import RecordWriter
from audit.recorder.wrapper import recording_store_class
from audit.workload import Publisher
from tests.conftest import settings_for
from tests.helpers import by_key, report_schema, run_cli, scan_json

TENANT = "team-a"
VALUE_BYTES = 4096
ZERO_KEYS = [f"a/zero-{i}" for i in range(4)]
TENANT_KEYS = ZERO_KEYS + [f"a/value-{i}" for i in range(8)]
DEFAULT_KEYS = [f"d/value-{i}" for i in range(12)]
TWO_REPLICAS = DEFAULT_KEYS[:2]
READ_ONLY_ROUTES = {"/health", "/metrics", "/get_all_keys", "/batch_query_keys", "/api/v1/tenant_quotas"}


def _random(seed: int, n: int = VALUE_BYTES) -> bytes:
    return np.random.default_rng(seed).integers(1, 256, n, dtype=np.uint8).tobytes()


def _publish_through_recorder(settings, directory, tenant: str, values: dict[str, bytes]) -> None:
    """Puts the way vLLM's connector does (zero-copy from a registered buffer), through the recorder."""
    from mooncake.store import MooncakeDistributedStore

    store = recording_store_class(MooncakeDistributedStore, RecordWriter(directory))()
    assert store.setup("127.0.0.1", settings.metadata, 0, 16 << 20, "tcp", "", settings.master, None, False, "",
                       tenant) == 0
    buffer = np.zeros((len(values) + 1) * VALUE_BYTES, dtype=np.uint8)  # block 0 stays unused (vLLM's null block)
    for block, value in enumerate(values.values(), start=1):
        buffer[block * VALUE_BYTES:(block + 1) * VALUE_BYTES] = np.frombuffer(value, dtype=np.uint8)
    base = buffer.ctypes.data
    assert store.register_buffer(base, buffer.nbytes) == 0
    results = store.batch_put_from(list(values), [base + block * VALUE_BYTES for block in range(1, len(values) + 1)],
                                   [VALUE_BYTES] * len(values))
    assert list(results) == [0] * len(values)
    store.unregister_buffer(base)
    store.close()


@pytest.fixture(scope="module")
def store_a(tmp_path_factory):
    from mooncake.store import ReplicateConfig

    records = tmp_path_factory.mktemp("records")
    with LocalCluster(holders=2, segment_mb=64, tenants=(TENANT,)) as cluster:
        settings = settings_for(cluster)
        publisher = Publisher(settings)
        two = ReplicateConfig()
        two.replica_num = 2
        for i, key in enumerate(DEFAULT_KEYS):
            assert publisher.store.put(key, _random(i), *([two] if key in TWO_REPLICAS else [])) == 0
        publisher.close()
        tenant_values = {key: bytes(VALUE_BYTES) if key in ZERO_KEYS else _random(100 + i)
                         for i, key in enumerate(TENANT_KEYS)}
        _publish_through_recorder(settings, records, TENANT, tenant_values)
        yield cluster, records, tenant_values


@pytest.fixture
def args_a(store_a):
    cluster = store_a[0]
    return ["--master", cluster.master_address, "--metadata", cluster.metadata_url, "--admin", cluster.admin_url,
            "--local-hostname", "127.0.0.1"]


@pytest.fixture
def key_list(store_a, tmp_path):
    path = tmp_path / "team-a-keys.txt"
    path.write_text("\n".join(TENANT_KEYS + ["a/never-put"]) + "\n")
    return path


def _gaps(coverage: dict) -> dict[str, dict]:
    return {gap["reason"]: gap for gap in coverage["not_audited"]}


def test_a_default_scan_of_a_multi_tenant_master_is_incomplete_and_names_the_tenant(args_a):
    code, report = scan_json(args_a)

    assert code == 3
    coverage = report["summary"]["coverage"]
    assert (coverage["keys_held"], coverage["keys_listed"], coverage["keys_read"]) == (24, 12, 12)
    assert coverage["keys_held_readings"] == {"before_listing": 24, "after_listing": 24}
    gaps = _gaps(coverage)
    assert set(gaps) == {"other_tenants", "replicas_not_read"} and not coverage["complete"]
    assert gaps["other_tenants"]["keys"] == 12 and gaps["other_tenants"]["blocking"]
    assert [t["name"] for t in gaps["other_tenants"]["tenants"]] == [TENANT]
    assert {t["name"]: t["audited"] for t in coverage["tenants"]} == {"default": True, TENANT: False}
    charged = {t["name"]: t["charged_bytes"] for t in coverage["tenants"]}
    assert charged[TENANT] == 12 * VALUE_BYTES

    human = run_cli("scan", *args_a, "--no-progress")
    assert human.exit_code == 3
    assert human.stdout.splitlines()[0] == "INCOMPLETE: no findings, but 12 key(s) the master holds were not audited " \
                                           "(see below)"
    assert "coverage: the master holds 24 key(s); 12 listed; 12 read" in human.stdout
    assert "in tenants the listing cannot show: team-a" in human.stdout and "--tenant team-a" in human.stdout


def test_coverage_numbers_are_the_same_in_every_format(args_a, tmp_path):
    _, document = scan_json(args_a)
    expected = document["summary"]["coverage"]

    lines = run_cli("scan", *args_a, "--format", "jsonl", "--no-progress")
    summary = json.loads(lines.stdout.splitlines()[-1])
    assert lines.exit_code == 3 and summary["type"] == "summary" and summary["coverage"] == expected

    report = tmp_path / "report.json"
    report.write_text(json.dumps(document))
    page = tmp_path / "report.html"
    assert run_cli("report", str(report), "--html", str(page)).exit_code == 0
    html = page.read_text()
    assert "the master holds 24 key(s); 12 listed; 12 read" in html and "team-a" in html
    assert "12 key(s) the master holds were not audited" in html

    prom = tmp_path / "audit.prom"
    check = run_cli("check", *args_a, "--prom-file", str(prom), "--no-progress")
    assert check.exit_code == 3
    metrics = prom.read_text()
    for count, value in (("held", 24), ("listed", 12), ("named", 0), ("read", 12)):
        assert f'mooncake_audit_coverage_keys{{count="{count}"}} {value}.0' in metrics
    assert 'mooncake_audit_keys_not_audited{blocking="true",reason="other_tenants"} 12.0' in metrics
    assert f'mooncake_audit_tenant_charged_bytes{{tenant="{TENANT}"}} {12 * VALUE_BYTES}.0' in metrics
    assert 'mooncake_audit_tenant_charged_bytes{tenant="default"} 57344.0' in metrics  # 14 replicas of 4 KiB
    assert "mooncake_audit_complete 0.0" in metrics


def test_tenant_with_a_key_list_flags_exactly_the_zero_keys(args_a, key_list, store_a):
    tenant_values = store_a[2]

    code, report = scan_json(args_a, "--tenant", TENANT, "--keys", str(key_list), "--all")

    assert code == 1
    flagged = {record["key"] for record in report["findings"]}
    assert flagged == set(ZERO_KEYS)
    assert all(record["tenant"] == TENANT and record["verdicts"] == ["ZERO_VALUE"] for record in report["findings"])
    records = [record for record in report["keys"] if record.get("tenant") == TENANT]
    assert {r["key"]: r["xxh3"] for r in records if r["xxh3"]} == {
        key: f"{xxhash.xxh3_64_intdigest(value):016x}" for key, value in tenant_values.items()}
    assert by_key(report)["a/never-put"]["verdicts"] == ["VANISHED"]
    coverage = report["summary"]["coverage"]
    assert (coverage["keys_held"], coverage["keys_listed"], coverage["keys_named"], coverage["keys_read"]) == \
        (24, 12, 12, 24)
    assert coverage["complete"] and coverage["keys_vanished"] == 1
    assert {t["name"]: (t["keys_named"], t["keys_read"], t["read_mode"]) for t in coverage["tenants"]} == {
        "default": (None, 12, None), TENANT: (12, 12, "lease")}


def test_tenant_all_with_the_recorder_records_covers_both_tenants(args_a, store_a):
    records_dir = store_a[1]

    code, report = scan_json(args_a, "--tenant", "all", "--block-tables", str(records_dir))

    assert code == 1
    assert {(r["key"], r.get("tenant")) for r in report["findings"]} == {(key, TENANT) for key in ZERO_KEYS}
    coverage = report["summary"]["coverage"]
    assert coverage["complete"] and (coverage["keys_held"], coverage["keys_read"]) == (24, 24)
    assert [gap["reason"] for gap in coverage["not_audited"]] == ["replicas_not_read"]


def test_a_peek_check_reads_other_tenants_with_a_lease_and_every_memory_replica(args_a, key_list):
    result = run_cli("check", *args_a, "--tenant", TENANT, "--keys", str(key_list), "--format", "json",
                     "--no-progress")

    assert result.exit_code == 1
    report = json.loads(result.stdout)
    assert {r["key"] for r in report["findings"]} == set(ZERO_KEYS)
    coverage = report["summary"]["coverage"]
    assert coverage["complete"] and coverage["keys_read"] == 24
    assert coverage["replica_tiers"]["memory"] == {"keys": 12, "replicas": 14, "not_read": 0}
    assert all(coverage["replica_tiers"][tier] == {"keys": 0, "replicas": 0, "not_read": 0}
               for tier in ("disk", "local_disk", "nof"))


def test_a_lease_scan_counts_the_memory_replicas_it_did_not_read(args_a):
    _, report = scan_json(args_a)
    coverage = report["summary"]["coverage"]
    assert coverage["replica_tiers"]["memory"] == {"keys": 12, "replicas": 14, "not_read": 2}
    gap = _gaps(coverage)["replicas_not_read"]
    assert gap["replicas"] == {"memory": 2} and not gap["blocking"]


def test_a_filtered_scan_covers_what_it_was_asked_and_still_names_the_tenant(args_a, key_list):
    code, report = scan_json(args_a, "--prefix", "d/value-1")
    gaps = _gaps(report["summary"]["coverage"])
    assert code == 3 and gaps["outside_filter"]["keys"] == 9 and not gaps["outside_filter"]["blocking"]
    assert gaps["other_tenants"]["keys"] == 12  # the tenant's keys may match the filter: nothing says they do not

    code, report = scan_json(args_a, "--prefix", "a/zero", "--tenant", TENANT, "--keys", str(key_list))
    coverage = report["summary"]["coverage"]
    assert code == 1 and {r["key"] for r in report["findings"]} == set(ZERO_KEYS)
    assert coverage["complete"] and _gaps(coverage)["outside_filter"]["keys"] == 12 + 9  # 12 listed, 9 named


def test_tenant_options_that_cannot_work_are_one_line_errors(args_a, cli_args, key_list):
    no_tenants = run_cli("scan", *cli_args, "--tenant", TENANT, "--keys", str(key_list), "--no-progress")
    assert no_tenants.exit_code == 2 and "runs without tenants" in no_tenants.stderr
    unknown = run_cli("scan", *args_a, "--tenant", "team-z", "--keys", str(key_list), "--no-progress")
    assert unknown.exit_code == 2 and "no such tenant (it has default, team-a)" in unknown.stderr
    keys_alone = run_cli("scan", *args_a, "--keys", str(key_list), "--no-progress")
    assert keys_alone.exit_code == 2 and "give --tenant" in keys_alone.stderr
    for result in (no_tenants, unknown, keys_alone):
        assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.output


def test_earlier_reports_and_snapshots_are_key_sources(args_a, key_list, tmp_path):
    code, first = scan_json(args_a, "--tenant", TENANT, "--keys", str(key_list), "--all")
    report = tmp_path / "first.json"
    report.write_text(json.dumps(first))
    code, again = scan_json(args_a, "--tenant", TENANT, "--keys", str(report))
    assert code == 1 and {r["key"] for r in again["findings"]} == set(ZERO_KEYS)
    assert again["summary"]["coverage"]["keys_named"] == 12

    snapshot = tmp_path / "team-a.db"
    assert run_cli("snapshot", *args_a, "--tenant", TENANT, "--keys", str(key_list), "-o", str(snapshot),
                   "--no-progress").exit_code == 1
    code, from_snapshot = scan_json(args_a, "--tenant", TENANT, "--keys", str(snapshot))
    assert code == 1 and {r["key"] for r in from_snapshot["findings"]} == set(ZERO_KEYS)


def test_a_key_with_a_comma_is_read_and_judged_in_both_read_modes(publisher, cli_args, namespace):
    publisher.put(namespace + "comma,zero", bytes(3000))
    publisher.put(namespace + "comma,value", _random(7, 3000))
    publisher.put(namespace + "plain", _random(8, 3000))

    for command in ("scan", "check"):  # lease reads, then peek reads (the admin API cannot describe these keys)
        result = run_cli(command, *cli_args, "--prefix", namespace, "--all", "--format", "json", "--no-progress")
        assert result.exit_code == 1, result.output
        report = json.loads(result.stdout)
        records = by_key(report)
        assert records[namespace + "comma,zero"]["verdicts"] == ["ZERO_VALUE"]
        assert records[namespace + "comma,value"]["verdicts"] == []
        assert records[namespace + "comma,value"]["xxh3"] == f"{xxhash.xxh3_64_intdigest(_random(7, 3000)):016x}"
        coverage = report["summary"]["coverage"]
        assert coverage["keys_admin_cannot_answer"] == 2 and coverage["complete"], coverage["not_audited"]


def test_a_clean_filtered_scan_of_a_single_tenant_master_exits_zero(publisher, cli_args, namespace):
    for i in range(3):
        publisher.put(namespace + f"k{i}", _random(20 + i, 1000))
    code, report = scan_json(cli_args, "--prefix", namespace)
    coverage = report["summary"]["coverage"]
    assert code == 0 and coverage["complete"] and coverage["tenants"] is None
    # (the session cluster is shared: earlier tests' removals can leave the master's count a few
    # keys behind the listing for a moment, so held and listed are not compared here)
    assert coverage["keys_held"] > 0 and coverage["keys_read"] == 3
    assert _gaps(coverage)["outside_filter"]["keys"] == coverage["keys_listed"] - 3

    sampled = run_cli("check", *cli_args, "--prefix", namespace, "--sample", "1", "--format", "json", "--no-progress")
    sample_coverage = json.loads(sampled.stdout)["summary"]["coverage"]
    assert sampled.exit_code == 0 and sample_coverage["complete"]
    assert _gaps(sample_coverage)["not_sampled"] == {**_gaps(sample_coverage)["not_sampled"], "keys": 2,
                                                      "blocking": False}


def test_the_audit_calls_only_read_only_admin_routes(args_a, key_list, store_a, monkeypatch):
    calls = []
    original = http.client.HTTPConnection.request

    def request(self, method, url, *args, **kwargs):
        calls.append((method, urlsplit(url).path))
        return original(self, method, url, *args, **kwargs)

    monkeypatch.setattr(http.client.HTTPConnection, "request", request)
    for command in ("scan", "check"):
        result = run_cli(command, *args_a, "--tenant", TENANT, "--keys", str(key_list), "--block-tables",
                         str(store_a[1]), "--format", "json", "--no-progress")
        assert result.exit_code == 1
    assert calls and {method for method, _ in calls} == {"GET"}
    assert {path for _, path in calls} <= READ_ONLY_ROUTES


def test_the_schema_names_every_reason():
    from audit.judge.coverage import REASONS

    reasons = report_schema()["$defs"]["summary"]["properties"]["coverage"]["properties"]["not_audited"]
    assert set(reasons["items"]["properties"]["reason"]["enum"]) == set(REASONS)


def test_a_key_the_lease_free_query_refuses_is_sized_through_the_client():
    from audit.sources.listing import AdminListing

    class Admin:  # the master's answers, one of them a refusal (no case of it was found on 0.3.13)
        def all_keys_body(self):
            return b"plain\nrefused\ngone\n"

        def query(self, names):
            answers = {"plain": {"ok": True, "values": [{"size_": 5, "buffer_address_": 1,
                                                        "transport_endpoint_": "h:1"}]},
                       "refused": {"ok": False, "error": "INVALID_KEY"},
                       "gone": {"ok": False, "error": "OBJECT_NOT_FOUND"}}
            return [(name, answers.get(name, answers["gone"])) for name in names]

    sizes = {"refused": 7}
    listing = AdminListing(Admin(), size_of=lambda name: sizes.get(name, -704)).list()
    assert {key.name: key.size for key in listing.keys} == {"plain": 5, "refused": 7}
    assert listing.through_client == 1 and listing.vanished == ["gone"]


def test_key_files_in_every_format(tmp_path):
    from audit.errors import AuditError
    from audit.sources.named import NamedKey, read_named_keys

    plain = tmp_path / "keys.txt"
    plain.write_text("a\n\n b \nc,d\na\n")
    lines = tmp_path / "report.jsonl"
    lines.write_text("\n".join(json.dumps(d) for d in (
        {"type": "header", "schema": "mooncake-audit/report-jsonl", "version": 1},
        {"type": "key", "key": "x", "tenant": TENANT}, {"type": "key", "key": "y"}, {"type": "summary"})))
    assert read_named_keys([plain, lines]) == [NamedKey("a", None), NamedKey(" b ", None), NamedKey("c,d", None),
                                               NamedKey("x", TENANT), NamedKey("y", "default")]
    records = tmp_path / "blocks.jsonl"
    records.write_text(json.dumps({"key": "k", "block_ids": [1]}) + "\n")
    with pytest.raises(AuditError, match="go to --block-tables"):
        read_named_keys([records])
