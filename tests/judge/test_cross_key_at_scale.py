"""Cross-key verdicts at 200,000 keys, through the compact path a scan takes (a KeyTable, a
RecordLedger, a settled ChunkIndex), against a brute-force computation written from the rules in
docs/verdicts.md with a dict or set per key. No cluster: the records are made here, as a scan
of such a store would make them."""

from __future__ import annotations

from collections import Counter, defaultdict

import numpy as np

from audit.judge.chunks import COMPANION_MIN_CHUNKS, COMPANION_SHARE, DOMINANT_SHARE, ChunkIndex
from audit.judge.ledger import RecordLedger
from audit.judge.merge import merge_records
from audit.keys import vllm_key
from audit.producers import member_of, parse_key, producer_of
from audit.records import KeyInfo, KeyRecord, Verdict
from audit.sources.keytable import KeyTable
from tests.producers.writers import lmcache_key

KEYS = 200_000
SIZES = {0: 4096, 1: 6144}


def _store(seed: int = 7) -> list[tuple[str, int, int, bool]]:
    """(name, size, digest, zero) for a TP 2 hybrid's chunks with planted faults, and LMCache keys
    with tags and replicated heads."""
    rng = np.random.default_rng(seed)
    rows = []
    chunk = 0
    while len(rows) < KEYS - 4_000:
        chunk_hash = f"{chunk:032x}"
        groups = (0, 1) if chunk % 4 == 3 else (0,)
        for group in groups:
            for rank in (0, 1):
                roll = rng.random()
                if roll < 0.002:
                    continue  # a member missing: INCOMPLETE_CHUNK on the rest of its chunk
                size = SIZES[group] if rng.random() > 0.0005 else SIZES[group] // 2  # a size outlier
                zero = rng.random() < 0.01
                digest = 0 if zero else int(rng.integers(1, 2**63))
                rows.append((vllm_key("hybrid", chunk_hash, tp_rank=rank, group=group, cache_prefix="ns"),
                             size, digest, zero))
        if chunk % 5_000 == 17 and rows[-1][2] and rows[-2][2] and rows[-1][1] == rows[-2][1]:
            rows[-1] = rows[-1][:2] + (rows[-2][2], False)  # rank 1 holds rank 0's bytes: a mixup
        if chunk % 7_000 == 5:  # another chunk's bytes copied: SHARED_CONTENT across chunks
            rows[-1] = rows[-1][:2] + (rows[0][2], rows[0][3])
        chunk += 1
    for lm_chunk in range(1_000):
        for user in ("alice", "bob"):  # the same chunk under two tags: expected
            rows.append((lmcache_key("m", 1, 0, lm_chunk + 1, "float", tags={"user": user}), 262_172,
                         10**9 + lm_chunk, False))
        for worker in (0, 1):  # a replicated head at TP 2: expected
            rows.append((lmcache_key("m", 2, worker, lm_chunk + 1, "float"), 262_172, 2 * 10**9 + lm_chunk, False))
    return rows


def _records(rows) -> list[KeyRecord]:
    return [KeyRecord(key=name, size=size, fields=None, xxh3=digest, zero=zero,
                      verdicts=[Verdict.ZERO_VALUE] if zero else [], ordinal=ordinal)
            for ordinal, (name, size, digest, zero) in enumerate(rows)]


def _brute_force(rows) -> dict[str, set[str]]:
    """Every cross-key verdict, from per-key dicts and sets."""
    verdicts: dict[str, set[str]] = defaultdict(set)
    members = {name: member_of(parse_key(name)) for name, *_ in rows}
    size_of = {name: size for name, size, *_ in rows}
    chunks: dict[tuple, dict] = defaultdict(lambda: defaultdict(set))
    first: dict[tuple, object] = {}
    ranks_of: dict[tuple, set] = defaultdict(set)
    for name, *_ in rows:
        m = members[name]
        chunks[m.chunk][repr(m.part)].add(m.rank)
        first.setdefault(m.chunk, m)
        ranks_of[(m.family, repr(m.part))].add(m.rank)
    holding, together = Counter(), Counter()
    for chunk, parts in chunks.items():
        family = first[chunk].family
        for p in parts:
            holding[(family, p)] += 1
            for q in parts:
                if q != p:
                    together[(family, p, q)] += 1
    parts_of: dict[tuple, set] = defaultdict(set)
    for chunk, parts in chunks.items():
        parts_of[first[chunk].family] |= set(parts)
    incomplete = set()
    for chunk, parts in chunks.items():
        m = first[chunk]
        expected = set(parts) | (parts_of[m.family] if producer_of(m.family[0]).every_part else set())
        for p in list(parts):
            for q in parts_of[m.family]:
                if (q != p and holding[(m.family, p)] >= COMPANION_MIN_CHUNKS
                        and together[(m.family, p, q)] >= COMPANION_SHARE * holding[(m.family, p)]):
                    expected.add(q)
        for p in expected:
            want = {(r,) for r in range(m.world)} if m.world is not None else ranks_of[(m.family, p)]
            if want - parts.get(p, set()):
                incomplete.add(chunk)
    for name, *_ in rows:
        if members[name].chunk in incomplete:
            verdicts[name].add(Verdict.INCOMPLETE_CHUNK)
    by_slot: dict[tuple, list[str]] = defaultdict(list)
    for name, *_ in rows:
        m = members[name]
        if producer_of(m.family[0]).fixed_size:
            by_slot[(m.family, repr(m.part), m.rank)].append(name)
    for names in by_slot.values():
        sizes = Counter(size_of[n] for n in names)
        dominant, count = sizes.most_common(1)[0]
        if len(sizes) > 1 and count > DOMINANT_SHARE * len(names):
            for n in names:
                if size_of[n] != dominant:
                    verdicts[n].add(Verdict.IDENTITY_SUSPECT)
    by_content: dict[tuple, list[str]] = defaultdict(list)
    for name, size, digest, zero in rows:
        if not zero:
            by_content[(size, digest)].append(name)
    for names in by_content.values():
        if len(names) < 2:
            continue
        fields = [parse_key(n) for n in names]
        lmcache = all(f["scheme"] == "lmcache" for f in fields) and len({f["chunk_hash"] for f in fields}) == 1
        for n in names:
            verdicts[n].add(Verdict.EXPECTED_DUPLICATE if lmcache else Verdict.SHARED_CONTENT)
        mixup = defaultdict(set)
        for n in names:
            m = members[n]
            if m.world is None:
                mixup[(m.chunk, repr(m.part))].add((m.rank, n))
        for same in mixup.values():
            if len({rank for rank, _ in same}) > 1:
                for _, n in same:
                    verdicts[n].add(Verdict.IDENTITY_SUSPECT)
    return verdicts


def test_cross_key_verdicts_at_200k_keys_match_a_brute_force_computation():
    rows = _store()
    assert len(rows) >= KEYS - 4_000
    table = KeyTable.of(KeyInfo(name=name, size=size) for name, size, *_ in rows)
    ledger = RecordLedger(table)
    for record in _records(rows):
        ledger.add(record)
    report = merge_records(ledger, context={}, keys_listed=len(rows), chunks=ChunkIndex.of_table(table).settle())

    cross = {Verdict.INCOMPLETE_CHUNK, Verdict.IDENTITY_SUSPECT, Verdict.SHARED_CONTENT, Verdict.EXPECTED_DUPLICATE}
    found = {r.key: set(r.verdicts) & cross for r in report.records if set(r.verdicts) & cross}
    expected = {name: marks for name, marks in _brute_force(rows).items() if marks}
    assert found == expected
    counts = Counter(v for marks in found.values() for v in marks)
    # every kind was planted, and the compact path kept only those records whole
    assert counts[Verdict.INCOMPLETE_CHUNK] > 100 and counts[Verdict.IDENTITY_SUSPECT] > 10
    assert counts[Verdict.SHARED_CONTENT] >= 2 and counts[Verdict.EXPECTED_DUPLICATE] == 4_000
    assert len(ledger.kept()) < len(rows) // 10
    assert report.summary["keys_scanned"] == len(rows)
    assert report.summary["chunks"]["incomplete"] == len({member_of(parse_key(n)).chunk for n, m in found.items()
                                                          if Verdict.INCOMPLETE_CHUNK in m})
