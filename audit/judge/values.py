"""Values that describe themselves (LMCache's header, its checksum frame), or that their key's
model config describes (LMCache's values without a header, SGLang's pages): the layout that
description gives their bytes, and the verdicts of what it contradicts."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from audit.judge.readings import choose_reading
from audit.producers import HEAD_BYTES, ValueReading, describes_itself, parse_key, producer_of, read_value
from audit.producers.vllm import claims as vllm_claims
from audit.records import KeyRecord, Verdict

# What a contradiction is, by the part of the value it is in.
_VERDICTS = {"size": (Verdict.SIZE_MISMATCH, "size_mismatch"),
             "identity": (Verdict.IDENTITY_SUSPECT, "value_identity"),
             "checksum": (Verdict.CHECKSUM_MISMATCH, "checksum_mismatch")}
IDENTITY_EVIDENCE = "value_identity"
SAMPLE_BYTES = 16 << 10  # the leading bytes of a value its dtype is chosen by: 4k numbers or more


def _host(view) -> np.ndarray:
    return np.asarray(view.cpu() if hasattr(view, "cpu") else view)


def model_configs(requests) -> dict[str, dict]:
    """The model configs a scan was given (LayoutRequests), by model name: the config
    directory's name, which a key's model is matched to by its last path component."""
    return {request.name: request.config for request in requests}


def may_be_configured(name: str, configs: dict[str, dict]) -> bool:
    """Whether key `name` may name one of `configs`' models and belong to a producer that reads
    values by config (a cheap look, no parsing): a key with vLLM's markers is vLLM's, whose values
    are read by their layouts, never by a config."""
    return any(model in name for model in configs) and not vllm_claims(name)


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
    producer = producer_of(fields.get("scheme"))
    config = producer.model_config(fields, configs) if producer is not None and producer.sized_by_config else None
    if config is None:
        return found
    value = _host(view)
    reading = producer.read_by_config(fields, value, config)
    if reading is None or (found is not None and reading.disagreements):
        return found  # nothing the config says, or neither reading fits: the header's
    return fields, (_chosen(reading, value) if reading.alternatives else reading)


def _chosen(reading: ValueReading, value: np.ndarray) -> ValueReading:
    """A reading whose size fits several layouts (dtypes), narrowed by the value's bytes: the one
    they choose, or the ones they cannot tell apart (the key keeps only the verdicts all give)."""
    layouts = [reading.layout, *reading.alternatives]
    kept, evidence = choose_reading(layouts, [value[:SAMPLE_BYTES]])
    decoded = {**reading.decoded, "reading": {**evidence, "dtypes": [layouts[i].number_dtype for i in kept]}}
    return replace(reading, layout=layouts[kept[0]], decoded=decoded,
                   alternatives=tuple(layouts[i] for i in kept[1:]))


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
