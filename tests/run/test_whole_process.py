"""The fetch rate at every scale (issue #31): `--verbose` phases, and the cheaper paths giving the
reports the full ones give: a check (peek reads from the listing's descriptors, findings confirmed a
batch later) against a scan of the same store, `on_batch` handed every batch in order, the seen-key
set, and an empty store that sets up no reader."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
import xxhash

from audit.records import KeyInfo, KeyRecord
from audit.run.phases import Phases, process_age_s
from audit.run.scan import scan_keys
from audit.run.statedir import StateDir
from tests.helpers import run_cli

ZERO_EVERY = 7


def _put_store(publisher, namespace: str, count: int, size: int = 3000) -> dict[str, bytes]:
    rng = np.random.default_rng(31)
    values = {}
    for i in range(count):
        value = bytes(size) if i % ZERO_EVERY == ZERO_EVERY - 1 else rng.integers(1, 256, size, dtype=np.uint8).tobytes()
        name = f"{namespace}k{i:04d}"
        publisher.put(name, value)
        values[name] = value
    publisher.put(f"{namespace}twin-a", b"\x05" * size)  # shared content: a cross-key verdict
    publisher.put(f"{namespace}twin-b", b"\x05" * size)
    return values


def _report(command: str, cli_args, namespace, *extra) -> tuple[int, dict, str]:
    result = run_cli(command, *cli_args, "--prefix", namespace, "--format", "json", "--all", "--no-progress", *extra)
    assert result.exit_code in (0, 1, 3), result.output
    return result.exit_code, json.loads(result.stdout), result.stderr


def _comparable(document: dict) -> dict:
    """What a report says about the store: per key its digest, size, zero flag and verdicts; the
    summary's counts, verdicts and coverage (not times, nor how the keys were read)."""
    summary = {name: document["summary"][name] for name in (
        "keys_listed", "keys_selected", "keys_scanned", "keys_unread", "bytes_scanned", "findings", "verdicts",
        "shared_groups", "complete", "exit_code")}
    coverage = dict(document["summary"]["coverage"])
    coverage.pop("replica_tiers")  # a lease read leaves replicas unread that a peek read reads: by design
    keys = {record["key"]: (record["xxh3"], record["size"], record["zero"], sorted(record["verdicts"]))
            for record in document["keys"]}
    return {"summary": summary, "coverage": coverage, "keys": keys, "shared": document["shared_groups"]}


def test_check_and_scan_report_the_same_store_alike(publisher, cli_args, namespace, tmp_path):
    """`check` reads peek (the listing's descriptors, checked with the master after each batch; findings
    read again a batch later), `scan` reads with leases: every key's digest and verdicts, and the
    counts, agree. Small buffers: many batches, so confirmations follow batches in flight."""
    values = _put_store(publisher, namespace, 120)
    code_scan, scan, _ = _report("scan", cli_args, namespace, "--buffer-mb", "1")
    code_check, check, _ = _report("check", cli_args, namespace, "--buffer-mb", "1", "--state-dir", str(tmp_path / "s"))
    assert code_scan == code_check == 1
    assert _comparable(check) == _comparable(scan)
    by_key = {record["key"]: record for record in check["keys"]}
    for name, value in values.items():
        assert by_key[name]["xxh3"] == f"{xxhash.xxh3_64_intdigest(value):016x}"
        rows = by_key[name]["evidence"]["replicas"]
        assert [row["status"] for row in rows] == ["ok"] and rows[0]["xxh3"] == by_key[name]["xxh3"]
    zero = [record for record in check["keys"] if record["zero"]]
    assert len(zero) == 120 // ZERO_EVERY
    assert all(record["evidence"]["confirmation"]["status"] == "confirmed" for record in zero)


def test_verbose_prints_every_phase_and_leaves_the_report_alone(publisher, cli_args, namespace):
    _put_store(publisher, namespace, 20)
    code, quiet, quiet_err = _report("scan", cli_args, namespace)
    code_verbose, loud, err = _report("scan", cli_args, namespace, "--verbose")
    assert code == code_verbose == 1 and "phase:" not in quiet_err
    assert _comparable(loud) == _comparable(quiet)
    lines = [line.removeprefix("phase: ") for line in err.splitlines() if line.startswith("phase: ")]
    names = [line.rsplit("  ", 1)[0].strip() for line in lines]
    for expected in ("imports, option parsing", "connect (admin health, Ray)",
                     "listing (key counts, /get_all_keys, sizing)", "chunk index", "store client setup",
                     "buffer registration", "reading and judging (wall)", "waiting for fetches (and planning batches)",
                     "checking and judging batches", "merge (cross-key verdicts, summary)", "report", "close",
                     "other (between phases)"):
        assert expected in names, (expected, lines)
    assert lines[-1].startswith("total since")
    seconds = {name: float(line.split()[-2]) for name, line in zip(names, lines) if line.split()[-1] == "s"}
    assert all(value >= 0 for value in seconds.values())


def test_an_empty_selection_sets_up_no_reader_nor_store_client(cli_args, namespace):
    for command in ("scan", "check"):
        code, document, err = _report(command, cli_args, namespace + "nothing/", "--verbose")
        assert code == 0 and document["summary"]["keys_scanned"] == 0 and document["summary"]["complete"]
        assert "store client setup" not in err and "transfer engine start" not in err
        assert "buffer registration" not in err


def test_phases_add_up_and_nest():
    phases = Phases(cli_started=None)
    with phases.phase("listing"):
        pass
    phases.add("reading", 2.0)
    phases.add("waiting", 0.5, within="reading")
    phases.add("checking", 1.0, within="reading")
    phases.rest("reading", "rest")
    phases.add("reading", 1.0)  # a phase entered twice adds up
    lines = phases.lines()
    labels = [line.rsplit("  ", 1)[0].strip() for line in lines]
    assert labels.index("reading") < labels.index("waiting") < labels.index("checking") < labels.index("rest")
    assert lines[labels.index("rest")].split()[-2] == "1.500"
    assert lines[labels.index("reading")].split()[-2] == "3.000"
    age = process_age_s()
    assert age is None or age > 0


class _Reader:
    """Batches from memory; `fail_at` makes one fetch raise."""

    mode = "lease"

    def __init__(self, values: dict[str, bytes], fail_at: int | None = None):
        from types import SimpleNamespace

        self.capacity = 4 * 64
        self.array = np.zeros(2 * self.capacity, np.uint8)
        self.values, self.fail_at = values, fail_at
        self.fetched: list[int] = []
        self.SimpleNamespace = SimpleNamespace

    def order(self, keys):
        return keys

    def fetch(self, slots, turn):
        from audit.readers.buffers import FetchedBatch

        self.fetched.append(turn)
        if turn == self.fail_at:
            raise RuntimeError("holder gone")
        base = (turn % 2) * self.capacity
        view = self.array[base:base + self.capacity]
        for slot in slots:
            data = np.frombuffer(self.values[slot.key.name], np.uint8)
            view[slot.offset:slot.offset + len(data)] = data
        return FetchedBatch(slots, [slot.key.size for slot in slots], self.SimpleNamespace(array=view))

    def close(self):
        """Holds nothing to release."""


def _keys(count: int) -> tuple[list[KeyInfo], dict[str, bytes]]:
    values = {f"k{i:03d}": (bytes(64) if i % 5 == 0 else bytes([i + 1]) * 64) for i in range(count)}
    return [KeyInfo(name, len(value)) for name, value in values.items()], values


def test_on_batch_sees_every_batch_in_order_before_its_records_are_yielded():
    from audit.checks.host import HostChecker

    keys, values = _keys(18)  # 4 keys a batch: 5 batches
    seen: list[list[str]] = []
    yielded: list[str] = []
    for record in scan_keys(keys, _Reader(values), HostChecker(), on_batch=lambda batch: seen.append(
            [r.key for r in batch])):
        assert record.key in {name for batch in seen for name in batch}  # handed on before it is yielded
        yielded.append(record.key)
    assert yielded == [key.name for key in keys]
    assert seen == [[key.name for key in keys[i:i + 4]] for i in range(0, 18, 4)]


def test_a_failed_fetch_still_hands_on_the_batch_before_it():
    from audit.checks.host import HostChecker

    keys, values = _keys(18)
    seen: list[list[str]] = []
    yielded: list[str] = []
    with pytest.raises(RuntimeError, match="holder gone"):
        for record in scan_keys(keys, _Reader(values, fail_at=2), HostChecker(),
                                on_batch=lambda batch: seen.append([r.key for r in batch])):
            yielded.append(record.key)
    assert yielded == [key.name for key in keys[:8]] and len(seen) == 2


def test_a_stop_between_batches_ends_after_the_batch_in_hand():
    from audit.checks.host import HostChecker

    keys, values = _keys(40)
    stop = threading.Event()
    yielded = []
    for record in scan_keys(keys, _Reader(values), HostChecker(), stop=stop, on_batch=lambda batch: stop.set()):
        yielded.append(record.key)
    # batch 0 is handed on once batch 1 is fetched, which sets stop: batch 1 is the last one read
    assert yielded == [key.name for key in keys[:8]]


def test_seen_keys_are_remembered_by_the_digests_of_their_names(tmp_path):
    """A check remembers the keys it read by the XXH3-64 of their names, as the ledger gives them
    (listed rows hashed from the listing's bytes, a named key's and a finding's from their names),
    and the next run knows them by the same digests, an undecodable byte included."""
    from audit.judge.ledger import RecordLedger
    from audit.records import KeyInfo, KeyRecord, Verdict
    from audit.sources.keytable import KeyTable

    names = [f"key-{i % 700}\udcff" if i % 3 else f"key-{i}" for i in range(3000)]
    table = KeyTable.of(KeyInfo(name=name, size=8) for name in names[:1000])
    ledger = RecordLedger(table)
    for row, name in enumerate(names[:1000]):
        record = KeyRecord(key=name, size=8, fields=None, xxh3=row, zero=False, ordinal=row)
        if row % 250 == 0:
            record.verdicts.append(Verdict.ZERO_VALUE)  # kept whole
        ledger.add(record)
    ledger.add(KeyRecord(key="tenant-b/named\udcfe", size=8, fields=None, xxh3=1, zero=False))  # no listed row
    expected = [xxhash.xxh3_64_intdigest(name.encode("utf-8", "surrogateescape"))
                for name in [*names[:1000], "tenant-b/named\udcfe"]]
    assert ledger.name_hashes().tolist() == expected
    state = StateDir(tmp_path)
    try:
        state.remember(ledger.name_hashes())
        assert state.new_keys(names) == set(names[1000:]) - set(names[:1000])
        assert state.new_keys(["tenant-b/named\udcfe", "fresh"]) == {"fresh"}
    finally:
        state.release()


def test_a_record_keeps_its_replica_rows_through_the_ledger():
    """A peek read's one replica row, read fine where the listing had it, is held as a ledger row
    and given back as it was."""
    from audit.judge.ledger import RecordLedger
    from audit.sources.keytable import KeyTable

    table = KeyTable()
    row = table.append_listed("k", 64, "127.0.0.1:1", 4096)
    assert table.info(row).replicas == [{"tier": "memory", "endpoint": "127.0.0.1:1", "address": 4096, "size": 64}]
    record = KeyRecord(key="k", size=64, fields=None, xxh3=0xABC, zero=False, ordinal=row)
    record.evidence["replicas"] = [{"endpoint": "127.0.0.1:1", "address": 4096, "size": 64,
                                    "xxh3": f"{0xABC:016x}", "status": "ok"}]
    ledger = RecordLedger(table)
    ledger.add(record)
    assert not ledger.kept() and list(ledger)[0].evidence == record.evidence
