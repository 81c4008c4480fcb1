"""What the agent makes of a rank's interval records (:mod:`phalanx.api.intervals`): its current
``RankActivity`` (the collective it is in, what it entered, its median step and collective times) and the
intervals its next heartbeat sends. Pure: fed the reader's batches, asked for protos."""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

from phalanx.api import limits
from phalanx.api.intervals import BEGIN, END, MARK, Batch, Record
from phalanx.api.v1 import master_pb2 as pb

_RECENT = 64  # recent steps whose durations give the medians


@dataclass
class Tracker:
    """Folds a rank's records into its current ``RankActivity`` and the intervals not yet sent. Pure: feed
    it batches, ask it for protos."""

    entered: dict[str, int] = field(default_factory=dict)
    open: dict[tuple[str, str, int], Record] = field(default_factory=dict)
    """Intervals begun and not yet ended, by (name, group, number)."""
    last_record_ns: int = 0
    last_mark: Record | None = None
    step_times: deque[float] = field(default_factory=lambda: deque(maxlen=_RECENT))
    timed_steps: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=_RECENT))
    """(step time, time in collectives) of the recent steps whose collectives were recorded: every step of
    a script that records them, one in a while of a plain script (:mod:`phalanx.instrument` samples)."""
    pending: deque[pb.Interval] = field(default_factory=lambda: deque(maxlen=limits.MAX_INTERVALS_PER_BEAT))
    """Intervals to send with the next heartbeat, newest kept."""
    lost: int = 0
    _in_collectives_ns: int = 0

    @property
    def active(self) -> bool:
        """Has the rank's recorder written anything?"""
        return self.last_record_ns > 0

    def feed(self, batch: Batch) -> None:
        self.lost += batch.lost
        self.last_record_ns = max(self.last_record_ns, batch.last_record_ns)
        for r in batch.records:
            self.last_record_ns = max(self.last_record_ns, r.unix_ns)
            if r.kind == MARK:
                self._mark(r)
            elif r.kind == BEGIN:
                self.open[(r.name, r.group, r.number)] = r
                if r.group:
                    self.entered[r.group] = max(self.entered.get(r.group, 0), r.number)
            elif r.kind == END:
                began = self.open.pop((r.name, r.group, r.number), None)
                if began is not None and r.group:
                    self._in_collectives_ns += max(0, r.unix_ns - began.unix_ns)
                    self.pending.append(_interval(began, end_ns=r.unix_ns, device=r.device))

    def _mark(self, r: Record) -> None:
        prev = self.last_mark
        if prev is not None and r.number > prev.number:
            steps = r.number - prev.number
            seconds = (r.unix_ns - prev.unix_ns) / 1e9 / steps
            self.step_times.append(seconds)
            if self._in_collectives_ns > 0:  # else its collectives were not recorded, or it had none
                self.timed_steps.append((seconds, self._in_collectives_ns / 1e9 / steps))
            self.pending.append(
                pb.Interval(name="step", seq=r.number, start_unix_ns=prev.unix_ns, end_unix_ns=r.unix_ns)
            )
        self._in_collectives_ns = 0
        self.last_mark = r

    def current(self) -> Record | None:
        """The newest collective entered and not complete."""
        collectives = [r for r in self.open.values() if r.group]
        return max(collectives, key=lambda r: r.index, default=None)

    def device_pending_since_ns(self) -> int:
        """When the oldest device work still pending was recorded; 0 when none is."""
        return min((r.unix_ns for r in self.open.values() if r.device), default=0)

    def activity(self) -> pb.RankActivity:
        act = pb.RankActivity(
            last_record_unix_ns=self.last_record_ns,
            device_pending_since_unix_ns=self.device_pending_since_ns(),
        )
        # The two medians over the same steps: their difference is the compute time the straggler scores
        # compare, which a step time over other steps than the collective times would skew.
        if self.timed_steps:
            act.step_time_s = statistics.median(s for s, _ in self.timed_steps)
            act.collective_time_s = statistics.median(c for _, c in self.timed_steps)
        elif self.step_times:
            act.step_time_s = statistics.median(self.step_times)
        cur = self.current()
        if cur is not None:
            act.current.CopyFrom(_interval(cur, end_ns=0, device=cur.device))
        for group, seq in self.entered.items():
            act.entered[group] = seq
        return act

    def take_intervals(self) -> list[pb.Interval]:
        """The intervals closed since the previous call (at most MAX_INTERVALS_PER_BEAT, the newest)."""
        out = list(self.pending)
        self.pending.clear()
        return out


def _interval(began: Record, *, end_ns: int, device: bool) -> pb.Interval:
    """The collective ``began`` opened, ending at ``end_ns`` (0: still open)."""
    return pb.Interval(
        name=began.name,
        group=began.group,
        seq=began.number,
        start_unix_ns=began.unix_ns,
        end_unix_ns=end_ns,
        device=device,
    )
