"""Which listed keys a run reads: all of them, a seeded sample, and every key new since the last
run (so a cron check that samples still sees every new key once)."""

from __future__ import annotations

import random

from audit.errors import AuditError
from audit.sources.keytable import KeyTable, as_table


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


def select_keys(keys: KeyTable, sample: int | float | None, seed: int,
                always: set[str] = frozenset()) -> KeyTable:
    """The sample (deterministic for a seed and a listing, whatever order the master lists in),
    plus every key in `always`; listing order is kept. Rows, not names, are drawn, so only the
    sample's names are ever held."""
    keys = as_table(keys)
    if sample is None:
        return keys
    rows = keys.rows()
    by_name = sorted(range(len(rows)), key=lambda i: keys.name(rows[i]))
    count = sample if isinstance(sample, int) else max(1, round(sample * len(keys)))
    chosen = set(random.Random(seed).sample(by_name, min(count, len(by_name))))
    return keys.subset(rows[i] for i in range(len(rows)) if i in chosen or (always and keys.name(rows[i]) in always))
