"""Ground truth for every simulated key: why its bytes are what they are, and the verdicts an
auditor must give with and without the producer's block tables.

The verdict rules (the auditor implements them; these labels are what its tests compare with):
``ZERO_STATE`` every conv and ssm region all zero; ``PARTIAL_ZERO`` some segments' state regions
all zero, not all; ``NONFINITE`` a NaN/Inf in a state region; ``SIZE_MISMATCH`` the value's size is
not the layout's; ``SHARED_CONTENT`` the same non-zero bytes as another key; ``NULL_BACKED`` (only
with block tables) the table maps the key to block 0. An empty list means OK.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

from audit.errors import AuditError
from audit.records import Verdict

ZERO_STATE = Verdict.ZERO_STATE.value
PARTIAL_ZERO = Verdict.PARTIAL_ZERO.value
NONFINITE = Verdict.NONFINITE.value
SIZE_MISMATCH = Verdict.SIZE_MISMATCH.value
SHARED_CONTENT = Verdict.SHARED_CONTENT.value
NULL_BACKED = Verdict.NULL_BACKED.value

# cause -> verdicts without block tables (None: a good key). Null-block keys depend on the fill.
_VERDICTS: dict[str | None, tuple[str, ...]] = {
    None: (),
    "nan": (NONFINITE,),
    "truncated": (SIZE_MISMATCH,),
    "zeroed_layer": (PARTIAL_ZERO,),
    "tricky_good": (),
}
_NULL_BLOCK_VERDICTS = {"zero": (ZERO_STATE,), "garbage": (SHARED_CONTENT,)}
NULL_BLOCK_FILLS = tuple(_NULL_BLOCK_VERDICTS)
CAUSES = (*_VERDICTS, "null_block")


def expected_verdicts(cause: str | None, *, null_block_fill: str, with_tables: bool) -> list[str]:
    """Sorted verdicts a correct auditor gives a key of this cause."""
    if cause == "null_block":
        if null_block_fill not in _NULL_BLOCK_VERDICTS:
            raise AuditError(f"null_block_fill must be one of {NULL_BLOCK_FILLS}, got {null_block_fill!r}")
        verdicts = _NULL_BLOCK_VERDICTS[null_block_fill] + ((NULL_BACKED,) if with_tables else ())
    else:
        verdicts = _VERDICTS[cause]
    return sorted(verdicts)


@dataclass(frozen=True)
class Label:
    """One line of labels.jsonl. The first five fields are the ground truth; the rest say where
    the key came from (request, rank, token boundary, physical block) and what was done to it."""

    key: str
    cause: str | None
    null_backed: bool
    expected_with_tables: list[str]
    expected_without_tables: list[str]
    req_id: str
    tp_rank: int
    boundary: int
    block_id: int
    detail: str = ""

    @classmethod
    def for_key(cls, key: str, cause: str | None, *, null_block_fill: str, req_id: str,
                tp_rank: int, boundary: int, block_id: int, detail: str = "") -> Label:
        return cls(key=key, cause=cause, null_backed=cause == "null_block",
                   expected_with_tables=expected_verdicts(cause, null_block_fill=null_block_fill,
                                                          with_tables=True),
                   expected_without_tables=expected_verdicts(cause, null_block_fill=null_block_fill,
                                                             with_tables=False),
                   req_id=req_id, tp_rank=tp_rank, boundary=boundary, block_id=block_id, detail=detail)


def write_labels(path: Path, labels: Iterable[Label]) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        for label in labels:
            handle.write(json.dumps(asdict(label)) + "\n")


def read_labels(path: Path) -> list[Label]:
    """The labels a simulation wrote (for the auditor's tests and benchmarks)."""
    with open(path, encoding="utf-8") as handle:
        return [Label(**json.loads(line)) for line in handle if line.strip()]
