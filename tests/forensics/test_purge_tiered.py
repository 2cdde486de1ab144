"""A purge that sticks on a tiered store (issue #41): Mooncake's `remove` leaves a key's SSD copy,
and a restarted holder registers it again. `purge --yes --offload-dir DIR` takes the copy out of
the holder's bucket files (its `.meta` entry; the other keys of the bucket stay readable), so the
key stays gone after a real holder restart; a purge without the directory says the copy remains,
and the next `check --purged LOG` flags the key that came back PURGED_RETURNED; purged again, now
disk-only, it is read from the bucket file and stays gone after the next restart.
"""

from __future__ import annotations

import gzip
import json
import os

import xxhash

from audit.cluster import LocalCluster
from audit.connection import AdminClient, open_store
from audit.readers.buckets import stored_key
from audit.readers.descriptors import query_answers
from audit.readers.offload_index import index_directories
from tests.conftest import settings_for
from tests.helpers import by_key, run_cli, scan_json
from tests.readers.test_tiered import _put
from tests.readers.test_disk_copies import (
    BUCKET_KEYS,
    KEYS,
    VALUE_BYTES,
    cli_args,
    fill,
    put_again,
    remove,
)

PURGED, LEFT_ON_DISK, REMOVED = "sticks/1", "sticks/6", "sticks/3"  # two zero values, one healthy key
SENTINEL = "sentinel/0"  # a key only the first holder of two holds: on disk again once it has restarted
RETURNS = "back/0"  # all zero on the first holder of two, put again on the second, removed: back from the first


def _report(cluster: LocalCluster, key: str, path) -> None:
    result = run_cli("scan", *cli_args(cluster), "--prefix", key, "--read-mode", "peek", "--format", "json",
                     "--output", str(path), "--no-progress")
    assert result.exit_code == 1, result.output
    assert [record["key"] for record in json.loads(path.read_text())["findings"]] == [key]


def _purge_with_copy(cluster: LocalCluster, tmp_path):
    """The application removes REMOVED (its disk copy stays, and comes back); `purge --yes
    --offload-dir` purges PURGED: (holder, the file that held PURGED's copy, evidence directory,
    the purge's result, the copy's saved bytes)."""
    holder = cluster.running_holders[0]
    store = open_store(settings_for(cluster))
    try:
        remove(store, REMOVED)
    finally:
        store.close()
    held_in = index_directories([holder.offload_dir])[stored_key("default", PURGED)].path
    _report(cluster, PURGED, tmp_path / "purged.json")
    evidence = tmp_path / "evidence"
    done = run_cli("purge", str(tmp_path / "purged.json"), *cli_args(cluster), "--yes", "--evidence", str(evidence),
                   "--offload-dir", str(holder.offload_dir))
    assert done.exit_code == 0, done.output
    (saved,) = (evidence / "disk-copies").glob("*.gz")
    return holder, held_in, evidence, done, saved


def test_a_purged_key_stays_gone_after_a_holder_restart(tmp_path):
    with LocalCluster(holders=1, segment_mb=64, offload=True, bucket_keys=BUCKET_KEYS, client_ttl_s=3,
                      log_dir=tmp_path) as cluster:
        values = fill(cluster, "sticks", zero={1, 6})
        holder, bucket_of_purged, evidence, done, saved = _purge_with_copy(cluster, tmp_path)
        offload_dir = holder.offload_dir
        assert done.stdout.splitlines() == [
            f"removed      {PURGED}",
            f"disk-copy    {PURGED}: meta-rewritten {bucket_of_purged} (bytes in disk-copies/{saved.name})"]
        assert gzip.decompress(saved.read_bytes()) == bytes(VALUE_BYTES)  # evidence first: the disk copy's bytes
        (log_line,) = (evidence / "purge-log.jsonl").read_text().splitlines()
        (copy,) = json.loads(log_line)["disk_copies"]
        assert copy["how"] == "meta-rewritten" and copy["xxh3"] == xxhash.xxh3_64_hexdigest(bytes(VALUE_BYTES))
        index = index_directories([offload_dir])
        assert stored_key("default", PURGED) not in index  # the .meta no longer lists it ...
        assert sum(value.path == bucket_of_purged for value in index.values()) == BUCKET_KEYS - 1  # ... the rest it does

        _report(cluster, LEFT_ON_DISK, tmp_path / "left.json")
        left = run_cli("purge", str(tmp_path / "left.json"), *cli_args(cluster), "--yes",
                       "--evidence", str(tmp_path / "evidence-left"))
        assert left.exit_code == 3, left.output  # removed, but its disk copy remains: said, in one line
        assert f"disk-copy    {LEFT_ON_DISK}: remains on holder 127.0.0.1:" in left.stderr
        assert "1 removed key(s) keep a disk copy that a holder restart brings back" in left.stderr

        cluster.restart_holder(holder)
        cluster.wait_held([REMOVED, LEFT_ON_DISK], "local_disk")  # the holder's metadata scan registered them again
        back = cluster.tiers(values)
        assert set(back) == set(values) - {PURGED}
        assert all(tiers == {"local_disk"} for tiers in back.values())

        check = run_cli("check", *cli_args(cluster), "--prefix", "sticks/", "--read-mode", "lease", "--all",
                        "--format", "json", "--no-progress", "--purged", str(evidence / "purge-log.jsonl"),
                        "--purged", str(tmp_path / "evidence-left" / "purge-log.jsonl"))
        assert check.exit_code == 1, check.output
        document = json.loads(check.stdout)
        records = by_key(document)
        assert document["summary"]["verdicts"] == {"ZERO_VALUE": 1, "PURGED_RETURNED": 1}
        assert records[LEFT_ON_DISK]["verdicts"] == ["ZERO_VALUE", "PURGED_RETURNED"]
        assert records[LEFT_ON_DISK]["evidence"]["purged"]["log"].endswith("evidence-left/purge-log.jsonl")
        assert set(records) == set(values) - {PURGED}
        for key in records:  # read back through the holder, at the offsets its .meta files give
            assert records[key]["xxh3"] == f"{xxhash.xxh3_64_intdigest(values[key]):016x}", key

        _, rescan = scan_json([*cli_args(cluster), "--prefix", "sticks/", "--read-mode", "peek",
                               "--offload-dir", str(offload_dir)])
        assert rescan["summary"]["keys_scanned"] == KEYS - 1 and rescan["summary"]["offload"]["unlisted"]["values"] == 0

        # The key that came back is disk-only now: purged again on the holder's host, from its bucket file.
        (tmp_path / "returned.json").write_text(json.dumps({**document, "findings": [records[LEFT_ON_DISK]]}))
        again = run_cli("purge", str(tmp_path / "returned.json"), *cli_args(cluster), "--yes",
                        "--evidence", str(tmp_path / "evidence-again"), "--offload-dir", str(offload_dir))
        assert again.exit_code == 0, again.output
        assert again.stdout.splitlines()[0] == f"removed      {LEFT_ON_DISK}"
        assert again.stdout.splitlines()[1].startswith(f"disk-copy    {LEFT_ON_DISK}: meta-rewritten ")
        (sidecar,) = (tmp_path / "evidence-again" / "keys").glob("*.json")
        blob = tmp_path / "evidence-again" / json.loads(sidecar.read_text())["blob"]
        assert gzip.decompress(blob.read_bytes()) == bytes(VALUE_BYTES)  # read from the file before the remove
        holder = cluster.running_holders[0]
        cluster.restart_holder(holder)
        cluster.wait_held([REMOVED], "local_disk")
        assert set(cluster.tiers(values)) == set(values) - {PURGED, LEFT_ON_DISK}


def test_a_purged_key_file_stays_gone_after_a_holder_restart(tmp_path):
    """The file-per-key backend: the purged key's KVEntry file is moved into the evidence directory
    (its bytes saved first), so the restarted holder does not register it again; a key removed by
    the application keeps its file and comes back."""
    with LocalCluster(holders=1, segment_mb=64, offload=True, backend="file_per_key", client_ttl_s=3,
                      log_dir=tmp_path) as cluster:
        values = fill(cluster, "sticks", zero={1, 6})
        holder, key_file, evidence, done, saved = _purge_with_copy(cluster, tmp_path)
        offload_dir = holder.offload_dir
        assert done.stdout.splitlines() == [
            f"removed      {PURGED}",
            f"disk-copy    {PURGED}: file-moved {key_file} (bytes in disk-copies/{saved.name})"]
        assert gzip.decompress(saved.read_bytes()) == bytes(VALUE_BYTES)
        (moved,) = (evidence / "disk-copies").glob("*.orig")
        assert not key_file.exists() and moved.read_bytes().endswith(bytes(VALUE_BYTES))  # the whole KVEntry kept
        assert set(index_directories([offload_dir])) == {stored_key("default", key) for key in values if key != PURGED}

        cluster.restart_holder(holder)
        kept = [key for key in values if key != PURGED]
        cluster.wait_held(kept, "local_disk")  # the holder's scan of its key files registers them one by one
        back = cluster.tiers(values)
        assert set(back) == set(values) - {PURGED} and all(tiers == {"local_disk"} for tiers in back.values())
        _, rescan = scan_json([*cli_args(cluster), "--prefix", "sticks/", "--read-mode", "peek", "--all",
                               "--offload-dir", str(offload_dir)])
        records = by_key(rescan)
        assert set(records) == set(values) - {PURGED} and rescan["summary"]["verdicts"] == {"ZERO_VALUE": 1}
        for key, record in records.items():  # read from the key files, lease-free
            assert record["xxh3"] == f"{xxhash.xxh3_64_intdigest(values[key]):016x}", key
            assert record["evidence"]["replicas"][0]["file"].startswith(str(offload_dir)), key


def test_a_stale_disk_copy_of_a_key_put_again_is_taken_out_and_the_key_stays(tmp_path):
    """A key removed and put again with other bytes keeps its first value's copy in its bucket, which
    a restart of the holder would serve in place of memory's. `purge REPORT --stale-disk-copies
    --offload-dir DIR --yes` takes that copy out (its bytes saved first) and leaves the key and a
    copy that holds memory's bytes; after a restart the key is not served its first value."""
    with LocalCluster(holders=1, segment_mb=64, offload=True, bucket_keys=BUCKET_KEYS, client_ttl_s=3,
                      log_dir=tmp_path) as cluster:
        first = fill(cluster, "stale")
        holder = cluster.running_holders[0]
        changed, same = "stale/2", "stale/5"
        second = {changed: os.urandom(VALUE_BYTES), same: first[same]}
        put_again(cluster, second)
        report = tmp_path / "scan.json"
        scanned = run_cli("scan", *cli_args(cluster), "--prefix", "stale/", "--read-mode", "peek", "--offload-dir",
                          str(holder.offload_dir), "--format", "json", "--output", str(report), "--no-progress")
        assert scanned.exit_code == 0, scanned.output
        args = [str(report), *cli_args(cluster), "--stale-disk-copies", "--offload-dir", str(holder.offload_dir)]

        dry = run_cli("purge", *args)
        assert dry.exit_code == 0, dry.output
        assert dry.stdout.splitlines() == [f"would-take-out {changed}"]
        evidence = tmp_path / "evidence"
        done = run_cli("purge", *args, "--yes", "--evidence", str(evidence))
        assert done.exit_code == 0, done.output
        (saved,) = (evidence / "disk-copies").glob("*.gz")
        assert done.stdout.splitlines()[0] == f"taken-out    {changed}"
        assert done.stdout.splitlines()[1].startswith(f"disk-copy    {changed}: meta-rewritten ")
        assert gzip.decompress(saved.read_bytes()) == first[changed]  # evidence first: the stale copy's bytes
        index = index_directories([holder.offload_dir])
        assert stored_key("default", changed) not in index and stored_key("default", same) in index
        store = open_store(settings_for(cluster))
        try:
            assert store.get(changed) == second[changed]  # the key stays, memory's bytes
        finally:
            store.close()
        again = run_cli("purge", *args)  # run again: nothing left to take out
        assert again.exit_code == 0 and again.stdout.splitlines() == [f"gone         {changed}"], again.output

        cluster.restart_holder(holder)
        cluster.wait_held([same], "local_disk")
        tiers = cluster.tiers(first)
        assert changed not in tiers  # its memory copy went with the holder, and its first value stays out
        assert tiers[same] == {"local_disk"}


def test_a_key_put_again_on_another_holder_leaves_its_first_copy_which_is_named_and_taken_out_alone(tmp_path):
    """Two offloading holders on one host: a key offloaded by the first, removed, and put again on the
    second is offloaded there anew, and the first holder's bucket keeps its first value, which no
    master lists; a restart of that holder once the key has left the store serves it again (measured).
    The scan reads both directories and names the older copy beside the newer one (`latent`, with
    `current_copy`), whether it holds the bytes in memory or not; `purge --stale-disk-copies --yes`
    takes out that copy alone (its bytes saved first), leaving the key's newer copy and the copy
    that holds memory's bytes; the key removed and the first holder restarted, it stays gone.
    A key whose first copy (all zero) was not taken out comes back that way, listed on the first
    holder alone, and is read from that copy, not the newer one beside it: ZERO_VALUE."""
    with LocalCluster(holders=2, segment_mb=64, offload=True, bucket_keys=1, client_ttl_s=3, log_dir=tmp_path) as cluster:
        first_holder, second_holder = cluster.running_holders
        changed, same = "moved/1", "moved/2"
        first = {changed: os.urandom(VALUE_BYTES), same: os.urandom(VALUE_BYTES)}
        second = {changed: os.urandom(VALUE_BYTES), same: first[same]}
        store = open_store(settings_for(cluster))
        try:
            for key, value in {**first, SENTINEL: os.urandom(VALUE_BYTES), RETURNS: bytes(VALUE_BYTES)}.items():
                _put(store, key, value, first_holder.segment)
            cluster.wait_held([*first, SENTINEL, RETURNS], "local_disk")
            for key, value in {**second, RETURNS: os.urandom(VALUE_BYTES)}.items():
                remove(store, key)
                _put(store, key, value, second_holder.segment)
            cluster.wait_held([*second, RETURNS], "local_disk")
        finally:
            store.close()
        directories = [first_holder.offload_dir, second_holder.offload_dir]
        index = index_directories(directories)
        older = {key: index.superseded[stored_key("default", key)] for key in first}
        newer = {key: index[stored_key("default", key)] for key in first}
        assert all(copy.path.parent == first_holder.offload_dir for (copy,) in older.values())
        assert all(copy.path.parent == second_holder.offload_dir for copy in newer.values())

        dirs = [argument for directory in directories for argument in ("--offload-dir", str(directory))]
        report = tmp_path / "scan.json"
        scanned = run_cli("scan", *cli_args(cluster), "--prefix", "moved/", "--read-mode", "peek", *dirs,
                          "--format", "json", "--output", str(report), "--no-progress")
        assert scanned.exit_code == 0, scanned.output
        offload = json.loads(report.read_text())["summary"]["offload"]
        assert (offload["disk_copies_compared"], offload["disk_copies_divergent"]) == (2, 0)
        latent = offload["latent"]
        assert (latent["copies"], latent["unlike_memory"], latent["superseded"]) == (2, 1, 2), latent
        digest = lambda value: f"{xxhash.xxh3_64_intdigest(value):016x}"  # noqa: E731
        assert [(row["key"], row["file"], row["xxh3"], row["memory_xxh3"], row["current_copy"]["file"])
                for row in latent["named"]] == [
            (key, str(older[key][0].path), digest(first[key]), digest(second[key]), str(newer[key].path))
            for key in (changed, same)]  # the one unlike memory first
        human = run_cli("scan", *cli_args(cluster), "--prefix", "moved/", "--read-mode", "peek", *dirs, "--no-progress")
        assert "2 copy(ies), 1 unlike the bytes in memory, which a restart of the holder registers again in their " \
               "place (2 beside the key's current copy on another holder: served again if their holder restarts " \
               "once the key has left the store): moved/1, moved/2" in " ".join(human.stdout.split())

        args = [str(report), *cli_args(cluster), "--stale-disk-copies", *dirs]
        assert run_cli("purge", *args).stdout.splitlines() == [f"would-take-out {changed}"]
        evidence = tmp_path / "evidence"
        done = run_cli("purge", *args, "--yes", "--evidence", str(evidence))
        assert done.exit_code == 0 and done.stdout.splitlines()[0] == f"taken-out    {changed}", done.output
        (saved,) = (evidence / "disk-copies").glob("*.gz")
        assert gzip.decompress(saved.read_bytes()) == first[changed]  # evidence first: the older copy's bytes
        index = index_directories(directories)
        assert index[stored_key("default", changed)] == newer[changed]  # the newer copy stays
        assert stored_key("default", changed) not in index.superseded
        assert index.superseded[stored_key("default", same)] == older[same]  # memory's bytes: left

        store = open_store(settings_for(cluster))
        try:
            assert store.get(changed) == second[changed]
            remove(store, changed)  # the keys leave the store; their first holder restarts
            remove(store, RETURNS)
        finally:
            store.close()
        first_holder = cluster.restart_holder(first_holder)
        cluster.wait_held([SENTINEL], "local_disk")  # the first holder's directory registered again
        assert changed not in cluster.tiers([changed])  # its first value did not come back
        assert cluster.tiers([RETURNS]) == {RETURNS: {"local_disk"}}  # this one came back, from its first copy

        index = index_directories(directories)
        (listed,), (newest,) = [[copy for copy in index.copies(stored_key("default", RETURNS)) if copy.path.parent == d]
                                for d in directories]
        assert index[stored_key("default", RETURNS)] == newest  # the newest is not the one listed
        code, document = scan_json([*cli_args(cluster), "--prefix", RETURNS, "--read-mode", "peek", "--all", *dirs])
        assert code == 1 and document["summary"]["verdicts"] == {"ZERO_VALUE": 1}
        (record,) = document["findings"]
        assert record["xxh3"] == digest(bytes(VALUE_BYTES))
        assert record["evidence"]["replicas"][0]["file"] == str(listed.path)  # read from the copy listed
        ((row),) = document["summary"]["offload"]["latent"]["named"]
        assert (row["file"], row["current_copy"]["file"], row["memory_xxh3"]) == (
            str(newest.path), str(listed.path), digest(bytes(VALUE_BYTES)))


def test_a_key_put_again_on_a_holder_whose_directory_is_not_read_leaves_a_copy_named_not_compared(tmp_path):
    """Two offloading holders, the audit given the first one's directory alone (the second stands
    for another host): a key offloaded by the first, removed and put again on the second with other
    bytes is listed in memory and on the second's disk, while the first's bucket keeps its first
    value, the only copy here. That copy is not the key's: it is named in `latent` with the holder
    the master lists the key on (`current_copy.endpoint`), never compared (it was REPLICA_DIVERGENT,
    a false finding), and `purge --stale-disk-copies --yes` takes it out, the key keeping its bytes.
    The first holder's own keys are compared as before: its directory's holder is learnt from them."""
    with LocalCluster(holders=2, segment_mb=64, offload=True, bucket_keys=1, client_ttl_s=3, log_dir=tmp_path) as cluster:
        first_holder, second_holder = cluster.running_holders
        own = {f"own/{index}": os.urandom(VALUE_BYTES) for index in range(3)}
        moved, first_value, second_value = "moved/1", bytes(VALUE_BYTES), os.urandom(VALUE_BYTES)
        store = open_store(settings_for(cluster))
        try:
            for key, value in {moved: first_value, **own}.items():
                _put(store, key, value, first_holder.segment)
            cluster.wait_held([moved, *own], "local_disk")
            remove(store, moved)
            _put(store, moved, second_value, second_holder.segment)
            cluster.wait_held([moved], "local_disk")
        finally:
            store.close()
        assert cluster.tiers([moved]) == {moved: {"memory", "local_disk"}}
        (copy,) = index_directories([first_holder.offload_dir]).copies(stored_key("default", moved))
        (listed,) = query_answers(AdminClient(cluster.admin_url), [moved])[moved]["local_disk_values"]

        dirs = ["--offload-dir", str(first_holder.offload_dir)]
        report = tmp_path / "scan.json"
        for read_mode in ("lease", "peek"):
            scanned = run_cli("scan", *cli_args(cluster), "--read-mode", read_mode, "--all", *dirs,
                              "--format", "json", "--output", str(report), "--no-progress")
            assert scanned.exit_code == 0, scanned.output
            document = json.loads(report.read_text())
            offload = document["summary"]["offload"]
            assert document["summary"]["verdicts"] == {}, read_mode
            assert (offload["disk_copies_compared"], offload["disk_copies_divergent"],
                    offload["disk_copies_elsewhere"]) == (len(own), 0, 1), read_mode
            assert (offload["latent"]["copies"], offload["latent"]["unlike_memory"], offload["latent"]["superseded"]) == (1, 1, 1)
            (row,) = offload["latent"]["named"]
            digest = lambda value: f"{xxhash.xxh3_64_intdigest(value):016x}"  # noqa: E731
            assert (row["key"], row["file"], row["offset"], row["xxh3"], row["memory_xxh3"], row["current_copy"]) == (
                moved, str(copy.path), copy.value_offset, digest(first_value), digest(second_value),
                {"endpoint": listed["transport_endpoint"]})
            assert by_key(document)[moved]["xxh3"] == digest(second_value)
        page = tmp_path / "scan.html"
        assert run_cli("report", str(report), "--html", str(page)).exit_code == 0
        assert f"on holder {listed['transport_endpoint']}, not in these directories" in page.read_text()

        args = [str(report), *cli_args(cluster), "--stale-disk-copies", *dirs]
        assert run_cli("purge", *args).stdout.splitlines() == [f"would-take-out {moved}"]
        evidence = tmp_path / "evidence"
        done = run_cli("purge", *args, "--yes", "--evidence", str(evidence))
        assert done.exit_code == 0 and done.stdout.splitlines()[0] == f"taken-out    {moved}", done.output
        (saved,) = (evidence / "disk-copies").glob("*.gz")
        assert gzip.decompress(saved.read_bytes()) == first_value  # evidence first
        assert stored_key("default", moved) not in index_directories([first_holder.offload_dir])
        assert stored_key("default", moved) in index_directories([second_holder.offload_dir])
        store = open_store(settings_for(cluster))
        try:
            assert store.get(moved) == second_value
        finally:
            store.close()


def test_a_directory_given_with_its_holder_is_read_as_that_holders_where_the_master_would_mislead(tmp_path):
    """Two offloading holders, the audit given the first one's directory: its 2 own keys, then 3 keys
    that are removed and put again on the second holder with other bytes, so that the newest copies
    in the directory are leftovers the master lists on the second holder. Learnt from the master
    (newest first, the endpoint most name), the directory's holder is the second one: the summary's
    `holders` says so ("learnt"), and the operator names the right one, `--offload-dir DIR=ENDPOINT`.
    Then, in both read modes: no finding, the 2 own keys compared, the 3 leftovers named in `latent`
    with the second holder's endpoint, never compared with memory."""
    with LocalCluster(holders=2, segment_mb=64, offload=True, bucket_keys=1, client_ttl_s=3, log_dir=tmp_path) as cluster:
        first_holder, second_holder = cluster.running_holders
        own = {f"own/{index}": os.urandom(VALUE_BYTES) for index in range(2)}
        moved = {f"moved/{index}": os.urandom(VALUE_BYTES) for index in range(3)}
        store = open_store(settings_for(cluster))
        try:
            for key, value in own.items():
                _put(store, key, value, first_holder.segment)
            cluster.wait_held(list(own), "local_disk")
            for key, value in moved.items():  # the directory's newest copies
                _put(store, key, value, first_holder.segment)
            cluster.wait_held(list(moved), "local_disk")
            for key in moved:
                remove(store, key)
                _put(store, key, os.urandom(VALUE_BYTES), second_holder.segment)
            cluster.wait_held(list(moved), "local_disk")
        finally:
            store.close()
        answers = query_answers(AdminClient(cluster.admin_url), [*own, *moved])
        first_endpoint, second_endpoint = (
            {replica["transport_endpoint"] for key in keys for replica in answers[key]["local_disk_values"]}
            for keys in (own, moved))
        (first_endpoint,), (second_endpoint,) = first_endpoint, second_endpoint
        assert first_endpoint != second_endpoint

        directory, report = str(first_holder.offload_dir), tmp_path / "scan.json"
        run_cli("scan", *cli_args(cluster), "--offload-dir", directory, "--format", "json", "--output", str(report),
                "--no-progress")
        assert json.loads(report.read_text())["summary"]["offload"]["holders"] == {  # misled, and the vote split
            directory: {"endpoint": second_endpoint, "known": "learnt", "naming": 3, "asked": 5}}
        told = " ".join(run_cli("scan", *cli_args(cluster), "--offload-dir", directory, "--no-progress").stdout.split())
        assert (f"holder of {directory} learnt from the master: {second_endpoint}, named by 3 of the 5 newest keys "
                f"asked; if another holder owns it, give it as --offload-dir DIR=ENDPOINT") in told

        for read_mode in ("lease", "peek"):
            scanned = run_cli("scan", *cli_args(cluster), "--read-mode", read_mode, "--all",
                              "--offload-dir", f"{directory}={first_endpoint}", "--format", "json",
                              "--output", str(report), "--no-progress")
            assert scanned.exit_code == 0, scanned.output
            document = json.loads(report.read_text())
            offload = document["summary"]["offload"]
            assert document["summary"]["verdicts"] == {}, read_mode
            assert offload["holders"] == {directory: {"endpoint": first_endpoint, "known": "given"}}
            assert (offload["disk_copies_compared"], offload["disk_copies_divergent"],
                    offload["disk_copies_elsewhere"]) == (len(own), 0, len(moved)), read_mode
            latent = offload["latent"]
            assert (latent["copies"], latent["unlike_memory"], latent["superseded"]) == (3, 3, 3), read_mode
            assert {row["key"]: row["current_copy"] for row in latent["named"]} == dict.fromkeys(
                moved, {"endpoint": second_endpoint})
            digest = lambda value: f"{xxhash.xxh3_64_intdigest(value):016x}"  # noqa: E731
            assert {row["key"]: row["xxh3"] for row in latent["named"]} == {key: digest(value) for key, value in moved.items()}
