"""Which listed keys a run reads: all of them, a seeded sample, and every key new since the last
run (so a cron check that samples still sees every new key once)."""

from __future__ import annotations

import random

from audit.errors import AuditError
from audit.records import KeyInfo


def parse_sample(text: str | None) -> int | float | None:
    """`--sample 500` (keys) or `--sample 0.05` (fraction of the listing)."""
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        raise AuditError(f"--sample must be a key count or a fraction in (0, 1], not {text!r}") from None
    if value.is_integer() and value >= 1 and "." not in text:
        return int(value)
    if 0 < value <= 1:
        return value
    raise AuditError(f"--sample must be a key count or a fraction in (0, 1], not {text!r}")


def select_keys(keys: list[KeyInfo], sample: int | float | None, seed: int,
                always: set[str] = frozenset()) -> list[KeyInfo]:
    """The sample (deterministic for a seed and a listing, whatever order the master lists in),
    plus every key in `always`; listing order is kept."""
    if sample is None:
        return keys
    ordered = sorted(keys, key=lambda key: key.name)
    count = sample if isinstance(sample, int) else max(1, round(sample * len(keys)))
    chosen = {key.name for key in random.Random(seed).sample(ordered, min(count, len(ordered)))}
    return [key for key in keys if key.name in chosen or key.name in always]
