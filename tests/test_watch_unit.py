"""docs/watch.md's systemd unit passes `systemd-analyze verify` (skipped where systemd is absent)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

analyze = shutil.which("systemd-analyze")


@pytest.mark.skipif(analyze is None, reason="systemd-analyze not installed")
def test_the_documented_unit_verifies(tmp_path):
    doc = (Path(__file__).parent.parent / "docs" / "watch.md").read_text()
    unit = re.search(r"```ini\n(.*?)```", doc, re.S).group(1)
    executable = Path(sys.executable).with_name("mooncake-audit")
    if not executable.exists():
        pytest.skip("the mooncake-audit script is not installed beside this python")
    path = tmp_path / "mooncake-audit-watch.service"
    path.write_text(unit.replace("/opt/mooncake-audit/.venv/bin/mooncake-audit", str(executable)))
    verified = subprocess.run([analyze, "verify", str(path)], capture_output=True, text=True, timeout=60)
    assert verified.returncode == 0 and not verified.stderr.strip(), verified.stderr


def test_the_block_table_tail_reads_only_new_bytes(tmp_path):
    import json

    from audit.blocktables import BlockTableTail, read_block_tables

    path = tmp_path / "blocks-a-1-0.jsonl"
    line = lambda key, ids: json.dumps({"key": key, "block_ids": ids, "rc": 0}) + "\n"  # noqa: E731
    path.write_text(line("k1", [1]) + line("k2", [0]))
    tail = BlockTableTail([tmp_path])
    assert tail.poll() == {"k1", "k2"} and tail.bytes_read == path.stat().st_size
    assert tail.poll() == set() and tail.bytes_read == path.stat().st_size  # nothing new: nothing read
    read = tail.bytes_read
    with open(path, "a") as handle:
        handle.write(line("k3", [0]) + '{"key": "k4", "blo')  # the last line is still being written
    assert tail.poll() == {"k3"} and tail.bytes_read == read + len(line("k3", [0]))
    with open(path, "a") as handle:
        handle.write('ck_ids": [2], "rc": 0}\n')
    assert tail.poll() == {"k4"}
    assert tail.tables.get("k3").null_backed and tail.tables.get("k3").sources == [f"{path}:3"]
    assert tail.tables.get("k4").sources == [f"{path}:4"] and tail.tables.records == 4
    full = read_block_tables([tmp_path])
    assert {k: e.block_ids for k, e in full.entries.items()} == {k: e.block_ids for k, e in tail.tables.entries.items()}
    rotated = tmp_path / "blocks-a-1-1.jsonl"  # the recorder's next file: read from its start
    rotated.write_text(line("k5", [4]))
    assert tail.poll() == {"k5"}
    path.write_text(line("k6", [0]))  # truncated and rewritten: read again from its start
    assert tail.poll() == {"k6"} and tail.tables.get("k6").sources == [f"{path}:1"]


def test_the_interval_stretches_on_the_median_listing_not_one_slow_one():
    from audit.run.watch import stretched_interval

    assert stretched_interval(10, []) == 10
    assert stretched_interval(10, [0.5, 0.6, 6.3]) == 10  # one slow listing (median 0.6 s): no stretch
    assert stretched_interval(10, [1.2, 1.3, 6.3, 1.1, 1.25]) == 12.5  # median 1.25 s / 0.1
    assert stretched_interval(10, [2.0, 2.0, 0.1]) == 20


@pytest.mark.parametrize("known_s, stretched_s", [(0.3, 5.0), (0.8, 8.0)])
def test_a_listing_that_sized_every_key_stretches_no_interval(tmp_path, monkeypatch, known_s, stretched_s):
    """The first listing of a watcher, and one in FULL_LISTING_EVERY, sizes every key and costs several
    times one that knows the last listing, which is what the next round lists. Counted in the median,
    the first stretched the interval after start-up to ten times its seconds (and after the second round
    to ten times the mean of the two), however cheap the listings after it: the first key put after the
    store was verified waited that long. The watcher's own loop, with listings of known seconds."""
    import threading
    from types import SimpleNamespace

    import audit.run.watch as watch
    from audit.connection import Settings
    from audit.run.stops import StopOnSignals

    class Listing:  # what AdminListing.list returns, as far as the loop looks: 100 keys, `sized` of them sized
        def __init__(self, known):
            self.sized = 100 if known is None else 0

    class FakeListing:  # a fake: a real listing's seconds cannot be chosen, and the test is about them
        def __init__(self, admin, key_filter):
            self.admin, self.key_filter = admin, key_filter

        def list(self, known=None, index=True):
            return Listing(known)

    monkeypatch.setattr(watch, "AdminListing", FakeListing)
    monkeypatch.setattr(watch, "KnownKeys", lambda listing: listing)
    settings = Settings(master="127.0.0.1:9", metadata="http://127.0.0.1:9/metadata", admin="http://127.0.0.1:9")
    watcher = watch.Watcher(settings, watch.WatchOptions(state_dir=tmp_path, interval_s=5.0), log=lambda line: None)
    stop, rounds, intervals = threading.Event(), [], []

    def round_(state, stop, signals, interval):  # the real listing decision, the listing's cost made up
        listing = watcher._list(state, stop, signals)
        rounds.append((listing.sized == 100, interval))
        return 3.0 if listing.sized == 100 else known_s

    def wait(state, stop, signals, server, until):
        intervals.append(watcher.metrics.interval._value.get())
        if len(intervals) == 2 * watch.FULL_LISTING_EVERY + 1:
            stop.set()

    monkeypatch.setattr(watcher, "_round", round_)
    monkeypatch.setattr(watcher, "_wait", wait)
    watcher._loop(None, stop, StopOnSignals(), SimpleNamespace(alive=lambda: None))
    full = [n for n, (was_full, _) in enumerate(rounds) if was_full]
    assert full == [0, watch.FULL_LISTING_EVERY, 2 * watch.FULL_LISTING_EVERY]
    # after the first listing (full): --interval; from the second on, the listings that knew the last one
    assert intervals == [5.0] + [stretched_s] * (2 * watch.FULL_LISTING_EVERY)
    assert [interval for _, interval in rounds] == [5.0] + intervals[:-1]  # each round gets the interval set before
    assert watcher.metrics.listing_seconds_median._value.get() == known_s
    assert watcher.metrics.interval_stretched._value.get() == (stretched_s > 5.0)


def test_keys_are_read_ahead_of_the_period_by_the_backlog_they_need():
    from audit.run.watch import read_ahead_s

    assert read_ahead_s(86400, 10, 0, None) == 30             # no cap: two intervals and the client TTL early
    assert read_ahead_s(86400, 10, 1_000_000, None) == 30
    assert read_ahead_s(86400, 10, 5_000_000, 100_000) == 80  # 50 s of backlog at the cap, plus those
    assert read_ahead_s(60, 2, 10_000_000, 262_144) == 15     # at most a quarter of the period


def test_due_keys_include_those_within_the_read_ahead_and_chunks_are_settled_later(tmp_path):
    from audit.judge.chunks import ChunkIndex
    from audit.keys import vllm_key
    from audit.records import KeyInfo, KeyRecord
    from audit.run.watch import Watcher, read_ahead_s
    from audit.run.watch_state import WatchState

    state = WatchState(tmp_path)
    try:
        rank0, rank1 = (vllm_key("m", "c0", tp_rank=rank) for rank in (0, 1))
        names = ["old", "near", "fresh", rank0]
        state.add_new({name: 1000 for name in names}, 0.0)
        for name, at in (("old", 100.0), ("near", 110.0), ("fresh", 190.0), (rank0, 190.0)):
            state.verified([KeyRecord(key=name, size=1000, fields=None, xxh3=1, zero=False,
                                      verdicts=["NULL_BACKED"] if name == rank0 else [])], at, lambda found: None)
        period, now = 100.0, 205.0  # "old" is past its period, "near" 5 s short of it
        assert state.bytes_before(now - 0.75 * period) == 2000
        assert state.due(now - period, None) == ["old"]
        ahead = read_ahead_s(period, 2.0, state.bytes_before(now - 0.75 * period), 500.0)
        assert ahead == 18.0 and state.due(now - period + ahead, None) == ["old", "near"]
        # a key judged in a record round: the listing shows its chunk lacks rank 1, its other verdicts stay
        chunks = ChunkIndex.of([(rank0, 1000), (vllm_key("m", "c1", tp_rank=0), 1000),
                                (vllm_key("m", "c1", tp_rank=1), 1000)])
        [record] = Watcher._chunk_rejudge(state, [KeyInfo(name=rank0, size=1000)], chunks)
        assert record.verdicts == ["NULL_BACKED", "INCOMPLETE_CHUNK"] and record.xxh3 == 1
        assert rank1 not in state.known()
    finally:
        state.close()


def test_a_key_is_stamped_when_its_batch_was_read_not_when_the_round_commits(tmp_path):
    """A round at a bandwidth cap can read for most of a period: its keys fall due as they were read,
    spread over it, not all at the round's end."""
    from audit.records import KeyRecord
    from audit.run.watch_state import WatchState

    state = WatchState(tmp_path)
    try:
        state.add_new({"early": 10, "late": 10, "unstamped": 10}, 0.0)
        records = [KeyRecord(key=name, size=10, fields=None, xxh3=1, zero=False) for name in ("early", "late", "unstamped")]
        state.verified(records, 100.0, lambda found: None, read_at={"early": 80.0, "late": 95.0})
        stamps = dict(state.db.execute("SELECT name, last_verified FROM keys"))
        assert stamps == {"early": 80.0, "late": 95.0, "unstamped": 100.0}
        assert state.due(90.0, None) == ["early"]
        state.verified(records, 200.0, lambda found: None, restamp=False, read_at={"early": 150.0})
        assert dict(state.db.execute("SELECT name, last_verified FROM keys")) == stamps  # verdicts revised only
    finally:
        state.close()
