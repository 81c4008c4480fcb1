"""Step intervals per rank, from heartbeats, for the step-time straggler check
(:func:`phalanx.diagnostics.stragglers.step_verdicts`).

Every heartbeat carries each local rank's newest step and when that step ended. A rank that went from step
``s0`` (ended at ``t0``) to ``s1`` (ended at ``t1``) between two heartbeats took ``(t1 - t0) / (s1 - s0)``
seconds a step: one sample per heartbeat, the mean of the steps in between. Samples belong to one
rendezvous round: ranks change meaning across rounds, and the first steps after a restart are slow for
everyone. Pure bookkeeping, no clock of its own.

A rank with an interval recorder also reports the median of its recent step times and of the time inside
collectives (``RankProgress.activity``); the newest pair is kept per rank, for the per-node scores
(:func:`phalanx.diagnostics.stragglers.node_scores`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from phalanx.master.state.beat import Stepped

__all__ = ["StepTimes"]


class _Rank:
    """One rank's record: its node, the step it last reported and when that step ended, its samples. One
    object per rank, so that a beat's 8 ranks cost 8 lookups in one table (a master of 1,000 nodes keeps
    8,000 ranks; a table per field cost four lookups a rank, each likely a cache miss)."""

    __slots__ = ("node", "samples", "step", "unix")

    def __init__(self, node: str, step: int, unix: float) -> None:
        self.node = node
        self.step = step
        self.unix = unix
        self.samples: deque[float] | None = None


class StepTimes:
    """The recent step intervals of each rank of one rendezvous round."""

    def __init__(self, *, window: int) -> None:
        self.window = window
        self.round = 0
        self._ranks: dict[int, _Rank] = {}
        self.activity: dict[int, tuple[float, float]] = {}
        """Rank -> (step time, collective time) medians from its recorder's newest report; absent without."""

    @property
    def intervals(self) -> dict[int, deque[float]]:
        """Rank -> its most recent step intervals (seconds), oldest first; a rank without one is absent."""
        return {rank: r.samples for rank, r in self._ranks.items() if r.samples is not None}

    @property
    def node_of(self) -> dict[int, str]:
        """Rank -> the node that reported it last."""
        return {rank: r.node for rank, r in self._ranks.items()}

    def observe(
        self,
        *,
        round: int,
        node_id: str,
        rank: int,
        step: int,
        step_unix: float,
        step_time_s: float = 0.0,
        collective_time_s: float = 0.0,
    ) -> None:
        """Records a heartbeat's view of one rank; a new round starts the record afresh."""
        stepped = step >= 0 and step_unix > 0  # else not stepped yet in this round
        rank_times = [(rank, step, step_unix, step_time_s, collective_time_s)] if stepped else []
        self.observe_beat(round=round, node_id=node_id, stepped=rank_times)

    def observe_beat(self, *, round: int, node_id: str, stepped: Iterable[Stepped]) -> None:
        """:meth:`observe` for the ranks of one heartbeat that completed a step in their round
        (:attr:`BeatRanks.stepped <phalanx.master.state.beat.BeatRanks.stepped>`): the master's per-beat
        path, so the per-rank work is inline rather than one call with seven keywords per rank."""
        if round != self.round:
            self._restart(round)
        ranks, activities = self._ranks, self.activity
        for rank, step, step_unix, step_time_s, collective_time_s in stepped:
            if step_time_s > 0 and 0 <= collective_time_s <= step_time_s:
                activities[rank] = (step_time_s, collective_time_s)
            elif activities:
                activities.pop(rank, None)  # no recorder (any more), or figures that do not add up
            r = ranks.get(rank)
            if r is None:
                ranks[rank] = _Rank(node_id, step, step_unix)
                continue
            r.node = node_id
            if step > r.step and step_unix > r.unix:
                samples = r.samples
                if samples is None:
                    samples = r.samples = deque(maxlen=self.window)
                samples.append((step_unix - r.unix) / (step - r.step))
            if step != r.step:  # a step back: the rank reloaded a checkpoint
                r.step, r.unix = step, step_unix

    def _restart(self, round: int) -> None:
        self.round = round
        self._ranks.clear()
        self.activity.clear()
