"""The producer simulator: publish a labelled workload exactly as vLLM with bug #53084 would.

For each request: seeded tokens, a seeded align-mode step schedule, the sparse block table it
implies, chained chunk hashes, and the real Mamba states at every boundary a step ended on. For
every full chunk and TP rank the buggy connector publishes one key: a real block's bytes are the
state at that boundary; a null entry's bytes are block 0's, identical for every null-backed key of
a rank (zeros, or seeded garbage with ``null_block_fill="garbage"``). Options damage some good
keys (NaN, truncation, zeroed layers) and add tricky good ones; ``labels.jsonl`` says which is
which and what an auditor must report.

``build_workload`` computes everything without a store (deterministic for a seed);
``simulate`` publishes it and writes the files.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from audit.blocktables import NULL_BLOCK_ID
from audit.connection import Settings
from audit.errors import AuditError
from audit.keys import vllm_key
from audit.layouts import Layout, dump_layout_file, layouts_from_hf_config
from audit.workload import Publisher

from .align import BlockPool, align_block_table, plan_steps
from .chunks import chunk_hashes
from .encoding import encode_value, random_states, state_dtypes
from .faults import TRICKY_VARIANTS, tricky, truncated, with_nan, with_zeroed_layers
from .labels import CAUSES, NULL_BLOCK_FILLS, Label, write_labels
from .recurrence import VOCABULARY, LayerStates, MambaModel

PUT_BATCH_BYTES = 8 << 20  # put_batch stages a whole batch in the Publisher's 16 MiB buffer
EXIST_BATCH_KEYS = 1000


@dataclass(frozen=True)
class SimulationOptions:
    """What to simulate. The defaults make a small workload: 2 requests x 3000 tokens in chunks of
    128 (23 keys per request and TP rank), about half of them null-backed, no other damage.

    ``null_boundaries``: token counts that must be null-backed (multiples of ``block_size``;
    ``REPORTED_NULL_BOUNDARIES`` with ``block_size=16`` and ``tokens >= 3025`` reproduces the
    report). ``real_fraction``: share of the other boundaries where a step ends (real blocks).
    ``inject_nan``, ``truncate``, ``zero_layers``, ``tricky_good``: how many good keys get each
    treatment (disjoint sets; there must be enough good keys).
    """

    requests: int = 2
    tokens: int = 3000
    block_size: int = 128
    tp_size: int = 1
    seed: int = 0
    cache_prefix: str = ""
    state_dtype: str = "bfloat16"
    ssm_dtype: str | None = None
    real_fraction: float = 0.5
    null_boundaries: tuple[int, ...] = ()
    null_block_fill: str = "zero"
    inject_nan: int = 0
    truncate: int = 0
    zero_layers: int = 0
    tricky_good: int = 0

    def validate(self) -> None:
        for name in ("requests", "tokens", "block_size", "tp_size"):
            if getattr(self, name) < 1:
                raise AuditError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("seed", "inject_nan", "truncate", "zero_layers", "tricky_good"):
            if getattr(self, name) < 0:
                raise AuditError(f"{name} must not be negative, got {getattr(self, name)}")
        if self.tokens < self.block_size:
            raise AuditError(f"tokens ({self.tokens}) must cover at least one block ({self.block_size})")
        if not 0 <= self.real_fraction <= 1:
            raise AuditError(f"real_fraction must be within [0, 1], got {self.real_fraction}")
        if self.null_block_fill not in NULL_BLOCK_FILLS:
            raise AuditError(f"null_block_fill must be one of {NULL_BLOCK_FILLS}, "
                             f"got {self.null_block_fill!r}")


@dataclass(frozen=True)
class WorkloadEntry:
    """One key to publish: its bytes and its ground truth."""

    label: Label
    value: np.ndarray  # uint8


@dataclass(frozen=True)
class Workload:
    """Everything a simulation publishes and writes, computed without a store."""

    layout: Layout
    entries: tuple[WorkloadEntry, ...]
    block_tables: tuple[dict, ...]  # per (request, TP rank), in audit/blocktables.py's shape

    def counts(self) -> dict[str, int]:
        """Keys per cause ("good" for keys with no cause)."""
        counts = {cause or "good": 0 for cause in CAUSES}
        for entry in self.entries:
            counts[entry.label.cause or "good"] += 1
        return counts


@dataclass(frozen=True)
class SimulationResult:
    """What ``simulate`` published (keys in publishing order, with their labels) and where its
    files are: pass ``block_tables_path`` (or its directory) and ``layout_path`` to an audit."""

    layout: Layout
    labels: tuple[Label, ...]
    counts: dict[str, int]
    bytes_published: int
    block_tables_path: Path
    labels_path: Path
    layout_path: Path

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(label.key for label in self.labels)


@dataclass
class _Chunk:
    """A key before its cause is decided: where it comes from, and its rank's states if real."""

    key: str
    req_id: str
    tp_rank: int
    boundary: int
    block_id: int
    states: list[LayerStates] | None
    cause: str | None = None
    tricky_variant: str = ""


def _rng(seed: int, purpose: str, *more: int) -> np.random.Generator:
    """An independent seeded stream per purpose, so changing one option leaves others' draws alone."""
    return np.random.default_rng([seed, zlib.crc32(purpose.encode()), *more])


def _layout(model_config: dict, model: str, options: SimulationOptions) -> Layout:
    layouts = layouts_from_hf_config(model_config, model=model, tp_size=options.tp_size,
                                     state_dtype=options.state_dtype, ssm_dtype=options.ssm_dtype)
    if len(layouts) != 1 or layouts[0].kind not in ("mamba1", "mamba2"):
        raise AuditError("the simulator models pure Mamba1/Mamba2 models (one KV-cache group)")
    return layouts[0]


def _plan_chunks(recurrent: MambaModel, layout: Layout,
                 options: SimulationOptions) -> tuple[list[_Chunk], list[dict]]:
    """Every (request, TP rank, full chunk) key, its block, its states; and the block tables."""
    chunks_per_request = options.tokens // options.block_size
    pool = BlockPool(options.requests * chunks_per_request, _rng(options.seed, "pool"))
    chunks, tables = [], []
    for index in range(options.requests):
        req_id = f"sim-{options.seed}-{index}"
        tokens = _rng(options.seed, "tokens", index).integers(0, VOCABULARY, options.tokens)
        schedule = plan_steps(options.tokens, options.block_size, _rng(options.seed, "steps", index),
                              null_boundaries=options.null_boundaries, real_fraction=options.real_fraction)
        block_ids = align_block_table(schedule, pool)
        hashes = chunk_hashes(tokens, options.block_size, options.seed)
        real = [b for b, block in zip(schedule.boundaries, block_ids) if block != NULL_BLOCK_ID]
        states = recurrent.states_at(tokens, real)
        for rank in range(options.tp_size):
            tables.append({"req_id": req_id, "model": layout.model, "tp_rank": rank, "pp_rank": 0,
                           "pcp": 0, "dcp": 0, "cache_prefix": options.cache_prefix,
                           "group": layout.group, "block_size": options.block_size,
                           "block_ids": block_ids, "chunk_hashes": hashes})
            for boundary, block_id, chunk_hash in zip(schedule.boundaries, block_ids, hashes):
                key = vllm_key(layout.model, chunk_hash, tp_rank=rank, group=layout.group,
                               cache_prefix=options.cache_prefix)
                shard = (None if block_id == NULL_BLOCK_ID
                         else recurrent.shard(states[boundary], rank, options.tp_size))
                chunks.append(_Chunk(key, req_id, rank, boundary, block_id, shard,
                                     "null_block" if block_id == NULL_BLOCK_ID else None))
    return chunks, tables


def _assign_faults(chunks: list[_Chunk], options: SimulationOptions, rng: np.random.Generator) -> None:
    """Pick disjoint sets of good chunks for each requested treatment."""
    wanted = [("nan", options.inject_nan), ("truncated", options.truncate),
              ("zeroed_layer", options.zero_layers), ("tricky_good", options.tricky_good)]
    good = [chunk for chunk in chunks if chunk.cause is None]
    total = sum(count for _, count in wanted)
    if total > len(good):
        raise AuditError(f"{total} keys to damage or make tricky, but only {len(good)} good keys: "
                         f"raise tokens, requests or real_fraction")
    order = iter(rng.permutation(len(good)))
    for cause, count in wanted:
        for number in range(count):
            chunk = good[next(order)]
            chunk.cause = cause
            if cause == "tricky_good":
                chunk.tricky_variant = TRICKY_VARIANTS[number % len(TRICKY_VARIANTS)]


def _null_block_value(layout: Layout, options: SimulationOptions, tp_rank: int) -> np.ndarray:
    """Block 0 of one rank's cache: zeros (torch.zeros), or garbage some kernel left there."""
    if options.null_block_fill == "zero":
        return np.zeros(layout.size, np.uint8)
    return encode_value(layout, random_states(layout, _rng(options.seed, "null-block", tp_rank)))


def _entry(chunk: _Chunk, layout: Layout, options: SimulationOptions, null_values: list[np.ndarray],
           rng: np.random.Generator) -> WorkloadEntry:
    """The bytes the buggy connector publishes for this chunk, after any requested treatment."""
    detail = ""
    if chunk.cause == "null_block":
        value = null_values[chunk.tp_rank]
        detail = f"block 0 ({options.null_block_fill})"
    elif chunk.cause == "nan":
        states, detail = with_nan(chunk.states, rng)
        value = encode_value(layout, states)
    elif chunk.cause == "zeroed_layer":
        states, detail = with_zeroed_layers(chunk.states, rng)
        value = encode_value(layout, states)
    elif chunk.cause == "tricky_good":
        states, detail = tricky(chunk.states, chunk.tricky_variant, state_dtypes(layout), rng)
        value = encode_value(layout, states)
    else:
        value = encode_value(layout, chunk.states)
        if chunk.cause == "truncated":
            value = truncated(value)
            detail = f"{layout.size - value.size} bytes cut from the end"
    label = Label.for_key(chunk.key, chunk.cause, null_block_fill=options.null_block_fill,
                          req_id=chunk.req_id, tp_rank=chunk.tp_rank, boundary=chunk.boundary,
                          block_id=chunk.block_id, detail=detail)
    return WorkloadEntry(label, value)


def build_workload(model_config: dict, model: str,
                   options: SimulationOptions = SimulationOptions()) -> Workload:
    """The keys, bytes, labels and block tables of a simulation, without touching a store.

    ``model_config``: a Hugging Face ``config.json`` of a pure Mamba1/Mamba2 model (see
    ``audit.simulate.configs``); ``model``: the model path or name (its basename goes in keys).
    """
    options.validate()
    layout = _layout(model_config, model, options)
    recurrent = MambaModel(model_config, options.seed)
    chunks, tables = _plan_chunks(recurrent, layout, options)
    null_per_rank = sum(1 for chunk in chunks if chunk.cause == "null_block") // options.tp_size
    if options.null_block_fill == "garbage" and null_per_rank < 2:
        raise AuditError(f"garbage-filled null blocks are only SHARED_CONTENT with two or more "
                         f"null-backed keys per rank, got {null_per_rank}: lower real_fraction")
    rng = _rng(options.seed, "faults")
    _assign_faults(chunks, options, rng)
    null_values = [_null_block_value(layout, options, rank) for rank in range(options.tp_size)]
    entries = tuple(_entry(chunk, layout, options, null_values, rng) for chunk in chunks)
    return Workload(layout, entries, tuple(tables))


def _check_absent(publisher: Publisher, keys: list[str]) -> None:
    """Refuse keys already in the store: Mooncake keeps the old bytes (as the connector's
    batch_is_exist dedup does), so the labels would not describe them."""
    present = 0
    for start in range(0, len(keys), EXIST_BATCH_KEYS):
        answers = publisher.store.batch_is_exist(keys[start:start + EXIST_BATCH_KEYS])
        if any(answer < 0 for answer in answers):
            raise AuditError("batch_is_exist failed while checking the workload's keys")
        present += sum(answers)
    if present:
        raise AuditError(f"{present} of the workload's {len(keys)} keys are already in the store "
                         f"(same seed and cache_prefix as an earlier run?); use another cache_prefix")


def _publish(publisher: Publisher, entries: tuple[WorkloadEntry, ...]) -> int:
    """put_batch in batches that fit the Publisher's staging buffer; the bytes published."""
    _check_absent(publisher, [entry.label.key for entry in entries])
    batch: list[WorkloadEntry] = []

    def flush() -> None:
        rc = publisher.store.put_batch([entry.label.key for entry in batch], [entry.value for entry in batch])
        if rc != 0:
            raise AuditError(f"publishing {len(batch)} simulated keys failed ({rc})")
        batch.clear()

    for entry in entries:
        if batch and sum(item.value.nbytes for item in batch) + entry.value.nbytes > PUT_BATCH_BYTES:
            flush()
        batch.append(entry)
    if batch:
        flush()
    return sum(entry.value.nbytes for entry in entries)


def _write_files(workload: Workload, out_dir: Path) -> tuple[Path, Path, Path]:
    """``block-tables/requests.jsonl`` (a directory of its own, so it can be passed whole),
    ``labels.jsonl`` and ``layout.json`` (the layout file of the simulated values)."""
    tables_path = out_dir / "block-tables" / "requests.jsonl"
    tables_path.parent.mkdir(parents=True, exist_ok=True)
    with open(tables_path, "w", encoding="utf-8") as handle:
        for record in workload.block_tables:
            handle.write(json.dumps(record) + "\n")
    labels_path = out_dir / "labels.jsonl"
    write_labels(labels_path, (entry.label for entry in workload.entries))
    layout_path = out_dir / "layout.json"
    layout_path.write_text(json.dumps(dump_layout_file([workload.layout]), indent=2) + "\n")
    return tables_path, labels_path, layout_path


def simulate(target: Settings | Publisher, *, model_config: dict, model: str, out_dir: str | Path,
             options: SimulationOptions = SimulationOptions()) -> SimulationResult:
    """Build the workload, write its block tables, labels and layout under ``out_dir``, and
    publish every key into the cluster ``target`` names (a Publisher is used as is; Settings
    open one for the call). Raises AuditError for bad options or keys already present."""
    workload = build_workload(model_config, model, options)
    tables_path, labels_path, layout_path = _write_files(workload, Path(out_dir))
    publisher = Publisher(target) if isinstance(target, Settings) else target
    try:
        published = _publish(publisher, workload.entries)
    finally:
        if publisher is not target:
            publisher.close()
    return SimulationResult(layout=workload.layout, labels=tuple(e.label for e in workload.entries),
                            counts=workload.counts(), bytes_published=published,
                            block_tables_path=tables_path, labels_path=labels_path,
                            layout_path=layout_path)
