"""Save at breakpoint across nodes: the one in-memory step that every node persists when a round breaks.

When a round breaks (a worker failed, a node left or joined), each agent stops its workers and persists,
from its node's shared memory, the newest step all of its ranks hold complete. Nodes can straddle a step:
a rank that saved step 11 and then crashed on one node, ranks that were still copying step 11 when they
were stopped on another. Each node alone would persist its own newest step (11 there, 10 here), and since
a step is committed only when every shard of it is on storage, nothing would be committed.

So each agent first reports the steps its ranks hold (ReportCheckpoint IN_MEMORY, naming the broken
round) and the step it is about to persist. Once every live member of the broken round reported, the
newest step they all hold is known: the last reporter is answered with it, and each node that already
persists another step is asked to persist this one too (PERSIST_CHECKPOINT). The step is still in memory
everywhere: every rank keeps two snapshots, ranks in lock step are at most one save apart, and a queued
persist pins its snapshot against the next save.

Pure bookkeeping, no I/O; :class:`phalanx.master.job.Job` feeds it reports and delivers the requests.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

__all__ = ["Breakpoint", "agreed_step"]


def agreed_step(held: Iterable[frozenset[int]], *, committed: int) -> int | None:
    """The newest step that every reported set holds and that is newer than the committed step; None
    when nothing was reported or no such step exists (persisting an older step gains nothing)."""
    sets = list(held)
    if not sets:
        return None
    newer = [s for s in frozenset.intersection(*sets) if s > committed]
    return max(newer) if newer else None


@dataclass
class Breakpoint:
    """The reports of one broken round's nodes."""

    round: int
    members: frozenset[str]
    held: dict[str, frozenset[int]] = field(default_factory=dict)
    """Node -> the steps all of its ranks hold complete in memory."""
    persisting: dict[str, int] = field(default_factory=dict)
    """Node -> the step it persists: its own choice, or the one it was answered or asked."""
    step: int | None = None
    """The agreed step, once known."""

    def report(self, node_id: str, *, held: Iterable[int], persisting: int) -> None:
        self.held[node_id] = frozenset(held)
        self.persisting[node_id] = persisting

    def settle(self, *, reachable: Iterable[str], committed: int) -> list[str]:
        """Agrees on the step once every reachable member reported (members that are gone cannot, and
        hold nothing anyone could persist). Returns the nodes that persist another step and must be asked
        to persist the agreed one, and records that they were; [] before agreement or after it."""
        if self.step is not None:
            return []
        if set(reachable) & (self.members - self.held.keys()):
            return []
        self.step = agreed_step(self.held.values(), committed=committed)
        if self.step is None:
            return []
        ask = sorted(n for n, s in self.persisting.items() if s != self.step)
        for node_id in ask:
            self.persisting[node_id] = self.step
        return ask
