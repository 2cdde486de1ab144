"""`mooncake-audit verify`: production values compared with a reference producer's recomputation
(docs/verify.md). `driver` is the reference producer, run in a child process that has vLLM; the
rest never imports vLLM."""

from .compare import DEFAULT_MIN_COSINE, DEFAULT_RTOL, PairResult, RegionError, Tolerances, compare_values
from .pairing import Pairing, identity, normalize_prefix, pair_keys

__all__ = ["DEFAULT_MIN_COSINE", "DEFAULT_RTOL", "PairResult", "Pairing", "RegionError", "Tolerances",
           "compare_values", "identity", "normalize_prefix", "pair_keys"]
