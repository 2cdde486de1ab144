"""`scan` against a real cluster: keys put with known bytes come back with the right verdicts."""

from __future__ import annotations

import numpy as np
import xxhash

from audit.connection import AdminClient, open_store
from audit.sources.listing import AdminListing
from tests.helpers import by_key, scan_json

HOSTILE_NAMES = [
    "line\nbreak",
    "comma,key",
    "slash%2Fencoded",
    "\x1b[31mansi\x1b[0m",
    "[red]markup[/]",
    "k" * 4096,
]


def _random(rng, n):
    return rng.integers(0, 256, n, dtype=np.uint8).tobytes()


def test_verdicts_and_digests_for_known_bytes(publisher, cli_args, namespace):
    rng = np.random.default_rng(7)
    shared = _random(rng, 50_000)
    values = {
        "zero-small": bytes(4096),
        "zero-large": bytes(3 << 20),
        "random-a": _random(rng, 1_376_256),
        "random-b": _random(rng, 1000),
        "dup-1": shared,
        "dup-2": shared,
        "dup-3": shared,
        "almost-zero": bytes(9999) + b"\x01",
    }
    for name, value in values.items():
        publisher.put(namespace + name, value)

    code, report = scan_json(cli_args, "--prefix", namespace, "--all")

    assert code == 1
    records = by_key(report)
    assert set(records) == {namespace + name for name in values}
    for name, value in values.items():
        record = records[namespace + name]
        assert record["xxh3"] == f"{xxhash.xxh3_64_intdigest(value):016x}"
        assert record["size"] == len(value)
        assert record["fields"] == {"scheme": "opaque"}
    verdicts = {name: records[namespace + name]["verdicts"] for name in values}
    assert verdicts == {
        "zero-small": ["ZERO_VALUE"], "zero-large": ["ZERO_VALUE"], "random-a": [], "random-b": [],
        "dup-1": ["SHARED_CONTENT"], "dup-2": ["SHARED_CONTENT"], "dup-3": ["SHARED_CONTENT"],
        "almost-zero": [],
    }
    assert records[namespace + "dup-1"]["evidence"]["shared_content"]["keys_in_group"] == 3
    assert report["summary"]["findings"] == 5
    assert report["summary"]["verdicts"] == {"SHARED_CONTENT": 3, "ZERO_VALUE": 2}
    assert report["summary"]["bytes_scanned"] == sum(len(v) for v in values.values())
    assert [sorted(g["keys"]) for g in report["shared_groups"]] == [
        sorted(namespace + n for n in ("dup-1", "dup-2", "dup-3"))]
    # Without --all only findings are listed.
    _, findings_only = scan_json(cli_args, "--prefix", namespace)
    assert "keys" not in findings_only and len(findings_only["findings"]) == 5


def test_clean_store_exits_zero_and_vllm_fields_are_parsed(publisher, cli_args, namespace):
    key = f"{namespace}@mamba-130m-hf@tp_rank:1@pcp0@dcp0@pp_rank:0@group:0@abc123"
    publisher.put(key, b"\x07" * 4096)
    code, report = scan_json(cli_args, "--prefix", namespace, "--all")
    assert code == 0 and report["summary"]["complete"] and report["findings"] == []
    fields = by_key(report)[key]["fields"]
    assert fields["scheme"] == "vllm" and fields["model"] == "mamba-130m-hf" and fields["tp_rank"] == 1
    assert fields["cache_prefix"] == namespace


def test_hostile_key_names_are_found_and_reported_exactly(publisher, cli_args, namespace):
    values = {namespace + name: bytes([i + 1]) * (1000 + i) for i, name in enumerate(HOSTILE_NAMES)}
    for key, value in values.items():
        publisher.put(key, value)
    publisher.put(namespace + "zero\nwith-newline", bytes(2048))

    code, report = scan_json(cli_args, "--prefix", namespace, "--all")

    records = by_key(report)
    assert set(records) == set(values) | {namespace + "zero\nwith-newline"}
    for key, value in values.items():
        assert records[key]["verdicts"] == [] and records[key]["size"] == len(value)
        assert records[key]["xxh3"] == f"{xxhash.xxh3_64_intdigest(value):016x}"
    assert records[namespace + "zero\nwith-newline"]["verdicts"] == ["ZERO_VALUE"]
    assert code == 1


def test_match_filters_by_regular_expression(publisher, cli_args, namespace):
    for name in ("keep-1", "keep-2", "drop-1"):
        publisher.put(namespace + name, b"\x01" * 100)
    _, report = scan_json(cli_args, "--prefix", namespace, "--match", r"keep-\d$", "--all")
    assert sorted(by_key(report)) == [namespace + "keep-1", namespace + "keep-2"]


def test_key_removed_after_listing_is_vanished_not_a_finding(publisher, settings, namespace):
    from audit.checks.host import HostChecker
    from audit.readers.lease import LeaseReader
    from audit.judge.merge import merge_records
    from audit.run.scan import scan_keys
    from audit.sources.listing import KeyFilter

    for name in ("stays", "goes"):
        publisher.put(namespace + name, b"\x05" * 5000)
    store = open_store(settings)
    try:
        listing = AdminListing(AdminClient(settings.admin), KeyFilter(namespace)).list()
        assert sorted(k.name for k in listing.keys) == [namespace + "goes", namespace + "stays"]
        assert publisher.remove(namespace + "goes") == 0
        reader = LeaseReader(store, 1 << 20)
        records = list(scan_keys(listing.keys, reader, HostChecker()))
        reader.close()
    finally:
        store.close()
    verdicts = {r.key: r.verdicts for r in records}
    assert verdicts == {namespace + "stays": [], namespace + "goes": ["VANISHED"]}
    report = merge_records(records, context={}, keys_listed=2)
    assert report.exit_code == 0 and report.summary["findings"] == 0


def test_values_larger_than_the_buffer_are_read_not_skipped(publisher, cli_args, namespace):
    big = np.random.default_rng(3).integers(0, 256, 3 << 20, dtype=np.uint8).tobytes()
    publisher.put(namespace + "big", big)
    publisher.put(namespace + "small", b"\x02" * 10)
    code, report = scan_json(cli_args, "--prefix", namespace, "--all", "--buffer-mb", "1")
    assert code == 0
    assert by_key(report)[namespace + "big"]["xxh3"] == f"{xxhash.xxh3_64_intdigest(big):016x}"


def test_scan_is_read_only(publisher, settings, cli_args, namespace):
    rng = np.random.default_rng(11)
    values = {namespace + f"v{i}": _random(rng, 2000 + i) for i in range(20)}
    values[namespace + "z"] = bytes(1000)
    for key, value in values.items():
        publisher.put(key, value)
    admin = AdminClient(settings.admin)
    before = {k.name: k.size for k in AdminListing(admin).list().keys}

    scan_json(cli_args, "--prefix", namespace)
    scan_json(cli_args)

    after = {k.name: k.size for k in AdminListing(admin).list().keys}
    assert after == before
    store = open_store(settings)
    try:
        for key, value in values.items():
            assert store.get(key) == value
    finally:
        store.close()
