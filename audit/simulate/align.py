"""Scheduler steps and the sparse block table of a Mamba group under ``mamba_cache_mode="align"``.

In align mode vLLM keeps a recurrent state only where a scheduler step ended: block index k of a
request holds a real block (id >= 1) only if a step ended exactly at token ``(k+1)*block_size``;
every other full chunk is ``NULL_BLOCK_ID`` (0). The #53084 connector published a key for every
full chunk anyway, so each null entry became a key holding block 0's bytes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from audit.blocktables import NULL_BLOCK_ID
from audit.errors import AuditError

REPORTED_NULL_BOUNDARIES = (2112, 2960, 3024)  # token boundaries seen null-backed in #53084


@dataclass(frozen=True)
class StepSchedule:
    """Where one request's scheduler steps ended (token counts, ascending, last = its length)."""

    step_ends: tuple[int, ...]
    block_size: int

    @property
    def tokens(self) -> int:
        return self.step_ends[-1]

    @property
    def step_lengths(self) -> list[int]:
        return [int(length) for length in np.diff((0, *self.step_ends))]

    @property
    def boundaries(self) -> list[int]:
        """The end of every full chunk: one published key per boundary and TP rank."""
        return list(range(self.block_size, self.tokens + 1, self.block_size))

    def is_real(self, boundary: int) -> bool:
        """Whether align mode kept a state here (a step ended exactly at this boundary)."""
        return boundary in self.step_ends


def plan_steps(tokens: int, block_size: int, rng: np.random.Generator, *,
               null_boundaries: Iterable[int] = (), real_fraction: float = 0.5) -> StepSchedule:
    """A seeded step schedule: about ``real_fraction`` of the chunk boundaries end a step, the
    ``null_boundaries`` never do, and extra steps end between boundaries so lengths vary as
    chunked prefill's do. The last step always ends at ``tokens`` (the request's end)."""
    boundaries = list(range(block_size, tokens + 1, block_size))
    forced_null = set(null_boundaries)
    for boundary in sorted(forced_null):
        if boundary % block_size:
            raise AuditError(f"null boundary {boundary} is not a multiple of block_size {block_size}")
        if boundary == tokens:
            raise AuditError(f"null boundary {boundary} is the request's last token: the last "
                             f"step always ends there, so that block is real")
    eligible = [b for b in boundaries if b not in forced_null and b != tokens]
    real = rng.choice(eligible, size=round(real_fraction * len(eligible)), replace=False) if eligible else []
    between = rng.integers(1, max(tokens, 2), size=max(1, len(boundaries) // 2))
    between = between[between % block_size != 0]
    return StepSchedule(tuple(sorted({*map(int, real), *map(int, between), tokens})), block_size)


class BlockPool:
    """Physical block ids handed out to real chunks (0, the null block, is never handed out)."""

    def __init__(self, capacity: int, rng: np.random.Generator):
        self._free = [int(block) for block in rng.permutation(np.arange(1, capacity + 1))]

    def allocate(self) -> int:
        if not self._free:
            raise AuditError("the simulated block pool is exhausted")
        return self._free.pop()


def align_block_table(schedule: StepSchedule, pool: BlockPool) -> list[int]:
    """One entry per full chunk: a fresh block where a step ended on the boundary, else 0."""
    return [pool.allocate() if schedule.is_real(boundary) else NULL_BLOCK_ID
            for boundary in schedule.boundaries]
