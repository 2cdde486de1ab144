"""Cross-key checks on the keys a producer publishes together: is every chunk whole, and does every
key look like the producer its name claims (issue #12, docs/verdicts.md).

A *chunk* is one unit of reuse: for vLLM one (cache prefix, model, store namespace, chunk hash);
its *members* are the keys of it, one per (part, rank), where the part is the KV-cache group
(vLLM), the buffer (SGLang `k`/`v`/`temporal`/`conv_i`), and the rank is the shard. A consumer can
use a chunk only when every member it needs is present, so the expected members are worked out
from the producer's own rules, on the listing (every key present, read or not):

- ranks: every rank that the producer's family (prefix, model, part) shows anywhere. vLLM 0.32.0
  puts each key exactly once (`put_step` spreads the replicas of a GQA head over ranks, and the
  key's `tp_rank` is the shard, `tp_rank // replication`), so a clean producer gives the same rank
  set for every chunk of a part; LMCache names its world size in the key;
- parts: a part the producer publishes wherever another is, is that one's *companion* (vLLM's
  Mamba groups, which `_boundary_puts` writes at once; SGLang's `k` and `v`), learned from the
  family's own chunks (`_companions`). A part that appears only in some of another's chunks (vLLM's
  Mamba groups, only at a prompt's boundary chunk among the attention group's) is no companion of
  it, so a chunk legitimately lacking a group is never flagged.

Identity: a key name says no dtype, layout or weight revision, so two producers can write under
one name. Within a (family, part, rank), a size other than the dominant one, and two ranks of
one chunk holding identical non-zero bytes (one rank's shard stored as another's), are
IDENTITY_SUSPECT. Two revisions with identical shapes cannot be told apart by size or digest.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

from audit.judge.values import IDENTITY_EVIDENCE
from audit.producers import Member, member_of, parse_key, producer_of
from audit.records import KeyRecord, Verdict

COMPANION_SHARE = 0.9
COMPANION_MIN_CHUNKS = 8
DOMINANT_SHARE = 0.5    # a size is the family's own only where more than half of its keys have it
MISSING_EXAMPLES = 8    # missing members named in each record's evidence


@dataclass
class ChunkIndex:
    """What the listing says about chunks: built once from every listed key's name and size."""

    members: dict[str, Member] = field(default_factory=dict)
    sizes: dict[str, int | None] = field(default_factory=dict)

    @classmethod
    def of(cls, keys: Iterable[tuple[str, int | None]]) -> ChunkIndex:
        index = cls()
        for name, size in keys:
            member = member_of(parse_key(name))
            if member is not None:
                index.members[name] = member
                index.sizes[name] = size
        return index

    def judge(self) -> ChunkJudgement:
        return _judge(self)


@dataclass
class ChunkJudgement:
    missing: dict[str, list[dict]] = field(default_factory=dict)   # key -> its chunk's missing members
    outliers: dict[str, dict] = field(default_factory=dict)        # key -> size evidence
    summary: dict = field(default_factory=dict)


def _companions(parts_by_chunk: dict[tuple, set]) -> dict:
    """part -> the parts published wherever it is, learned from the producer's own chunks: q is
    a companion of p when q is present in at least COMPANION_SHARE of the chunks holding p (and p
    is in at least COMPANION_MIN_CHUNKS). It is one-way: a Mamba group's chunks all carry the
    attention group, while most attention chunks carry no Mamba group."""
    holding: Counter = Counter()
    together: Counter = Counter()
    for parts in parts_by_chunk.values():
        for part in parts:
            holding[part] += 1
            for other in parts:
                if other != part:
                    together[(part, other)] += 1
    companions: dict = defaultdict(set)
    for (part, other), count in together.items():
        if holding[part] >= COMPANION_MIN_CHUNKS and count >= COMPANION_SHARE * holding[part]:
            companions[part].add(other)
    return companions


def _judge(index: ChunkIndex) -> ChunkJudgement:
    judgement = ChunkJudgement()
    chunks: dict[tuple, dict[object, set]] = defaultdict(lambda: defaultdict(set))  # chunk -> part -> ranks
    names: dict[tuple, list[str]] = defaultdict(list)
    ranks_of: dict[tuple, set] = defaultdict(set)  # (family, part) -> every rank seen
    worlds: dict[tuple, int] = {}
    sample: dict[tuple, Member] = {}
    for name, member in index.members.items():
        chunks[member.chunk][member.part].add(member.rank)
        names[member.chunk].append(name)
        ranks_of[(member.family, member.part)].add(member.rank)
        if member.world is not None:
            worlds[member.family] = member.world
        sample.setdefault(member.chunk, member)
    families: dict[tuple, dict[tuple, set]] = defaultdict(dict)
    for chunk, parts in chunks.items():
        families[sample[chunk].family][chunk] = set(parts)
    companions = {family: _companions(parts) for family, parts in families.items()}
    parts_seen = {family: set().union(*parts.values()) for family, parts in families.items()}

    incomplete = missing_members = 0
    for chunk, parts in chunks.items():
        member = sample[chunk]
        producer = producer_of(member.family[0])
        expected_parts = set(parts) | (parts_seen[member.family] if producer.every_part else set())
        for part in parts:
            expected_parts |= companions[member.family].get(part, set())
        missing = []
        for part in sorted(expected_parts, key=repr):
            if member.world is not None:
                expected = {(rank,) for rank in range(member.world)}
            else:
                expected = ranks_of[(member.family, part)]
            for rank in sorted(expected - parts.get(part, set())):
                missing.append(producer.member_fields(part, rank))
        if missing:
            incomplete += 1
            missing_members += len(missing)
            for name in names[chunk]:
                judgement.missing[name] = missing
    judgement.outliers = _size_outliers(index)
    judgement.summary = {"chunks": len(chunks), "complete": len(chunks) - incomplete, "incomplete": incomplete,
                         "members_missing": missing_members, "stores": _store_statistics(index)}
    return judgement


def _size_outliers(index: ChunkIndex) -> dict[str, dict]:
    by_slot: dict[tuple, list[str]] = defaultdict(list)
    for name, member in index.members.items():
        if producer_of(member.family[0]).fixed_size and index.sizes.get(name):
            by_slot[(member.family, member.part, member.rank)].append(name)
    outliers = {}
    for names in by_slot.values():
        sizes = Counter(index.sizes[name] for name in names)
        (dominant, count), = sizes.most_common(1)
        if len(sizes) < 2 or count <= DOMINANT_SHARE * len(names):
            continue  # one size, or no size a majority holds (nothing to call the producer's own)
        for name in names:
            if index.sizes[name] != dominant:
                outliers[name] = {"size": index.sizes[name], "dominant_size": dominant,
                                  "keys_with_dominant_size": count, "keys": len(names)}
    return outliers


def _store_statistics(index: ChunkIndex) -> list[dict]:
    """Sizes per (family, part), so that two revisions or dtypes under one name stand out."""
    sizes: dict[tuple, Counter] = defaultdict(Counter)
    for name, member in index.members.items():
        sizes[(member.family, repr(member.part), member.part)][index.sizes.get(name)] += 1
    rows = []
    for (family, _, part), counter in sorted(sizes.items(), key=lambda item: repr(item[0][:2])):
        scheme, *identity = family
        rows.append({"scheme": scheme, "family": [value for value in identity if value not in (None, "")],
                     "part": part, "keys": sum(counter.values()),
                     "sizes": {str(size): count for size, count in counter.most_common()}})
    return rows


def _rank_mixups(records: list[KeyRecord], index: ChunkIndex) -> dict[str, dict]:
    """Ranks of one chunk and part holding identical non-zero bytes: a shard stored as another's."""
    by_content: dict[tuple, list[KeyRecord]] = defaultdict(list)
    for record in records:
        member = index.members.get(record.key)
        if member is not None and member.world is None and record.xxh3 is not None and record.size and not record.zero:
            by_content[(member.chunk, repr(member.part), record.size, record.xxh3)].append(record)
    suspects = {}
    for same in by_content.values():
        ranks = {index.members[record.key].rank for record in same}
        if len(ranks) < 2:
            continue
        for record in same:
            others = [other.key for other in same if other.key != record.key]
            suspects[record.key] = {"same_bytes_as": others[:MISSING_EXAMPLES]}
    return suspects


CHUNK_VERDICTS = (Verdict.INCOMPLETE_CHUNK, Verdict.IDENTITY_SUSPECT)
CHUNK_EVIDENCE = ("incomplete_chunk", "identity")


def mark_chunks(records: list[KeyRecord], index: ChunkIndex | None) -> dict | None:
    """Set INCOMPLETE_CHUNK and IDENTITY_SUSPECT on `records` (idempotently); the summary's `chunks`.
    `index`: the listing's keys; without one, the records' own keys (a complete scan's)."""
    for record in records:
        for verdict in CHUNK_VERDICTS:
            if verdict in record.verdicts and not (verdict == Verdict.IDENTITY_SUSPECT
                                                   and IDENTITY_EVIDENCE in record.evidence):
                record.verdicts.remove(verdict)
        for name in CHUNK_EVIDENCE:
            record.evidence.pop(name, None)
    if index is None:
        index = ChunkIndex.of((record.key, record.size) for record in records)
    if not index.members:
        return None
    judgement = index.judge()
    mixups = _rank_mixups(records, index)
    for record in records:
        missing = judgement.missing.get(record.key)
        if missing:
            record.verdicts.append(Verdict.INCOMPLETE_CHUNK)
            record.evidence["incomplete_chunk"] = {"members_missing": len(missing),
                                                   "missing": missing[:MISSING_EXAMPLES]}
        identity = {}
        if record.key in judgement.outliers:
            identity["size_outlier"] = judgement.outliers[record.key]
        if record.key in mixups:
            identity["rank_mixup"] = mixups[record.key]
        if identity:
            record.evidence["identity"] = identity
            # a size its layout already refused is SIZE_MISMATCH: the outlier is evidence for it
            if ((Verdict.SIZE_MISMATCH not in record.verdicts or "rank_mixup" in identity)
                    and Verdict.IDENTITY_SUSPECT not in record.verdicts):
                record.verdicts.append(Verdict.IDENTITY_SUSPECT)
    return judgement.summary
