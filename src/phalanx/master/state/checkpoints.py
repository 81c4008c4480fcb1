"""Checkpoint commit tracking: a step is committed once every shard of it is persisted.

Agents report ``PERSISTED`` for the global ranks whose shards they wrote, with the world size of the round
that saved the step. Step S is committed when ``world_size`` distinct ranks have persisted it; the newest
committed step is the job's ``committed_checkpoint_step`` (durable). Pure bookkeeping, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["CheckpointTracker"]

# Steps that never complete (a round that died mid-persist) must not pile up forever.
_MAX_OPEN_STEPS = 64


class CheckpointTracker:
    def __init__(self, *, committed: int = -1) -> None:
        self.committed = committed
        self._open: dict[int, tuple[int, set[int]]] = {}

    def persisted(self, *, step: int, ranks: Iterable[int], world_size: int) -> bool:
        """Records persisted shards; True when this report committed a step newer than the last one."""
        if step <= self.committed:
            return False
        size, seen = self._open.setdefault(step, (world_size, set()))
        if size != world_size:  # the same step saved again by a round of another size: start over
            size, seen = world_size, set()
            self._open[step] = (size, seen)
        seen.update(r for r in ranks if 0 <= r < size)
        if len(seen) < size:
            if len(self._open) > _MAX_OPEN_STEPS:
                del self._open[min(self._open)]
            return False
        self.committed = step
        for old in [s for s in self._open if s <= step]:
            del self._open[old]
        return True

    def pending(self) -> dict[int, int]:
        """Steps not yet committed -> shards persisted so far."""
        return {step: len(seen) for step, (_, seen) in sorted(self._open.items())}
