"""`mooncake-audit explain KEY`: everything the audit knows about one key, region by region."""

from __future__ import annotations

import numpy as np

from audit.checks.floats import decode_floats
from audit.checks.host import HostChecker
from audit.connection import AdminClient, Settings, open_store
from audit.errors import AuditError
from audit.readers.buffers import Slot
from audit.readers.lease import LeaseReader
from audit.keys import parse_key
from audit.judge.chunks import ChunkIndex, member_of
from audit.judge.plan import CheckPlan
from audit.records import KeyInfo, Verdict
from audit.run.scan import check_batch

HEXDUMP_BYTES = 32


def _stats(data: np.ndarray, dtype: str) -> dict | None:
    values = decode_floats(data, dtype)
    if values is None or values.size == 0:
        return None
    finite = values[np.isfinite(values)]
    if finite.size == 0:
        return {"min": None, "max": None, "mean": None, "exact_zeros": 0}
    return {"min": float(finite.min()), "max": float(finite.max()), "mean": float(finite.mean(dtype=np.float64)),
            "exact_zeros": int(np.count_nonzero(finite == 0))}


def _size_of(admin: AdminClient, store, key: str) -> int:
    if "," not in key:
        answer = dict(admin.query([key])).get(key) or {}
        replicas = answer.get("values") or []
        if answer.get("ok") and replicas:
            return int(replicas[0]["size_"])
        return -704
    return store.get_size(key)


def _chunk(admin: AdminClient, key: str) -> dict | None:
    """The key's chunk as the listing shows it: which members are there and which are missing
    (names only: sizes and digests of the other keys are a scan's business)."""
    member = member_of(parse_key(key))
    if member is None:
        return None
    family, present = [], []
    for name in admin.all_keys_body().decode(errors="replace").split("\n"):
        if name and (other := member_of(parse_key(name))) is not None and other.family == member.family:
            family.append(name)
            if other.chunk == member.chunk:
                present.append(name)
    index = ChunkIndex.of((name, None) for name in family)
    present.sort()
    return {"members_present": present, "missing": index.judge().missing.get(key, [])}


def _fit_to(plan: CheckPlan, info: KeyInfo, data: np.ndarray | None) -> list[dict]:
    """The layouts of a model config fitted to this key's size, and where that size fits several
    readings, the one its bytes choose (or all of them): the rows of a scan's layout_inference.
    A model the producer's manifest covers has its one row, saying so."""
    if not plan.requests and plan.manifests is None:
        return []
    rows = plan.fit_sizes([info])
    if plan.readings and data is not None:
        plan.add_sample(info, data)
        plan.decide_readings()
    return rows


def explain_key(settings: Settings, key: str, plan: CheckPlan) -> dict:
    """The key's record with every region, float statistics and a hexdump of each region's start."""
    admin = AdminClient(settings.admin)
    admin.health()
    store = open_store(settings)
    try:
        size = _size_of(admin, store, key)
        if size < 0:
            raise AuditError(f"key not found: {key[:200]!r}")
        info = KeyInfo(name=key, size=size, fields=parse_key(key))
        reader = LeaseReader(store, 2 * size + 128)
        try:
            batch = reader.fetch([Slot(info, 0)], 0)
            data = batch.view(batch.slots[0], size).copy() if batch.results[0] == size else None
            inference = _fit_to(plan, info, data)
            record = check_batch(batch, HostChecker(), CheckPlan(plan.layouts, plan.layout_for_all, plan.tables,
                                                                 keep_regions=True, requests=plan.requests,
                                                                 readings=plan.readings))[0]
        finally:
            reader.close()
    finally:
        store.close()
    document = record.to_json()
    if inference:
        document["layout_inference"] = inference
    if data is not None:
        if not document.get("regions"):  # opaque: the whole value is one region
            document["regions"] = [{"segment": "-", "layer": -1, "region": "value", "kind": "raw", "offset": 0,
                                    "length": size, "dtype": "raw", "xxh3": document["xxh3"],
                                    "zero": document["zero"], "nan": 0, "inf": 0}]
        for region in document["regions"]:
            chunk = data[region["offset"]: region["offset"] + region["length"]]
            region["hexdump"] = chunk[:HEXDUMP_BYTES].tobytes().hex(" ")
            region["stats"] = _stats(chunk, region["dtype"])
    chunk = _chunk(admin, key)
    if chunk is not None:
        document["chunk"] = chunk
        if chunk["missing"] and Verdict.INCOMPLETE_CHUNK not in document["verdicts"]:
            document["verdicts"].append(Verdict.INCOMPLETE_CHUNK)
    entry = plan.table_entry(info)
    document["block_table_records"] = [] if entry is None else [
        {"block_ids": list(entry.block_ids), "sources": entry.sources, "req_ids": entry.req_ids}]
    return document
