"""Comparing one production value with its reference twin, region by region (docs/verify.md).

Per state (conv, ssm) or KV region of the layout, both values decoded as float32 and compared in
float64: relative L2 error ``||p - r|| / ||r||``, max abs error and cosine similarity. A pair is
divergent when any region's relative L2 error exceeds ``rtol`` or its cosine falls below
``min_cosine``. Padding regions are never compared (they hold whatever the block held before).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from audit.checks.floats import decode_floats
from audit.layouts import Layout

# Defaults (docs/verify.md, "Tolerances"): the recomputation measured on the CPU harness was
# bit-exact (noise floor 0, float32 and bfloat16, any batch composition); these leave room for
# CUDA's batch-variant bf16 reductions (about ten bf16 roundings) and sit 100x below the smallest
# wrong state measured (rel L2 1.0 for a null-backed state, >= 1.4 for other weights).
DEFAULT_RTOL = 1e-2
DEFAULT_MIN_COSINE = 0.999


@dataclass(frozen=True)
class Tolerances:
    rtol: float = DEFAULT_RTOL
    min_cosine: float = DEFAULT_MIN_COSINE


@dataclass
class RegionError:
    """How far one region of a production value is from the same region of its reference."""

    segment: str
    layer: int
    region: str
    kind: str
    dtype: str
    elements: int
    rel_l2: float       # ||p - r|| / ||r||; 0 when both are zero; inf when only r is zero
    max_abs: float
    cosine: float       # 1 when both are zero; 0 when one is
    nonfinite: int      # NaN/Inf in production where the reference has a finite value, or the reverse
    divergent: bool

    def to_json(self) -> dict:
        return {"segment": self.segment, "layer": self.layer, "region": self.region, "kind": self.kind,
                "dtype": self.dtype, "elements": self.elements, "rel_l2": _finite(self.rel_l2),
                "max_abs": _finite(self.max_abs), "cosine": _finite(self.cosine), "nonfinite": self.nonfinite,
                "divergent": self.divergent}


def _finite(value: float) -> float | str:
    """JSON has no inf/nan: name them."""
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return float(f"{value:.6g}")


def region_error(production: np.ndarray, reference: np.ndarray, dtype: str,
                 tolerances: Tolerances) -> tuple[float, float, float, int, int]:
    """(rel_l2, max_abs, cosine, nonfinite, elements) of two regions' bytes read as `dtype`."""
    p, r = decode_floats(production, dtype), decode_floats(reference, dtype)
    if p is None or r is None:  # not a float dtype: bytes equal or not
        same = np.array_equal(production, reference)
        return (0.0 if same else math.inf), (0.0 if same else math.inf), (1.0 if same else 0.0), 0, production.size
    p64, r64 = p.astype(np.float64), r.astype(np.float64)
    finite_p, finite_r = np.isfinite(p64), np.isfinite(r64)
    both = finite_p & finite_r
    nonfinite = int(np.count_nonzero(finite_p != finite_r))
    if not both.all():  # NaN/Inf in both at the same place compare equal; elsewhere they count above
        p64, r64 = np.where(both, p64, 0.0), np.where(both, r64, 0.0)
    diff = p64 - r64
    norm_d, norm_p, norm_r = (float(np.sqrt(np.dot(x, x))) for x in (diff, p64, r64))
    max_abs = float(np.max(np.abs(diff))) if diff.size else 0.0
    if norm_r == 0.0:
        rel_l2 = 0.0 if norm_p == 0.0 else math.inf
    else:
        rel_l2 = norm_d / norm_r
    if norm_p == 0.0 and norm_r == 0.0:
        cosine = 1.0
    elif norm_p == 0.0 or norm_r == 0.0:
        cosine = 0.0
    else:
        cosine = float(np.dot(p64, r64) / (norm_p * norm_r))
    return rel_l2, max_abs, cosine, nonfinite, int(p.size)


@dataclass
class PairResult:
    """The comparison of one production value with its reference twin."""

    divergent: bool
    regions: list[RegionError]
    reason: str | None = None          # why divergent, in words
    compared: bool = True              # False: no layout fits, only bytes were compared

    @property
    def worst(self) -> RegionError | None:
        """The region farthest from its reference (largest relative L2 error, then lowest cosine)."""
        if not self.regions:
            return None
        return max(self.regions, key=lambda e: (e.rel_l2 if not math.isnan(e.rel_l2) else math.inf, -e.cosine))

    def evidence(self, reference_key: str, tolerances: Tolerances, limit: int = 64) -> dict:
        worst = self.worst
        divergent_regions = [e for e in self.regions if e.divergent]
        document = {
            "reference_key": reference_key,
            "tolerances": {"rtol": tolerances.rtol, "min_cosine": tolerances.min_cosine},
            "compared": "regions" if self.compared else "bytes",
            "regions_compared": len(self.regions),
            "regions_divergent": len(divergent_regions),
            "max_rel_l2": _finite(max((e.rel_l2 for e in self.regions), default=0.0)),
            "min_cosine": _finite(min((e.cosine for e in self.regions), default=1.0)),
            "max_abs": _finite(max((e.max_abs for e in self.regions), default=0.0)),
        }
        if self.reason:
            document["reason"] = self.reason
        if worst is not None:
            document["worst_layer"] = worst.layer
            document["worst_region"] = worst.to_json()
        shown = divergent_regions or self.regions
        document["regions"] = [e.to_json() for e in shown[:limit]]
        if len(shown) > limit:
            document["regions_omitted"] = len(shown) - limit
        return document


def compare_values(production: np.ndarray, reference: np.ndarray, layout: Layout | None,
                   tolerances: Tolerances = Tolerances()) -> PairResult:
    """Compare two values of one key identity. `layout` must fit both (else bytes are compared)."""
    if production.size != reference.size:
        return PairResult(True, [], reason=f"sizes differ: production {production.size} B, reference "
                                           f"{reference.size} B", compared=False)
    if layout is None or layout.size != production.size:
        same = np.array_equal(production, reference)
        return PairResult(False, [], reason=None if same else "no layout fits: bytes differ, not judged",
                          compared=False)
    errors = []
    for segment, region in layout.regions():
        if region.kind == "padding":
            continue
        end = region.offset + region.length
        rel_l2, max_abs, cosine, nonfinite, elements = region_error(
            production[region.offset:end], reference[region.offset:end], region.dtype, tolerances)
        divergent = (nonfinite > 0 or not rel_l2 <= tolerances.rtol or not cosine >= tolerances.min_cosine)
        errors.append(RegionError(segment.name, segment.layer, region.name, region.kind, region.dtype, elements,
                                  rel_l2, max_abs, cosine, nonfinite, divergent))
    divergent = [e for e in errors if e.divergent]
    reason = None
    if divergent:
        worst = max(divergent, key=lambda e: (e.rel_l2 if not math.isnan(e.rel_l2) else math.inf, -e.cosine))
        reason = (f"{len(divergent)} of {len(errors)} regions beyond tolerance; worst {worst.segment}/"
                  f"{worst.region}: rel L2 {_finite(worst.rel_l2)}, cosine {_finite(worst.cosine)}")
    return PairResult(bool(divergent), errors, reason=reason)
