"""`mooncake-audit verify`: production values compared with a reference producer's recomputation.

List every key once; split it into reference keys (the reference producer's cache prefix) and
production keys; pair them (`pairing`); read each pair with lease reads into registered buffers;
compare region by region with the layout (`compare`); run the usual per-key checks on the
production value too. Production keys without a twin are "unverified" (counted, not flagged, the
first 100 named with the reason: `Pairing.unverified_summary`); reference keys without a production
twin are counted as coverage (summary ``verify``).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone

from audit.checks.host import HostChecker
from audit.connection import AdminClient, Settings, open_store
from audit.errors import AuditError
from audit.judge.merge import merge_records
from audit.judge.plan import CheckPlan
from audit.layouts import summarize
from audit.readers.buffers import MAX_KEYS_PER_BATCH, Slot, _aligned
from audit.readers.lease import LeaseReader
from audit.records import KeyInfo, KeyRecord, Report, Verdict
from audit.run.scan import check_batch
from audit.sources.listing import AdminListing, KeyFilter
from audit.sources.selection import select_keys
from audit.verify.compare import PairResult, Tolerances, compare_values
from audit.verify.pairing import NOT_CUT, NOT_PUBLISHED, PROMPT_NOT_GIVEN, Pairing, normalize_prefix, pair_keys


@dataclass
class VerifyOptions:
    reference_prefix: str
    plan: CheckPlan = field(default_factory=CheckPlan)
    prefix: str = ""
    match: str | None = None
    tolerances: Tolerances = field(default_factory=Tolerances)
    sample: int | float | None = None
    seed: int = 0
    buffer_mb: int = 64
    reference_run: dict | None = None     # what the reference engine did (`--engine`), for the summary


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _filter(options: VerifyOptions):
    try:
        pattern = re.compile(options.match) if options.match else None
    except re.error as error:
        raise AuditError(f"--match is not a regular expression: {error}") from None
    return KeyFilter(options.prefix, pattern)


def _pair_records(fetched, plan: CheckPlan, tolerances: Tolerances, stats: dict) -> list[KeyRecord]:
    """One batch of (production, reference) slots, interleaved: compare, then the usual checks."""
    slots, results = fetched.slots, fetched.results
    comparisons: dict[int, tuple[PairResult | None, str]] = {}
    for i in range(0, len(slots), 2):
        production, reference = slots[i], slots[i + 1]
        ok = all(code >= 0 and code == slot.key.size for slot, code in ((production, results[i]),
                                                                         (reference, results[i + 1])))
        if not ok:
            comparisons[i] = (None, reference.key.name)
            continue
        layout = plan.layout_for(production.key)
        result = compare_values(fetched.view(production, production.key.size),
                                fetched.view(reference, reference.key.size), layout, tolerances)
        comparisons[i] = (result, reference.key.name)
    records = check_batch(fetched, HostChecker(), plan)  # releases the batch
    out = []
    for i in range(0, len(slots), 2):
        record, reference_record = records[i], records[i + 1]
        result, reference_key = comparisons[i]
        if result is None:
            if reference_record.is_incomplete and not record.is_incomplete:
                record.evidence["verify"] = {"reference_key": reference_key,
                                             "reference_unread": reference_record.verdicts}
                stats["reference_unread"] += 1
            out.append(record)
            continue
        _count(stats, result)
        if result.divergent:
            record.verdicts.append(Verdict.DIVERGENT_STATE)
            record.evidence["divergent_state"] = result.evidence(reference_key, tolerances)
        else:
            record.evidence["verify"] = {"reference_key": reference_key,
                                         **{k: v for k, v in result.evidence(reference_key, tolerances).items()
                                            if k in ("compared", "max_rel_l2", "min_cosine", "max_abs",
                                                     "worst_layer")}}
        if record.fields is None and record.verdicts:
            record.fields = record.parsed_fields()
        out.append(record)
    return out


def _count(stats: dict, result: PairResult) -> None:
    stats["compared"] += 1
    if not result.compared:
        stats["compared_bytes_only"] += 1
        return
    if result.divergent:
        stats["divergent"] += 1
        return
    for error in result.regions:  # the noise floor over the pairs within tolerance
        stats["max_rel_l2"] = max(stats["max_rel_l2"], error.rel_l2)
        stats["min_cosine"] = min(stats["min_cosine"], error.cosine)
        stats["max_abs"] = max(stats["max_abs"], error.max_abs)


def verify(settings: Settings, options: VerifyOptions) -> Report:
    """Compare every production key that has a reference twin; the report's summary has ``verify``."""
    if not normalize_prefix(options.reference_prefix):
        raise AuditError("--reference-prefix must name the reference producer's cache prefix (not empty)")
    admin = AdminClient(settings.admin)
    admin.health()
    store = open_store(settings)
    started = time.perf_counter()
    context = {"started_at": _now(), "cluster": {"master": settings.master, "admin": settings.admin},
               "filters": {"prefix": options.prefix, "match": options.match}, "read_mode": "lease",
               "device": "cpu", "checker": "numpy"}
    try:
        listing = AdminListing(admin, KeyFilter(), size_of=store.get_size).list()
        pairing = pair_keys(listing.keys, options.reference_prefix, keep=_filter(options))
        plan = options.plan
        if plan.requests:
            scope = [p for pair in pairing.pairs for p in pair] + pairing.unverified
            context["layout_inference"] = plan.fit_sizes(scope)
        if plan.layouts:
            context["layouts"] = [summarize(layout) for layout in plan.layouts]
        pairs = pairing.pairs
        if options.sample is not None:
            chosen = {key.name for key in select_keys([p for p, _ in pairs], options.sample, options.seed)}
            pairs = [pair for pair in pairs if pair[0].name in chosen]
            context["sample"] = {"requested": options.sample, "seed": options.seed}
        stats = {"compared": 0, "compared_bytes_only": 0, "divergent": 0, "reference_unread": 0,
                 "max_rel_l2": 0.0, "min_cosine": 1.0, "max_abs": 0.0}
        records = _read_pairs(store, pairs, plan, options, stats)
    finally:
        store.close()
    context["finished_at"] = _now()
    context["verify"] = _verify_summary(options, pairing, pairs, stats)
    return merge_records(records, context=context, keys_listed=len(pairing.pairs) + len(pairing.unverified),
                         keys_selected=len(pairs), duration_s=time.perf_counter() - started)


def _read_pairs(store, pairs: list[tuple[KeyInfo, KeyInfo]], plan: CheckPlan, options: VerifyOptions,
                stats: dict) -> list[KeyRecord]:
    reader = LeaseReader(store, options.buffer_mb << 20)
    records: list[KeyRecord] = []
    try:
        for turn, slots in enumerate(pair_batches(pairs, reader.capacity)):
            records += _pair_records(reader.fetch(slots, turn), plan, options.tolerances, stats)
    finally:
        reader.close()
    return records


def pair_batches(pairs: list[tuple[KeyInfo, KeyInfo]], capacity: int, max_keys: int = MAX_KEYS_PER_BATCH):
    """Slots (production, reference, production, reference, ...) packed into batches of at most
    `capacity` bytes, never splitting a pair (a pair larger than `capacity` is a batch of its own:
    the reader gives it a one-off buffer)."""
    batch: list[Slot] = []
    used = 0
    for production, reference in pairs:
        sizes = [_aligned(production.size or 0), _aligned(reference.size or 0)]
        if batch and (used + sum(sizes) > capacity or len(batch) + 2 > max_keys):
            yield batch
            batch, used = [], 0
        batch.append(Slot(production, used))
        batch.append(Slot(reference, used + sizes[0]))
        used += sum(sizes)
    if batch:
        yield batch


def _verify_summary(options: VerifyOptions, pairing: Pairing, pairs: list, stats: dict) -> dict:
    summary = {"reference_prefix": normalize_prefix(options.reference_prefix),
               "tolerances": {"rtol": options.tolerances.rtol, "min_cosine": options.tolerances.min_cosine},
               **pairing.summary(), "pairs_compared": stats["compared"],
               "pairs_compared_bytes_only": stats["compared_bytes_only"], "divergent": stats["divergent"],
               "reference_unread": stats["reference_unread"],
               "noise_floor": {"max_rel_l2": float(f"{stats['max_rel_l2']:.6g}"),
                               "min_cosine": float(f"{stats['min_cosine']:.9g}"),
                               "max_abs": float(f"{stats['max_abs']:.6g}"),
                               "over": stats["compared"] - stats["divergent"] - stats["compared_bytes_only"]},
               "unverified_examples": [key.name for key in pairing.unverified[:5]],
               **pairing.unverified_summary(_absent_reason(options.reference_run)),
               "reference_without_twin_examples": [key.name for key in pairing.uncovered[:5]]}
    if options.reference_run is not None:
        summary["reference_run"] = options.reference_run
    return summary


def _absent_reason(reference_run: dict | None) -> str:
    """Why a production key's chunk has no reference key at all, by how the reference was made."""
    if reference_run is None:  # published beforehand: how is not known here
        return NOT_PUBLISHED
    return PROMPT_NOT_GIVEN if reference_run.get("cut_at_boundaries") else NOT_CUT
