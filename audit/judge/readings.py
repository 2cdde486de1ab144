"""When a group's value size fits several readings (dtypes, boundaries), no verdict may rest on one
the audit merely assumed: the bytes choose one where they can, and where they cannot, a key keeps
only the verdicts every reading gives it.

The bytes choose over a sample of the group's keys (`audit.checks.plausibility`): the reading
whose non-zero bytes decode as sane numbers and zero padding wins by a margin. Readings that tie
and read the same boundaries in different widths go to the narrowest: wide data read narrow fails
the test (a float32 word's low half is noise), so a narrow reading that decodes cleanly is the
narrow dtype, or float32 data whose low halves are zero, where both readings agree on every
verdict. Readings of one width (bfloat16 and float16 states both look sane) stay undecided.
"""

from __future__ import annotations

import math

from audit.checks.plausibility import Plausibility, readings_plausibility
from audit.records import KeyRecord, Verdict

MARGIN = 0.05  # the winner's plausible share must beat every other reading's by this much
# Decoding cleanly: where one reading does, readings that do not are out, and a tie on the same
# boundaries goes to the narrowest that does (float32 read as float16 leaves about 1.6% of its
# numbers NaN, Inf or absurd, float32 read as bfloat16 about a third).
PERFECT = 0.999
SAMPLE_KEYS = 16  # keys read per ambiguous group to choose its reading
_EVIDENCE = {Verdict.ZERO_VALUE: "zero"}


def _boundaries(layout) -> tuple:
    return tuple((region.offset, region.length, region.kind) for _, region in layout.regions())


def _elements(layout) -> int:
    """How many numbers the layout reads the value as: more means narrower dtypes."""
    return sum(math.prod(region.shape) for _, region in layout.regions() if region.kind != "padding")


def choose_reading(layouts: list, values: list) -> tuple[list[int], dict]:
    """Which of `layouts` the sampled `values` (uint8 arrays of the layouts' size) may be: one
    index when the bytes choose, the readings they cannot tell apart otherwise (those clearly
    less plausible dropped), most plausible first. The evidence: the rule applied, and the
    plausible share of each reading kept, in the order returned."""
    tally = SampleTally(layouts)
    for value in values:
        tally.add(value)
    return tally.choose()


class SampleTally:
    """The plausibility of each of `layouts` over the values sampled so far, a value added while its
    bytes are in the reader's buffer: nothing of a sample is kept (16 of a group's 1.6 MB values,
    copied out, held 100 MB through a scan)."""

    def __init__(self, layouts: list):
        self.layouts = layouts
        self.totals = [Plausibility() for _ in layouts]
        self.sampled = 0

    def add(self, value) -> None:
        self.totals = [total + found for total, found in zip(self.totals, readings_plausibility(value, self.layouts))]
        self.sampled += 1

    def choose(self) -> tuple[list[int], dict]:
        """`choose_reading`'s answer for the values added."""
        layouts = self.layouts
        scores = [total.score for total in self.totals]
        evidence = {"keys_sampled": self.sampled, "readings_considered": len(layouts)}
        if any(score is None for score in scores):
            return list(range(len(layouts))), {**evidence, "rule": "no non-zero bytes to judge by"}
        ranked = sorted(range(len(layouts)), key=lambda i: -scores[i])
        best = ranked[0]
        if scores[best] >= PERFECT:  # a reading decodes cleanly: any that does not is out
            close = [i for i in ranked if scores[i] >= PERFECT]
        else:
            close = [i for i in ranked if scores[best] - scores[i] < MARGIN]
        kept, rule = close, "the bytes cannot tell these readings apart"
        if len(close) == 1:
            kept, rule = close, "most plausible"
            evidence["margin"] = round(scores[best] - max((scores[i] for i in ranked[1:]), default=0.0), 4)
        elif len({_boundaries(layouts[i]) for i in close}) == 1:
            perfect = [i for i in close if scores[i] >= PERFECT]
            most = max((_elements(layouts[i]) for i in perfect), default=None)
            narrowest = [i for i in perfect if _elements(layouts[i]) == most]
            if len(narrowest) == 1:
                kept, rule = narrowest, "tie on the same boundaries: the narrowest dtype that decodes cleanly"
                evidence["tied"] = len(close)
        evidence.update(rule=rule, scores=[round(scores[i], 4) for i in kept])
        return kept, evidence


def combine_readings(primary: KeyRecord, others: list[KeyRecord]) -> KeyRecord:
    """One key judged under every reading of an undecided group: verdicts that all give stand;
    the rest are withheld with the per-region results (they depend on the reading), and the key
    is AMBIGUOUS_LAYOUT (not judged fully: not clean). Where every reading gives the same
    verdicts, the most likely reading's regions stay (the group's layout_inference row says it
    is one of several)."""
    held = [verdict for verdict in primary.verdicts if all(verdict in other.verdicts for other in others)]
    every = [primary, *others]
    withheld = sorted({verdict for record in every for verdict in record.verdicts} - set(held))
    if not withheld:
        return primary
    by_reading = [sorted(record.verdicts) for record in every]
    primary.regions = None
    for verdict in withheld:
        primary.evidence.pop(_EVIDENCE.get(verdict, verdict.lower()), None)
    primary.verdicts = held + [Verdict.AMBIGUOUS_LAYOUT]
    primary.evidence["ambiguous_layout"] = {"withheld": withheld, "readings": len(every),
                                            "verdicts_by_reading": by_reading}
    return primary
