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
  it, so a chunk legitimately lacking a group is never flagged; nor is a part the producer says it
  writes at some pages only (`Producer.trailing_only`: SGLang's Mamba and SWA objects), however
  often the family's chunks happen to hold it.

Identity: a key name says no dtype, layout or weight revision, so two producers can write under
one name. Within a (family, part, rank), a size other than the dominant one, and two ranks of
one chunk holding identical non-zero bytes (one rank's shard stored as another's), are
IDENTITY_SUSPECT. Two revisions with identical shapes cannot be told apart by size or digest.
"""

from __future__ import annotations

from array import array
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np

from audit.judge.values import IDENTITY_EVIDENCE
from audit.producers import Member, member_of, parse_key, producer_of
from audit.producers.vllm import HEX_DIGITS
from audit.records import KeyRecord, Verdict
from audit.sources.keytable import NAME_ENCODING

COMPANION_SHARE = 0.9
COMPANION_MIN_CHUNKS = 8
DOMINANT_SHARE = 0.5    # a size is the family's own only where more than half of its keys have it
MISSING_EXAMPLES = 8    # missing members named in each record's evidence
TEMPLATES = 4096        # distinct key shapes whose parse is remembered (vLLM: one per model, rank, group)
_HEX_BYTES = HEX_DIGITS.encode()  # `is_hex`'s digits, for names as a listing's bytes


class _Templates:
    """A vLLM key is its shape (everything before the last '@') plus a chunk hash, and the shape alone
    decides family, part and rank: each shape is parsed once, into the slot its keys fill. Names
    come as a listing's bytes: a key of a known shape is never decoded."""

    def __init__(self, slot_id: Callable[[tuple], int]):
        self._slot_id = slot_id
        self.shapes: dict[bytes, tuple[int, tuple] | None] = {}  # shape -> (slot id, family); None: not vLLM's

    def learn(self, stem: bytes, name: bytes, chunk_hash: bytes) -> tuple[int, tuple] | None:
        """(slot id, family) of a shape not seen yet, from its first key `name` (`stem`@`chunk_hash`),
        remembered for the next; None: not vLLM's."""
        shape = self._shape(name.decode(*NAME_ENCODING), chunk_hash.decode("ascii"))
        if len(self.shapes) < TEMPLATES:
            self.shapes[stem] = shape
        return shape

    def _shape(self, name: str, chunk_hash: str) -> tuple[int, tuple] | None:
        fields = parse_key(name)
        if fields.get("chunk_hash") != chunk_hash or fields.get("scheme") != "vllm":
            return None
        member = member_of(fields)
        return None if member is None else (self._slot_id((member.family, member.part, member.rank, member.world)),
                                            member.family)


@dataclass
class ChunkIndex:
    """What the listing says about chunks, built once from every listed key's name and size and
    held in fixed-width columns (about 24 B a key): a row per key of a producer's chunk, naming
    its chunk (a 64-bit hash of it), its slot (family, part, rank: few distinct ones) and size.
    `names` gives a row's key name back (a KeyTable's, or the names given)."""

    rows: array = field(default_factory=lambda: array("q"))     # the key's ordinal (its position given)
    chunk: array = field(default_factory=lambda: array("q"))    # hash((family..., chunk hash))
    slot: array = field(default_factory=lambda: array("l"))     # index into slots
    size: array = field(default_factory=lambda: array("q"))     # -1: unknown
    slots: list[tuple] = field(default_factory=list)            # (family, part, rank, world)
    names: object = None                                        # ordinal -> key name
    table: object = None                                        # the KeyTable it was built from, if one
    _settled: ChunkJudgement | None = None
    _held: np.ndarray | None = None

    @classmethod
    def of(cls, keys: Iterable[tuple[str, int | None]]) -> ChunkIndex:
        """From (name, size) pairs; a row's ordinal is its position among them."""
        names: list[str] = []
        index = cls._build(((ordinal, name.encode(*NAME_ENCODING), -1 if size is None else size)
                            for ordinal, (name, size) in enumerate(keys)), names)
        index.names = names.__getitem__
        return index

    @classmethod
    def of_table(cls, table) -> ChunkIndex:
        """From a KeyTable: ordinals are its rows, names stay in the table."""
        index = cls._build(table.encoded_rows(), None)
        index.names = table.name
        index.table = table
        return index

    @classmethod
    def _build(cls, keys, names: list | None) -> ChunkIndex:
        """One pass over (ordinal, encoded name, size or -1): a vLLM key costs a split, a lookup of its shape
        and a hash of its chunk (the shape is parsed once); any other key is decoded and parsed whole."""
        index = cls()
        slot_ids: dict[tuple, int] = {}

        def slot_id(slot: tuple) -> int:
            if (found := slot_ids.get(slot)) is None:
                found = slot_ids[slot] = len(index.slots)
                index.slots.append(slot)
            return found

        templates = _Templates(slot_id)
        learn, known = templates.learn, templates.shapes
        rows, chunks, slots, sizes = index.rows.append, index.chunk.append, index.slot.append, index.size.append
        for ordinal, name, size in keys:
            if names is not None:
                names.append(name.decode(*NAME_ENCODING))
            stem, _, tail = name.rpartition(b"@")
            shape = None
            if stem and tail and not tail.translate(None, _HEX_BYTES):  # `is_hex` of the bytes
                if (shape := known.get(stem, False)) is False:
                    shape = learn(stem, name, tail)
            if shape is not None:
                slot, family = shape
                chunk = hash((*family, tail.decode("ascii")))  # the chunk of Member: (*family, chunk hash)
            else:
                member = member_of(parse_key(name.decode(*NAME_ENCODING)))
                if member is None:
                    continue
                slot, chunk = slot_id((member.family, member.part, member.rank, member.world)), hash(member.chunk)
            rows(ordinal)
            chunks(chunk)
            slots(slot)
            sizes(size)
        return index

    def __len__(self) -> int:
        return int(self._held.sum()) if self._held is not None else len(self.rows)

    def judge(self) -> ChunkJudgement:
        return self._settled if self._settled is not None else _judge(self)

    def settle(self) -> ChunkIndex:
        """Judge now and let the columns go: what the listing says about chunks is known before a
        single value is read, so the judging's temporary arrays never meet the scan's records.
        Which ordinals the index held is kept, as a bit per table row."""
        self._settled = _judge(self)
        held = np.zeros(max(self.rows, default=-1) + 1, dtype=bool)
        held[np.frombuffer(self.rows, dtype=np.int64)] = True
        self._held = held
        self.rows, self.chunk, self.slot, self.size = array("q"), array("q"), array("l"), array("q")
        return self

    def holds(self, ordinals: np.ndarray) -> np.ndarray:
        """Whether each ordinal is a key of this index (a bool per ordinal)."""
        held = self._held if self._held is not None else None
        if held is None:
            return np.isin(ordinals, np.frombuffer(self.rows, dtype=np.int64))
        inside = (ordinals >= 0) & (ordinals < len(held))
        result = np.zeros(len(ordinals), dtype=bool)
        result[inside] = held[ordinals[inside]]
        return result


@dataclass
class ChunkJudgement:
    missing_rows: dict[int, list[dict]] = field(default_factory=dict)  # ordinal -> its chunk's missing members
    outlier_rows: dict[int, dict] = field(default_factory=dict)        # ordinal -> size evidence
    summary: dict = field(default_factory=dict)
    names: object = None

    @property
    def missing(self) -> dict[str, list[dict]]:
        return {self.names(row): missing for row, missing in self.missing_rows.items()}

    @property
    def outliers(self) -> dict[str, dict]:
        return {self.names(row): evidence for row, evidence in self.outlier_rows.items()}


class _Slots:
    """Per slot id: its family, its part's bit within the family, and its rank as an int (the
    worker, for producers that name a world size; -1 otherwise)."""

    def __init__(self, slots: list[tuple]):
        self.families: list[tuple] = []
        self.parts: list[list] = []                 # family id -> its parts, by bit
        self.ranks_of: list[list[set]] = []         # family id -> bit -> every rank seen
        family_ids: dict[tuple, int] = {}
        part_bits: list[dict] = []
        self.family = np.zeros(len(slots), dtype=np.int64)
        self.bit = np.zeros(len(slots), dtype=np.int64)
        self.rank = np.full(len(slots), -1, dtype=np.int64)
        for slot_id, (family, part, rank, _) in enumerate(slots):
            if (family_id := family_ids.get(family)) is None:
                family_id = family_ids[family] = len(self.families)
                self.families.append(family)
                self.parts.append([])
                self.ranks_of.append([])
                part_bits.append({})
            bits = part_bits[family_id]
            key = repr(part)
            if key not in bits:
                bits[key] = len(self.parts[family_id])
                self.parts[family_id].append(part)
                self.ranks_of[family_id].append(set())
            self.family[slot_id] = family_id
            self.bit[slot_id] = bits[key]
            self.ranks_of[family_id][bits[key]].add(rank)
            if len(rank) == 1 and isinstance(rank[0], int) and rank[0] >= 0:
                self.rank[slot_id] = rank[0]
        self.words = max(1, max(((len(parts) + 63) // 64 for parts in self.parts), default=1))


def _bit(masks: np.ndarray, bit: int) -> np.ndarray:
    return (masks[:, bit // 64] >> np.uint64(bit % 64)) & np.uint64(1)


def _companion_masks(masks: np.ndarray, parts: int, words: int) -> list[np.ndarray]:
    """bit p -> the mask of the parts published wherever p is (the companions of the module's docstring):
    q is a companion of p when q is in at least COMPANION_SHARE of the chunks holding p, and p is
    in at least COMPANION_MIN_CHUNKS. One-way."""
    present = [_bit(masks, p).astype(bool) for p in range(parts)]
    companions = []
    for p in range(parts):
        mask = np.zeros(words, dtype=np.uint64)
        holding = int(present[p].sum())
        if holding >= COMPANION_MIN_CHUNKS:
            for q in range(parts):
                if q != p and int((present[p] & present[q]).sum()) >= COMPANION_SHARE * holding:
                    mask[q // 64] |= np.uint64(1 << (q % 64))
        companions.append(mask)
    return companions


def _judge(index: ChunkIndex) -> ChunkJudgement:
    judgement = ChunkJudgement(names=index.names)
    n = len(index)
    if n == 0:
        judgement.summary = {"chunks": 0, "complete": 0, "incomplete": 0, "members_missing": 0, "stores": []}
        return judgement
    slots = _Slots(index.slots)
    chunk = np.frombuffer(index.chunk, dtype=np.int64)
    slot = np.frombuffer(index.slot, dtype=np.int32 if index.slot.itemsize == 4 else np.int64).astype(np.int64)
    worlds = np.array([-1 if world is None else world for *_, world in index.slots], dtype=np.int64)
    order = np.argsort(chunk, kind="stable")
    sorted_chunk = chunk[order]
    starts = np.flatnonzero(np.r_[True, sorted_chunk[1:] != sorted_chunk[:-1]])
    chunks = len(starts)
    group = np.repeat(np.arange(chunks), np.diff(np.r_[starts, n]))      # chunk number of each sorted row
    sorted_slot = slot[order]
    first_slot = sorted_slot[starts]                                     # the chunk's first-listed member
    chunk_family = slots.family[first_slot]
    chunk_world = worlds[first_slot]

    words = slots.words
    bits = slots.bit[sorted_slot]
    masks = np.zeros((chunks, words), dtype=np.uint64)
    for word in range(words):
        in_word = (bits // 64) == word
        values = np.where(in_word, np.left_shift(np.uint64(1), (bits % 64).astype(np.uint64)), np.uint64(0))
        masks[:, word] = np.bitwise_or.reduceat(values.astype(np.uint64), starts)

    # distinct (chunk, slot) present, and those whose rank is one the chunk expects
    pairs = np.unique(group * len(index.slots) + sorted_slot)
    pair_chunk, pair_slot = pairs // len(index.slots), pairs % len(index.slots)
    world = chunk_world[pair_chunk]
    in_expected = (world < 0) | ((slots.rank[pair_slot] >= 0) & (slots.rank[pair_slot] < world))
    have = np.bincount(pair_chunk, weights=in_expected, minlength=chunks)

    needed = np.zeros(chunks, dtype=np.int64)
    expected_masks = masks.copy()
    for family_id, parts in enumerate(slots.parts):
        in_family = chunk_family == family_id
        if not in_family.any():
            continue
        family_masks = masks[in_family]
        expected = family_masks.copy()
        producer = producer_of(slots.families[family_id][0])
        if producer.every_part:
            for p in range(len(parts)):
                expected[:, p // 64] |= np.uint64(1 << (p % 64))
        trailing = np.zeros(words, dtype=np.uint64)  # parts the producer writes at some pages only
        for q, part in enumerate(parts):
            if producer.trailing_only(part):
                trailing[q // 64] |= np.uint64(1 << (q % 64))
        for p, companion in enumerate(_companion_masks(family_masks, len(parts), words)):
            companion &= ~trailing
            if companion.any():
                holds = _bit(family_masks, p).astype(bool)
                expected[holds] |= companion
        family_world = chunk_world[in_family]
        counts = np.zeros(len(family_masks), dtype=np.int64)
        for p in range(len(parts)):
            per_part = np.where(family_world >= 0, family_world, len(slots.ranks_of[family_id][p]))
            counts += _bit(expected, p).astype(np.int64) * per_part
        needed[in_family] = counts
        expected_masks[in_family] = expected

    incomplete = np.flatnonzero(have < needed)
    missing_members = 0
    for number in incomplete:
        start = starts[number]
        stop = starts[number + 1] if number + 1 < chunks else n
        entries = order[start:stop]
        missing = _missing(slots, index, entries, expected_masks[number], int(chunk_world[number]))
        missing_members += len(missing)
        for entry in entries:
            judgement.missing_rows[index.rows[entry]] = missing
    judgement.outlier_rows = _size_outliers(index, slot)
    judgement.summary = {"chunks": chunks, "complete": chunks - len(incomplete), "incomplete": len(incomplete),
                         "members_missing": missing_members, "stores": _store_statistics(index, slots, slot)}
    return judgement


def _missing(slots: _Slots, index: ChunkIndex, entries: np.ndarray, expected_mask: np.ndarray,
             world: int) -> list[dict]:
    """One incomplete chunk's missing members, as the producer names them."""
    first = index.slots[index.slot[entries[0]]]
    family_id = int(slots.family[index.slot[entries[0]]])
    producer = producer_of(first[0][0])
    present: dict[int, set] = defaultdict(set)
    for entry in entries:
        slot_id = index.slot[entry]
        present[int(slots.bit[slot_id])].add(index.slots[slot_id][2])
    parts = slots.parts[family_id]
    expected = [p for p in range(len(parts)) if int(_bit(expected_mask[None, :], p)[0])]
    missing = []
    for p in sorted(expected, key=lambda p: repr(parts[p])):
        ranks = {(rank,) for rank in range(world)} if world >= 0 else slots.ranks_of[family_id][p]
        for rank in sorted(ranks - present.get(p, set())):
            missing.append(producer.member_fields(parts[p], rank))
    return missing


def _size_outliers(index: ChunkIndex, slot: np.ndarray) -> dict[int, dict]:
    """Within each (family, part, rank) of a fixed-size producer: keys whose size is not the one
    more than half of them hold."""
    sizes = np.frombuffer(index.size, dtype=np.int64)
    fixed = np.array([producer_of(family[0]).fixed_size for family, *_ in index.slots], dtype=bool)
    considered = fixed[slot] & (sizes > 0)
    outliers = {}
    if not considered.any():
        return outliers
    entries = np.flatnonzero(considered)
    order = entries[np.lexsort((sizes[entries], slot[entries]))]
    sorted_slot = slot[order]
    starts = np.flatnonzero(np.r_[True, sorted_slot[1:] != sorted_slot[:-1]])
    for number, start in enumerate(starts):
        stop = starts[number + 1] if number + 1 < len(starts) else len(order)
        members = order[start:stop]
        values, counts = np.unique(sizes[members], return_counts=True)
        if len(values) < 2:
            continue
        dominant, count = int(values[counts.argmax()]), int(counts.max())
        if count <= DOMINANT_SHARE * len(members):
            continue  # no size a majority holds (nothing to call the producer's own)
        for entry in members[sizes[members] != dominant]:
            outliers[index.rows[entry]] = {"size": int(sizes[entry]), "dominant_size": dominant,
                                           "keys_with_dominant_size": count, "keys": len(members)}
    return outliers


def _store_statistics(index: ChunkIndex, slots: _Slots, slot: np.ndarray) -> list[dict]:
    """Sizes per (family, part), so that two revisions or dtypes under one name stand out."""
    sizes = np.frombuffer(index.size, dtype=np.int64)
    part_of_slot = np.array([int(slots.family[s]) * 1_000_003 + int(slots.bit[s]) for s in range(len(index.slots))],
                            dtype=np.int64)
    parts = part_of_slot[slot]
    rows = []
    for key in np.unique(parts):
        family_id, bit = divmod(int(key), 1_000_003)
        in_part = sizes[parts == key]
        values, first, counts = np.unique(in_part, return_index=True, return_counts=True)
        ordered = sorted(zip(values, first, counts), key=lambda item: (-item[2], item[1]))
        family, part = slots.families[family_id], slots.parts[family_id][bit]
        scheme, *identity = family
        rows.append(((repr(family), repr(part)), {
            "scheme": scheme, "family": [value for value in identity if value not in (None, "")], "part": part,
            "keys": int(in_part.size),
            "sizes": {str(None if size < 0 else int(size)): int(count) for size, _, count in ordered}}))
    return [row for _, row in sorted(rows, key=lambda item: item[0])]


def _rank_mixups(candidates: list[KeyRecord], index: ChunkIndex, listed) -> dict[int, dict]:
    """Ranks of one chunk and part holding identical non-zero bytes: a shard stored as another's.
    `candidates`: the records that share their bytes with another; `listed(record)`: whether the
    record's key is one the index holds. Keyed by id(record)."""
    by_content: dict[tuple, list[tuple[KeyRecord, Member]]] = defaultdict(list)
    for record in candidates:
        member = member_of(record.parsed_fields())
        if (member is not None and member.world is None and record.xxh3 is not None and record.size
                and not record.zero and listed(record)):
            by_content[(member.chunk, repr(member.part), record.size, record.xxh3)].append((record, member))
    suspects = {}
    for same in by_content.values():
        if len({member.rank for _, member in same}) < 2:
            continue
        for record, _ in same:
            others = [other.key for other, _ in same if other.key != record.key]
            suspects[id(record)] = {"same_bytes_as": others[:MISSING_EXAMPLES]}
    return suspects


CHUNK_VERDICTS = (Verdict.INCOMPLETE_CHUNK, Verdict.IDENTITY_SUSPECT)
CHUNK_EVIDENCE = ("incomplete_chunk", "identity")


def clear_chunk_verdicts(records: Iterable[KeyRecord]) -> None:
    """Undo an earlier `mark_chunks` (merging shards' reports judges again)."""
    for record in records:
        for verdict in CHUNK_VERDICTS:
            if verdict in record.verdicts and not (verdict == Verdict.IDENTITY_SUSPECT
                                                   and IDENTITY_EVIDENCE in record.evidence):
                record.verdicts.remove(verdict)
        for name in CHUNK_EVIDENCE:
            record.evidence.pop(name, None)


def mark_chunks(ledger, candidates: list[KeyRecord], index: ChunkIndex | None) -> dict | None:
    """Set INCOMPLETE_CHUNK and IDENTITY_SUSPECT on the records of `ledger` (a RecordLedger); the
    summary's `chunks`. `candidates`: its records that share their bytes with another (rank
    mixups are among them). `index`: the listing's keys; without one, the records' own keys."""
    clear_chunk_verdicts(ledger.kept())
    if index is None:
        index = ChunkIndex.of_table(ledger.table)
    if not len(index):
        return None
    judgement = index.judge()
    rows = set(judgement.missing_rows) | set(judgement.outlier_rows)
    if index.table is ledger.table:  # the listing's table is the ledger's: records name their rows
        targets = [(record, record.ordinal) for record in ledger.at_ordinals(rows)]
        ordinals = np.array(sorted({record.ordinal for record in candidates if record.ordinal is not None}),
                            dtype=np.int64)
        indexed = set(ordinals[index.holds(ordinals)].tolist())

        def listed(record):
            return record.ordinal in indexed
    else:
        by_name = {index.names(row): row for row in rows}
        targets = [(record, by_name[record.key]) for record in ledger.with_names(set(by_name))]

        def listed(record):
            return True
    mixups = _rank_mixups(candidates, index, listed)
    for record, row in targets:
        missing = judgement.missing_rows.get(row)
        if missing:
            record.verdicts.append(Verdict.INCOMPLETE_CHUNK)
            record.evidence["incomplete_chunk"] = {"members_missing": len(missing),
                                                   "missing": missing[:MISSING_EXAMPLES]}
    outliers = {id(record): judgement.outlier_rows[row] for record, row in targets if row in judgement.outlier_rows}
    marked = {id(record): record for record, _ in targets}
    marked.update((id(record), record) for record in candidates if id(record) in mixups)
    for key, record in marked.items():
        identity = {}
        if key in outliers:
            identity["size_outlier"] = outliers[key]
        if key in mixups:
            identity["rank_mixup"] = mixups[key]
        if identity:
            record.evidence["identity"] = identity
            # a size its layout already refused is SIZE_MISMATCH: the outlier is evidence for it
            if ((Verdict.SIZE_MISMATCH not in record.verdicts or "rank_mixup" in identity)
                    and Verdict.IDENTITY_SUSPECT not in record.verdicts):
                record.verdicts.append(Verdict.IDENTITY_SUSPECT)
    return judgement.summary
