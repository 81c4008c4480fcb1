"""One heartbeat's ranks, read once.

A heartbeat carries the progress of each of its node's ranks (8 on a node with 8 GPUs), and a master of a
thousand nodes takes a thousand heartbeats a second. The float check, the node's record, the job's newest
step, the ranks' activities, the step times and the timeline all read the same fields, and each read of a
protobuf field costs about 0.1 us: walked once per reader, the ranks cost a master a third of its work per
heartbeat. :func:`read_ranks` reads each field once, refuses what is not finite as it goes, and hands each
reader what it needs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from phalanx.api.v1 import master_pb2 as pb
from phalanx.master.errors import RequestError

__all__ = ["BeatRanks", "Stepped", "read_ranks"]

Stepped = tuple[int, int, float, float, float]
"""A rank that completed a step in its round: (rank, step, when the step ended in Unix seconds, the
recorder's median step time and the part of it inside collectives; both 0.0 without a recorder)."""


@dataclass(slots=True)  # not frozen: a frozen dataclass's __init__ costs 2 us more, a beat at a time
class BeatRanks:
    """What one heartbeat says of its node's ranks (read only)."""

    progress: list[pb.RankProgress]
    """Every rank, as sent."""
    top: int
    """The highest step any rank reported (-1 before the first, and without ranks)."""
    stepped: list[Stepped]
    """The ranks that completed a step, for the step times."""
    activities: list[tuple[int, pb.RankActivity]]
    """(rank, where it is in its loop) of each rank with an interval recorder."""

    @property
    def recorded(self) -> bool:
        """Whether any rank has an interval recorder (sent an activity, which its intervals come with):
        else the timeline has nothing to keep from a node it keeps nothing of (``RankProgress.intervals``)."""
        return bool(self.activities)


NO_RANKS = BeatRanks(progress=[], top=-1, stepped=[], activities=[])


def _not_finite(
    ranks: list[pb.RankProgress], rank: pb.RankProgress, field: str, value: float
) -> RequestError:
    at = next(i for i, r in enumerate(ranks) if r is rank)  # found again only for the error
    return RequestError(f"ranks[{at}].{field} must be a finite number, got {value!r}"[:200])


def read_ranks(req: pb.HeartbeatRequest) -> BeatRanks:
    """Reads ``req.ranks`` once; raises :class:`RequestError` for a number that is not finite (nan slips
    past every bound check and then breaks what it feeds: medians, the JSON of the HTTP API)."""
    if not req.ranks:
        return NO_RANKS
    isfinite = math.isfinite
    progress = list(req.ranks)
    top = progress[0].step
    stepped: list[Stepped] = []
    activities: list[tuple[int, pb.RankActivity]] = []
    for r in progress:
        age = r.beacon_age_s
        if not isfinite(age):
            raise _not_finite(progress, r, "beacon_age_s", age)
        rank, step, step_unix_ns = r.rank, r.step, r.step_unix_ns
        step_time_s = collective_time_s = 0.0
        if r.HasField("activity"):  # else reading it would build an empty one
            activity = r.activity
            step_time_s, collective_time_s = activity.step_time_s, activity.collective_time_s
            if not isfinite(step_time_s):
                raise _not_finite(progress, r, "activity.step_time_s", step_time_s)
            if not isfinite(collective_time_s):
                raise _not_finite(progress, r, "activity.collective_time_s", collective_time_s)
            activities.append((rank, activity))
        if step > top:  # noqa: PLR1730 (not max(): a call costs more, 8 times a beat)
            top = step
        if step >= 0 and step_unix_ns > 0:
            stepped.append((rank, step, step_unix_ns / 1e9, step_time_s, collective_time_s))
    return BeatRanks(progress=progress, top=top, stepped=stepped, activities=activities)
