"""Values that describe themselves (LMCache's header, its checksum frame), or that their key's
model config describes (LMCache's values without a header): the layout that description gives
their bytes, and the verdicts of what it contradicts."""

from __future__ import annotations

import numpy as np

from audit.producers import HEAD_BYTES, ValueReading, describes_itself, parse_key, producer_of, read_value
from audit.records import KeyRecord, Verdict

# What a contradiction is, by the part of the value it is in.
_VERDICTS = {"size": (Verdict.SIZE_MISMATCH, "size_mismatch"),
             "identity": (Verdict.IDENTITY_SUSPECT, "value_identity"),
             "checksum": (Verdict.CHECKSUM_MISMATCH, "checksum_mismatch")}
IDENTITY_EVIDENCE = "value_identity"


def _host(view) -> np.ndarray:
    return np.asarray(view.cpu() if hasattr(view, "cpu") else view)


def model_configs(requests) -> dict[str, dict]:
    """The model configs a scan was given (LayoutRequests), by model name: the config
    directory's name, which a key's model is matched to by its last path component."""
    return {request.name: request.config for request in requests}


def _model_name(model) -> str:
    return str(model or "").rstrip("/").split("/")[-1]


def may_be_configured(name: str, configs: dict[str, dict]) -> bool:
    """Whether key `name` may name one of `configs`' models (a cheap look, no parsing)."""
    return any(f"{model}@" in name for model in configs)


def value_reading(name: str, view, configs: dict[str, dict] | None = None,
                  fields: dict | None = None) -> tuple[dict, ValueReading] | None:
    """What the value in `view` (host or device memory) says about itself, or, where it says
    nothing its size agrees with, what the config in `configs` of its key's model says it holds;
    None for most values, after a look at their first bytes only (and at the key's name)."""
    found = read_value(name, _host(view)) if describes_itself(bytes(_host(view[:HEAD_BYTES]))) else None
    if not configs or (found is not None and not any(d.kind == "size" for d in found[1].disagreements)):
        return found  # a valid header keeps the header's reading
    if not may_be_configured(name, configs):
        return found
    fields = fields if fields is not None else parse_key(name)
    config = configs.get(_model_name(fields.get("model")))
    producer = producer_of(fields.get("scheme"))
    reading = None if config is None or producer is None else producer.read_by_config(fields, _host(view), config)
    if reading is None or (found is not None and reading.disagreements):
        return found  # nothing the config says, or neither reading fits: the header's
    return fields, reading


def judge_reading(record: KeyRecord, fields: dict, reading: ValueReading, *, keep: bool = False) -> None:
    """A verdict for each contradiction; what the value decoded to, as evidence, where there is a
    verdict (or `keep`: every key's, as with --all): clean records stay small."""
    if not (record.verdicts or reading.disagreements or keep):
        return
    record.fields = fields
    record.evidence["decoded"] = reading.decoded
    for disagreement in reading.disagreements:
        verdict, evidence = _VERDICTS[disagreement.kind]
        if verdict not in record.verdicts:
            record.verdicts.append(verdict)
        record.evidence[evidence] = disagreement.evidence
