"""Values that describe themselves (LMCache's header, its checksum frame): the layout their own
description gives their bytes, and the verdicts of what that description contradicts."""

from __future__ import annotations

import numpy as np

from audit.producers import HEAD_BYTES, ValueReading, describes_itself, read_value
from audit.records import KeyRecord, Verdict

# What a contradiction is, by the part of the value it is in.
_VERDICTS = {"size": (Verdict.SIZE_MISMATCH, "size_mismatch"),
             "identity": (Verdict.IDENTITY_SUSPECT, "value_identity"),
             "checksum": (Verdict.CHECKSUM_MISMATCH, "checksum_mismatch")}
IDENTITY_EVIDENCE = "value_identity"


def _host(view) -> np.ndarray:
    return np.asarray(view.cpu() if hasattr(view, "cpu") else view)


def value_reading(name: str, view) -> tuple[dict, ValueReading] | None:
    """What the value in `view` (host or device memory) says about itself; None for most values,
    after a look at their first bytes only."""
    if not describes_itself(bytes(_host(view[:HEAD_BYTES]))):
        return None
    return read_value(name, _host(view))


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
