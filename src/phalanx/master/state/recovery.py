"""Where a recovery's time goes, for the recovery breakdown (metrics and the Grafana panel).

A recovery starts when the master restarts the job (a worker failure or a hang) or opens a new round for
another reason (a node lost or evicted), and ends when training is back where it was. Its four phases:

==========  ==========================================================================================
detect      the failure (the root cause's own time: its error, or when its agent saw it exit) to the
            master's decision to restart; 0 and not observed when the master has no failure time
reform      the decision to the next rendezvous round completing (the survivors and any replacement
            regroup)
restore     the round completing to the first step a rank reports in it (processes start, the checkpoint
            is loaded, the first step runs)
recompute   that first step to a rank reaching again the highest step reached before the failure (the
            steps lost since the restored checkpoint, trained again); 0 when nothing was lost
==========  ==========================================================================================

Pure bookkeeping with injected times; the master calls it from its event and heartbeat paths. It is part
of the master's durable state (:meth:`RecoveryTracker.to_json`): a master restarted mid-recovery finishes
the recovery with its phases dated from the first failure, and the totals behind the metrics carry on.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["BUCKETS", "PHASES", "Recovery", "RecoveryTracker"]

PHASES = ("detect", "reform", "restore", "recompute")
BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
"""Histogram bounds (seconds): from a sub-second in-place restart to a replacement node's cold start."""


@dataclass
class Recovery:
    """One recovery in progress; times are Unix seconds, 0 where not reached yet."""

    started: float
    """When the master decided to restart (or opened the round)."""
    failed: float
    """The failure's own time; 0: unknown (no detect phase)."""
    lost_step: int
    """The highest step reached before the failure: training is back once a rank reaches it again."""
    reformed: float = 0.0
    resumed: float = 0.0

    def durations(self, *, caught_up: float) -> dict[str, float]:
        """The phases' seconds, of those this recovery went through by ``caught_up`` (0: not caught up)."""
        out: dict[str, float] = {}
        if self.failed > 0:
            out["detect"] = max(0.0, self.started - self.failed)
        if self.reformed > 0:
            out["reform"] = max(0.0, self.reformed - self.started)
            if self.resumed > 0:
                out["restore"] = max(0.0, self.resumed - self.reformed)
                if caught_up > 0:
                    out["recompute"] = max(0.0, caught_up - self.resumed)
        return out


def _zeros() -> dict[str, list[int]]:
    return {p: [0] * (len(BUCKETS) + 1) for p in PHASES}


@dataclass
class RecoveryTracker:
    """The recovery in progress and the finished ones: the last one's phases and a histogram per phase."""

    current: Recovery | None = None
    finished: int = 0
    last: dict[str, float] = field(default_factory=dict)
    """The phases of the newest finished recovery."""
    counts: dict[str, list[int]] = field(default_factory=_zeros)
    """Per phase, observations per bucket (the last one: above every bound); not cumulative."""
    sums: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))

    def start(self, *, now: float, failed: float, step: int) -> None:
        """A restart (or a new round) at ``now`` for a failure at ``failed`` (0: unknown) with training at
        ``step``. A recovery still in progress (a failure during a recovery) ends here with what it has:
        its phases count, and the new one starts from the old one's lost step, the step to get back to."""
        if self.current is not None:
            step = max(step, self.current.lost_step)
            self._finish(caught_up=0.0)
        self.current = Recovery(started=now, failed=failed if 0 < failed <= now else 0.0, lost_step=step)

    def reformed(self, *, now: float) -> None:
        """A rendezvous round completed."""
        if self.current is not None and self.current.reformed == 0:
            self.current.reformed = now

    def stepped(self, *, now: float, step: int) -> bool:
        """A rank of the re-formed round reported ``step`` (at ``now``); whether the recovery moved (it
        resumed or caught up): the caller then saves the durable state, so a master restarted after it does
        not date the move again."""
        cur = self.current
        if cur is None or cur.reformed == 0 or step < 0:
            return False
        moved = cur.resumed == 0
        if moved:
            cur.resumed = now
        if step >= cur.lost_step:
            self._finish(caught_up=now)
            moved = True
        return moved

    def _finish(self, *, caught_up: float) -> None:
        cur, self.current = self.current, None
        if cur is None:
            return
        self.last = cur.durations(caught_up=caught_up)
        for phase, seconds in self.last.items():
            self.counts[phase][bisect.bisect_left(BUCKETS, seconds)] += 1
            self.sums[phase] += seconds
        self.finished += 1

    def histogram(self, phase: str) -> tuple[list[tuple[str, float]], float]:
        """Cumulative ``(le, count)`` buckets, ``+Inf`` last, and the sum: Prometheus' histogram form."""
        total, out = 0, []
        for bound, n in zip([*map(str, BUCKETS), "+Inf"], self.counts[phase], strict=True):
            total += n
            out.append((bound, float(total)))
        return out, self.sums[phase]

    def to_json(self) -> dict[str, Any]:
        """The tracker as plain JSON, for the master's durable state. The bucket bounds go with the counts,
        so a master with other bounds does not misread them."""
        return {
            "current": None if self.current is None else asdict(self.current),
            "finished": self.finished,
            "last": dict(self.last),
            "buckets": list(BUCKETS),
            "counts": {p: list(self.counts[p]) for p in PHASES},
            "sums": {p: self.sums[p] for p in PHASES},
        }

    @classmethod
    def from_json(cls, saved: Mapping[str, Any] | None) -> RecoveryTracker:
        """The tracker :meth:`to_json` saved; a fresh one for None (a state saved before it was durable).
        Raises KeyError, TypeError or ValueError for a malformed one."""
        if saved is None:
            return cls()
        cur = saved.get("current")
        tracker = cls(
            current=None
            if cur is None
            else Recovery(
                started=float(cur["started"]),
                failed=float(cur["failed"]),
                lost_step=int(cur["lost_step"]),
                reformed=float(cur.get("reformed", 0.0)),
                resumed=float(cur.get("resumed", 0.0)),
            ),
            finished=int(saved.get("finished", 0)),
            last={str(p): float(v) for p, v in dict(saved.get("last", {})).items() if p in PHASES},
        )
        counts = {p: [int(n) for n in saved.get("counts", {}).get(p, [])] for p in PHASES}
        if [float(b) for b in saved.get("buckets", [])] == list(BUCKETS) and all(
            len(c) == len(BUCKETS) + 1 for c in counts.values()
        ):
            tracker.counts = counts
            tracker.sums = {p: float(saved.get("sums", {}).get(p, 0.0)) for p in PHASES}
        # Other bounds: the histogram starts again (as after a counter reset); the total and the last stay.
        return tracker
