"""Identical bytes under distinct keys: a finding (SHARED_CONTENT), or what the keys' producer
writes by design (EXPECTED_DUPLICATE), decided by asking the producer (docs/producers.md).

A group of keys with identical non-zero bytes (same size and XXH3-64) is expected when its keys
are one producer's, of equal `content` (they differ only in what the producer says leaves the
bytes alone), and
- held by one worker (LMCache: the same chunk under other tags), or
- held by several workers that are copies of one replicated head: one aligned block of `r`
  workers (equal ``worker // r``), `r` being the family's replication. With a model config, `r`
  is ``world_size // num_key_value_heads``; without one, it is the block size that more than half
  of the family's fully-read chunks show. A family with one chunk cannot tell a replicated head
  from one worker's shard stored as another's: such a group passes.
Every other group is SHARED_CONTENT: null-backed keys, a copy bug.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Iterable

from audit.layouts.hf_config import model_type_of
from audit.producers import member_of, producer_of
from audit.records import KeyRecord, Verdict

EXAMPLES = 5  # other keys named in each member's evidence
Replication = Callable[[dict], int | None]  # a key's fields -> its model's replication factor, if known


def replication_from(configs: dict[str, dict]) -> Replication | None:
    """From model configs (model name -> HuggingFace config): a key's replication factor, the
    world size over the KV-head count (1 where each worker holds its own heads). A key's model is
    matched by its last path component, as a config directory names its model."""
    heads = {}
    for name, config in configs.items():
        text, _ = model_type_of(config)
        count = text.get("num_key_value_heads") or text.get("num_attention_heads")
        if isinstance(count, int) and count > 0:
            heads[name.rstrip("/").split("/")[-1]] = count
    if not heads:
        return None

    def replication(fields: dict) -> int | None:
        count = heads.get(str(fields.get("model", "")).rstrip("/").split("/")[-1])
        world = fields.get("world_size")
        if count is None or not isinstance(world, int) or world < 1:
            return None
        return world // count if count < world and world % count == 0 else 1
    return replication


def _content_groups(records: list[KeyRecord]) -> list[tuple[int, int, list[KeyRecord]]]:
    by_content: dict[tuple[int, int], list[KeyRecord]] = defaultdict(list)
    for record in records:
        if record.xxh3 is not None and record.size and not record.zero:
            by_content[(record.size, record.xxh3)].append(record)
    return [(size, digest, members) for (size, digest), members in by_content.items() if len(members) > 1]


def _block_size(workers: dict[int, int], world: int) -> int:
    """The replication a fully-read chunk shows (worker -> digest): r when its workers fall into
    aligned blocks of r holding one digest each (1: no two alike), 0 when they fall otherwise."""
    blocks = defaultdict(set)
    for worker, digest in workers.items():
        blocks[digest].add(worker)
    sizes = {len(block) for block in blocks.values()}
    if len(sizes) != 1:
        return 0
    r = sizes.pop()
    aligned = all(len({worker // r for worker in block}) == 1 for block in blocks.values())
    return r if aligned and world % r == 0 else 0


def _shown_replication(records: list[KeyRecord], fields_of: Callable[[KeyRecord], dict]) -> dict[tuple, int]:
    """family -> the block size that more than half of its fully-read chunks show, for the
    families whose producer has replicas."""
    chunks: dict[tuple, dict[int, int]] = defaultdict(dict)
    worlds: dict[tuple, int] = {}
    for record in records:
        if record.xxh3 is None:
            continue
        fields = fields_of(record)
        producer = producer_of(fields.get("scheme"))
        replica = producer.replica(fields) if producer is not None else None
        member = member_of(fields) if replica is not None else None
        if member is None:
            continue
        slot = (member.family, member.chunk, repr(member.part))
        chunks[slot].setdefault(replica[0], record.xxh3)
        worlds[slot] = replica[1]
    shown: dict[tuple, Counter] = defaultdict(Counter)
    for slot, workers in chunks.items():
        if len(workers) == worlds[slot]:
            shown[slot[0]][_block_size(workers, worlds[slot])] += 1
    replication = {}
    for family, counts in shown.items():
        (r, count), = counts.most_common(1)
        if count > sum(counts.values()) / 2:
            replication[family] = r
    return replication


def _differing(fields: list[dict]) -> list[str]:
    names = set().union(*fields)
    return sorted(name for name in names if len({repr(other.get(name)) for other in fields}) > 1)


def _why_expected(fields: list[dict], replication_of: Callable[[dict], tuple[int | None, str]]) -> str | None:
    """Why the group's identical bytes are by design, or None (a finding)."""
    producer = producer_of(fields[0].get("scheme"))
    if producer is None or any(other.get("scheme") != producer.scheme for other in fields):
        return None
    contents = {producer.content(other) for other in fields}
    if len(contents) != 1 or None in contents:
        return None
    differ = ", ".join(_differing(fields))
    workers = {replica[0] for other in fields if (replica := producer.replica(other)) is not None}
    if len(workers) < 2:
        return f"one chunk, one worker: the keys differ only in {differ}"
    r, source = replication_of(fields[0])
    if r is None or r < 2 or len({worker // r for worker in workers}) != 1:
        return None
    return f"copies of one replicated KV head (workers {sorted(workers)}, one block of {r} {source}): the keys differ only in {differ}"


def clear_duplicate_verdicts(records: Iterable[KeyRecord]) -> None:
    """Undo an earlier `mark_duplicates` (merging shards' reports judges again)."""
    for record in records:
        for verdict, evidence in ((Verdict.SHARED_CONTENT, "shared_content"),
                                  (Verdict.EXPECTED_DUPLICATE, "expected_duplicate")):
            if verdict in record.verdicts:
                record.verdicts.remove(verdict)
            record.evidence.pop(evidence, None)


def mark_duplicates(records: list[KeyRecord], replication: Replication | None = None,
                    everyone: Callable[[], Iterable[KeyRecord]] | None = None) -> tuple[list[dict], list[dict]]:
    """Set SHARED_CONTENT or EXPECTED_DUPLICATE on `records` (idempotently); the groups of each.
    `replication`: the model config's replication factor for a key's fields, where one is given.
    `everyone`: every record of the run, where `records` holds only those sharing their bytes
    (the chunks a family shows need them all); by default, `records`."""
    clear_duplicate_verdicts(records)
    parsed: dict[str, dict] = {}
    shown: dict[tuple, int] | None = None

    def fields_of(record: KeyRecord) -> dict:
        if record.key not in parsed:
            parsed[record.key] = record.parsed_fields()
        return parsed[record.key]

    def replication_of(fields: dict) -> tuple[int | None, str]:
        nonlocal shown
        configured = replication(fields) if replication is not None else None
        if configured is not None:
            return configured, "by the model config"
        if shown is None:
            shown = _shown_replication(everyone() if everyone else records, fields_of)
        member = member_of(fields)
        return (None if member is None else shown.get(member.family)), "as most of its chunks show"

    shared: list[dict] = []
    expected: list[dict] = []
    for size, digest, members in _content_groups(records):
        why = _why_expected([fields_of(member) for member in members], replication_of)
        groups, verdict, name = ((expected, Verdict.EXPECTED_DUPLICATE, "expected_duplicate") if why
                                 else (shared, Verdict.SHARED_CONTENT, "shared_content"))
        names = [member.key for member in members]
        group = {"group": len(groups), "size": size, "xxh3": f"{digest:016x}", "keys": names,
                 **({"reason": why} if why else {})}
        for member in members:
            member.verdicts.append(verdict)
            member.evidence[name] = {"group": group["group"], "keys_in_group": len(members),
                                     "others": [other for other in names if other != member.key][:EXAMPLES],
                                     **({"reason": why} if why else {})}
        groups.append(group)
    return shared, expected
