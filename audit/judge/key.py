"""Per-key verdicts from what the read returned, what the checks found, the value's layout and
the producer's block tables. Cross-key verdicts (SHARED_CONTENT) are decided in `audit.judge.merge`.

The rules for a value with a recurrent-state layout (the vLLM #53084 detector):
- ZERO_STATE: every conv and ssm region is all zero (padding does not count: it is zero by design);
- PARTIAL_ZERO: for some layers, not all, every state region is all zero;
- NONFINITE: a NaN or Inf in a state or KV region;
- SIZE_MISMATCH: the value's size differs from the layout's; it is then judged as opaque bytes;
- NULL_BACKED: a block table maps the key to NULL_BLOCK_ID, whatever its bytes.
Legitimate states with many exact zeros, an all-zero row or tiny values have non-zero regions and
are OK.
"""

from __future__ import annotations

from audit.blocktables import BlockTableEntry
from audit.checks.host import ValueCheck
from audit.checks.types import CleanRegions
from audit.errors import ERROR_NAMES, MOVED
from audit.judge.readings import combine_readings
from audit.keys import parse_key
from audit.producers import probe_of
from audit.records import KeyInfo, KeyRecord, Verdict

_READ_VERDICTS = {
    -704: Verdict.VANISHED,
    MOVED: Verdict.MOVED,
    -800: Verdict.UNREACHABLE,
    -801: Verdict.CHECKSUM_MISMATCH,
}
MAX_EVIDENCE_REGIONS = 16


def read_failure(key: KeyInfo, code: int, message: str | None = None) -> KeyRecord:
    verdict = _READ_VERDICTS.get(code, Verdict.READ_ERROR)
    error = {"code": code, "name": ERROR_NAMES.get(code, "UNKNOWN")}
    if message:
        error["message"] = message
    return KeyRecord(key=key.name, size=key.size, fields=key.fields, verdicts=[verdict], error=error,
                     ordinal=key.ordinal)


def _region_rows(layout, check: ValueCheck) -> list[dict]:
    return [
        {"segment": segment.name, "layer": segment.layer, "region": region.name, "kind": region.kind,
         "offset": region.offset, "length": region.length, "dtype": region.dtype,
         "xxh3": f"{result.xxh3:016x}", "zero": result.zero, "nan": result.nan, "inf": result.inf}
        for (segment, region), result in zip(layout.regions(), check.regions)
    ]


def _flagged(check: ValueCheck) -> bool:
    """Whether some region is all zero or holds a NaN or Inf: the only results a layout's verdicts
    rest on."""
    regions = check.regions
    return not isinstance(regions, CleanRegions) and any(result.zero or result.nan or result.inf for result in regions)


def _judge_layout(record: KeyRecord, layout, check: ValueCheck) -> None:
    if not _flagged(check):
        return  # the common case: every region holds non-zero, finite values
    per_segment: dict[int, list[bool]] = {}  # segment -> its state regions' zero flags
    kv_segments: dict[int, list[bool]] = {}  # segment -> its KV regions' (attention, MLA latent) zero flags
    nonfinite = []
    for (segment, region), result in zip(layout.regions(), check.regions):
        if region.kind == "state":
            per_segment.setdefault(segment.index, []).append(result.zero)
        elif region.kind == "kv":
            kv_segments.setdefault(segment.index, []).append(result.zero)
        if region.kind != "padding" and (result.nan or result.inf):
            nonfinite.append({"segment": segment.name, "region": region.name, "nan": result.nan, "inf": result.inf})
    zero_segments = [index for index, flags in per_segment.items() if all(flags)]
    # An attention key (no state region) is judged by its layers' KV: a layer's K/V or latent of real
    # tokens is never exactly zero, so one layer all zero is as bad as a state layer all zero.
    zero_kv = [index for index, flags in kv_segments.items() if all(flags)] if not per_segment else []
    layers = {segment.index: segment.layer for segment in layout.segments}
    if per_segment and len(zero_segments) == len(per_segment):
        record.verdicts.append(Verdict.ZERO_STATE)
        record.evidence["zero_state"] = {"state_regions": sum(map(len, per_segment.values())),
                                         "layers": len(per_segment), "value_all_zero": check.zero}
    elif zero_segments:
        record.verdicts.append(Verdict.PARTIAL_ZERO)
        record.evidence["partial_zero"] = {"zero_layers": [layers[i] for i in zero_segments],
                                           "layers": len(per_segment)}
    elif zero_kv and len(zero_kv) == len(kv_segments) and record.size:
        record.verdicts.append(Verdict.ZERO_VALUE)  # an attention layout: no state regions
        if not check.zero:  # zero KV behind a header or checksum frame
            record.evidence["zero"] = {"kv_all_zero": True, "value_all_zero": False}
    elif zero_kv:
        record.verdicts.append(Verdict.PARTIAL_ZERO)
        record.evidence["partial_zero"] = {"zero_layers": [layers[i] for i in zero_kv], "layers": len(kv_segments),
                                           "regions": "kv"}
    if nonfinite:
        record.verdicts.append(Verdict.NONFINITE)
        record.evidence["nonfinite"] = {"nan": sum(r["nan"] for r in nonfinite),
                                        "inf": sum(r["inf"] for r in nonfinite),
                                        "regions": nonfinite[:MAX_EVIDENCE_REGIONS]}


def _judge_zero_value(record: KeyRecord) -> None:
    """ZERO_VALUE, unless the key is a probe its producer writes as zeros on purpose."""
    reason = probe_of(record.key, record.size, True)
    if reason is not None:
        record.verdicts.append(Verdict.WARMUP_KEY)
        record.evidence["warmup"] = {"reason": reason}
        return
    record.verdicts.append(Verdict.ZERO_VALUE)
    record.evidence["zero"] = {"digest_is_zero_digest": True, "bytes_confirmed_zero": True}


def judge_read(key: KeyInfo, code: int, check: ValueCheck | None, *, layout=None,
               table: BlockTableEntry | None = None, keep_regions: bool = False) -> KeyRecord:
    """The record of one key. `layout` is the layout that applies to the key (even when the size
    differs); `table` is its block-table entry, if any producer recorded one."""
    if code < 0:
        record = read_failure(key, code)
    elif code != key.size or check is None:
        record = read_failure(key, code, f"read {code} bytes, the listing said {key.size}")
    else:
        record = KeyRecord(key.name, key.size, key.fields, check.xxh3, check.zero, [], {}, None, None, None, None,
                           key.ordinal)  # positional (a third faster): key, size, fields, xxh3, zero, verdicts,
        # evidence, error, layout, regions, tenant, ordinal
        if layout is not None:
            record.layout = f"{layout.model}/group:{layout.group}/{layout.kind}/tp{layout.tp_size}"
        if check.regions is not None:
            _judge_layout(record, layout, check)
        else:
            if layout is not None:
                record.verdicts.append(Verdict.SIZE_MISMATCH)
                record.evidence["size_mismatch"] = {"expected": layout.size, "actual": key.size}
            if check.zero and code > 0:
                _judge_zero_value(record)
        if check.regions is not None and (record.verdicts or keep_regions):
            record.regions = _region_rows(layout, check)
    apply_block_table(record, table)
    if record.verdicts and record.fields is None:
        record.fields = parse_key(record.key)
    return record


def judge_readings(record: KeyRecord, key: KeyInfo, code: int, checks: tuple[ValueCheck, ...], layouts: tuple,
                   table: BlockTableEntry | None = None) -> KeyRecord:
    """`record` (the key judged under `layouts[0]` with `checks[0]`) left with only the verdicts
    every reading in `layouts` gives (`checks`: one per reading, from one pass over the bytes).
    Where no reading finds a zero, NaN or Inf region, the layout adds no verdict under any of them,
    so one other reading's record stands for all of them."""
    others = list(zip(checks[1:], layouts[1:]))
    if not any(map(_flagged, checks)):
        check, layout = others[0]
        alternatives = [judge_read(key, code, check, layout=layout, table=table)] * len(others)
    else:
        alternatives = [judge_read(key, code, check, layout=layout, table=table) for check, layout in others]
    return combine_readings(record, alternatives)


def apply_block_table(record: KeyRecord, table: BlockTableEntry | None) -> None:
    """Evidence from the producer's block table; NULL_BACKED when it names NULL_BLOCK_ID."""
    if table is None or Verdict.VANISHED in record.verdicts or Verdict.MOVED in record.verdicts:
        return
    record.evidence["block_table"] = {"block_ids": list(table.block_ids[:64]), "sources": table.sources[:3],
                                      "req_ids": table.req_ids[:3]}
    if table.boundary is not None:
        record.evidence["block_table"]["boundary_tokens"] = table.boundary
    if table.null_backed:
        record.verdicts.insert(0, Verdict.NULL_BACKED)
        state_zero = Verdict.ZERO_STATE in record.verdicts or Verdict.ZERO_VALUE in record.verdicts
        record.evidence["null_backed"] = {"null_block_id": 0, "bytes_zero": record.zero,
                                          "state_zero": state_zero if record.xxh3 is not None else None}
