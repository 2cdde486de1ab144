"""PREFIX_MISMATCH: a state whose layer-0 rows decode to tokens other than the ones its producer
recorded for its chunk hash (`audit.prefixrecords`).

Such a state is the state of *some* prefix under these weights (it binds), just not of the prefix its
key names: another request's, a stale or recycled block's, an earlier boundary's. Only keys with a
prefix record are judged; a token whose image other tokens share (tied or untrained embeddings) may
be any of them, so every such reading is tried before a key is flagged."""

from __future__ import annotations

import itertools
import math

import numpy as np

from audit.prefixrecords import DIGEST, PrefixDigest, PrefixRecords, prefix_digest
from audit.producers.vllm import split_stem
from audit.records import KeyRecord, Verdict

MAX_READINGS = 256  # token sequences tried for a window of shared images; beyond it, nothing is claimed


def prefix_matches(tokens, expected: PrefixDigest, twins: dict) -> bool | None:
    """Whether decoded `tokens` (oldest first) end in the tokens `expected` digests, any token of a
    class of shared images standing for any other (`twins`); None: nothing to say (the rows hold
    fewer tokens than the window, or the classes leave too many readings)."""
    if expected.window > len(tokens):
        return None
    window = [int(t) for t in tokens[len(tokens) - expected.window:]]
    if prefix_digest(window) == expected.digest:
        return True
    classes = [twins.get(token, (token,)) for token in window]
    if math.prod(len(c) for c in classes) > MAX_READINGS:
        return None
    return any(prefix_digest(reading) == expected.digest for reading in itertools.product(*classes))


def check_prefix(record: KeyRecord, tokens: np.ndarray, images, prefixes: PrefixRecords) -> bool | None:
    """Flag `record` when its decoded layer-0 `tokens` (oldest first) do not digest to its chunk
    hash's record. None: nothing to compare (no record, or `prefix_matches` cannot say); True: flagged."""
    split = split_stem(record.key)  # a vLLM key ends in its chunk hash (a key without one has no record)
    expected = prefixes.get(split[1]) if split else None
    matches = None if expected is None else prefix_matches(tokens, expected, images.twins)
    if matches is not False:
        return None if matches is None else False
    window = [int(t) for t in tokens[len(tokens) - expected.window:]]
    record.verdicts.append(Verdict.PREFIX_MISMATCH)
    record.evidence["prefix_mismatch"] = {
        "chunk_hash": split[1], "window": expected.window, "recorded_digest": expected.digest,
        "decoded_digest": prefix_digest(window), "digest": DIGEST,
        "shared_images": sum(token in images.twins for token in window)}
    return True
