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
from typing import Any

from phalanx.api.v1 import master_pb2 as pb

__all__ = ["StepTimes"]


class StepTimes:
    """The recent step intervals of each rank of one rendezvous round."""

    def __init__(self, *, window: int) -> None:
        self.window = window
        self.round = 0
        self.intervals: dict[int, deque[float]] = {}
        """Rank -> its most recent step intervals (seconds), oldest first."""
        self.node_of: dict[int, str] = {}
        self.activity: dict[int, tuple[float, float]] = {}
        """Rank -> (step time, collective time) medians from its recorder's newest report; absent without."""
        self._last: dict[int, tuple[int, float]] = {}

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
        progress = pb.RankProgress(rank=rank, step=step, step_unix_ns=int(step_unix * 1e9))
        if step_time_s or collective_time_s:
            progress.activity.step_time_s = step_time_s
            progress.activity.collective_time_s = collective_time_s
        self.observe_beat(round=round, node_id=node_id, ranks=[progress])

    def observe_beat(self, *, round: int, node_id: str, ranks: Iterable[Any]) -> None:
        """:meth:`observe` for each ``RankProgress`` of one heartbeat: the master's per-beat path, so the
        per-rank work is inline rather than one call with seven keywords per rank."""
        if round != self.round:
            self._restart(round)
        node_of, activities, intervals, lasts = self.node_of, self.activity, self.intervals, self._last
        for r in ranks:
            step, step_unix = r.step, r.step_unix_ns / 1e9
            if step < 0 or step_unix <= 0:
                continue  # not stepped yet in this round
            rank = r.rank
            node_of[rank] = node_id
            step_time_s = collective_time_s = 0.0
            if r.HasField("activity"):  # else reading it would build an empty one for each rank of each beat
                activity = r.activity
                step_time_s, collective_time_s = activity.step_time_s, activity.collective_time_s
            if step_time_s > 0 and 0 <= collective_time_s <= step_time_s:
                activities[rank] = (step_time_s, collective_time_s)
            else:
                activities.pop(rank, None)  # no recorder (any more), or figures that do not add up
            last = lasts.get(rank)
            if last is not None and step > last[0] and step_unix > last[1]:
                samples = intervals.get(rank)
                if samples is None:  # not setdefault: that would build a deque on every call
                    samples = intervals[rank] = deque(maxlen=self.window)
                samples.append((step_unix - last[1]) / (step - last[0]))
            if last is None or step != last[0]:  # a step back: the rank reloaded a checkpoint
                lasts[rank] = (step, step_unix)

    def _restart(self, round: int) -> None:
        self.round = round
        self.intervals.clear()
        self.node_of.clear()
        self.activity.clear()
        self._last.clear()
