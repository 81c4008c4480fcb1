"""Hang verdicts: pure functions of what the agent has seen of a rank (its beacon and, when the training
process runs the interval recorder, its ``RankActivity``) and ``now``; and, on the master, the suspects
across ranks.

A rank is hung when it shows no progress for longer than an adaptive timeout, ``max(floor, factor * p99)``
of its recent step intervals (so a job with 30 s steps is not declared hung after 60 s, and a job with 50 ms
steps is caught after the floor), or when it has not reported any step within ``startup_s`` of starting. A
worker that never calls ``phalanx.report_step`` is only ever judged by the startup rule, which is why
``startup_s`` defaults to minutes. The floor is ``floor_s`` (10 s) for a rank that waits in a recorded
collective or on GPU work, where a healthy rank spends a fraction of a step, and ``idle_floor_s`` (60 s)
anywhere else: between collectives, or judged by its beacon alone, a healthy rank may be persisting a
checkpoint, evaluating or tearing down after its last step. A stalled rank is still caught in ``floor_s``
when its peers run the recorder: they wait for it in their next collective.

With the recorder (:mod:`phalanx.intervals`) the verdict says where the rank is stuck
(:func:`evidence_verdict`):

- **device**: work recorded on the GPU (a CUDA event at a collective's end or at a step boundary) has not
  completed for longer than the timeout: a kernel or a collective is stuck on the device;
- **host**: the process recorded nothing (no step boundary, no collective start or end) for longer than the
  timeout: Python, the data loader, or a blocking CPU collective is stuck;
- **beacon**: no recorder; the step beacon alone went stale.

Across ranks (:func:`find_suspects`): the ranks that wait in collective N of group G (entered, not complete)
wait for the members of G that never entered N; those are the suspects, not the ranks that reported.

Which node a hang counts against (:func:`blame`): the one the evidence singles out, or none. A beacon-only
hang of two nodes looks the same from both sides (both beacons stale within a step of each other, two
stacks that tie), so the node that happened to report first must not be charged: a victim would be evicted
as "hung twice" at the next hang of its peer.
"""

from __future__ import annotations

import json
import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from phalanx.api import intervals, limits
from phalanx.api.settings import HangSettings
from phalanx.api.v1 import master_pb2 as pb

_WINDOW = 128  # recent step intervals kept per rank for the p99
SIDES = ("device", "host", "beacon")


@dataclass
class RankHistory:
    """What the agent has observed of one worker's beacon in the current round."""

    started_at: float
    """Agent clock (seconds) when the worker was started or handed its round."""
    last_step: int = -1
    last_change_at: float | None = None
    """Agent clock when ``last_step`` was first seen."""
    intervals: deque[float] = field(default_factory=lambda: deque(maxlen=_WINDOW))

    def observe(self, *, step: int, now: float) -> None:
        """Records a beacon reading taken at ``now``."""
        if step == self.last_step:
            return
        if step >= 0 and self.last_change_at is not None and self.last_step >= 0:
            steps = max(1, step - self.last_step)
            interval = (now - self.last_change_at) / steps
            self.intervals.extend([interval] * min(steps, 4))
        self.last_step = step
        self.last_change_at = now


@dataclass(frozen=True)
class HangVerdict:
    hung: bool
    age_s: float
    """Seconds since the last progress (or since start before the first step)."""
    timeout_s: float
    """The timeout the age was compared with."""
    reason: str = ""
    side: str = ""
    """Where the rank is stuck when hung: device, host or beacon (see the module docstring)."""


def p99(values: list[float]) -> float:
    """The 99th percentile (nearest rank); 0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


def timeout_for(history: RankHistory, settings: HangSettings, *, waiting: bool = True) -> float:
    """The adaptive timeout for one rank: ``floor_s`` while it ``waiting`` in a recorded collective or on
    the GPU, where a healthy rank spends well under a step; ``idle_floor_s`` elsewhere, where a healthy rank
    may be saving a checkpoint, evaluating or tearing down after its last step."""
    floor = settings.floor_s if waiting else settings.idle_floor_s
    return max(floor, settings.factor * p99(list(history.intervals)))


def verdict(history: RankHistory, settings: HangSettings, *, now: float) -> HangVerdict:
    """Is the rank hung at ``now``?"""
    if history.last_step < 0 or history.last_change_at is None:
        age = now - history.started_at
        hung = settings.enabled and age > settings.startup_s
        reason = f"no step reported within {settings.startup_s:g}s of start" if hung else ""
        return HangVerdict(hung=hung, age_s=age, timeout_s=settings.startup_s, reason=reason)
    age = now - history.last_change_at
    timeout = timeout_for(history, settings, waiting=False)  # a beacon cannot tell where the rank is
    hung = settings.enabled and age > timeout
    reason = (
        f"no progress past step {history.last_step} for {age:.1f}s (timeout {timeout:.1f}s)" if hung else ""
    )
    return HangVerdict(hung=hung, age_s=age, timeout_s=timeout, reason=reason, side="beacon" if hung else "")


def evidence_verdict(
    history: RankHistory,
    settings: HangSettings,
    *,
    now: float,
    activity: pb.RankActivity | None,
    now_unix_ns: int,
) -> HangVerdict:
    """Is the rank hung at ``now``, and where? ``activity`` is the rank's recorder state (None or empty:
    no recorder, the beacon verdict). ``now`` is the agent's monotonic clock (for the beacon history),
    ``now_unix_ns`` the wall clock the recorder's times are comparable with."""
    if activity is None or activity.last_record_unix_ns <= 0 or history.last_step < 0:
        return verdict(history, settings, now=now)  # no recorder yet, or the startup rule
    pending = activity.device_pending_since_unix_ns
    device_age = (now_unix_ns - pending) / 1e9 if pending > 0 else 0.0
    host_age = (now_unix_ns - activity.last_record_unix_ns) / 1e9
    timeout = timeout_for(history, settings, waiting=True)
    idle_timeout = timeout if activity.current.name else timeout_for(history, settings, waiting=False)
    if settings.enabled and device_age > timeout:
        side, age = "device", device_age
    elif settings.enabled and host_age > idle_timeout:
        side, age, timeout = "host", host_age, idle_timeout
    else:
        return HangVerdict(hung=False, age_s=max(device_age, host_age), timeout_s=idle_timeout)
    where = _where(activity, last_step=history.last_step)
    reason = f"{where} ({side} side, {age:.1f} s > {timeout:.1f} s)"
    return HangVerdict(hung=True, age_s=age, timeout_s=timeout, reason=reason, side=side)


SIGNAL_STOPPED = "T"
"""The ``/proc/<pid>/stat`` state of a process stopped by a signal (SIGSTOP, SIGTSTP): ``stopped_s`` judges
it. A process stopped by a tracer (``t``: a debugger, or py-spy reading its stack for a moment) is not."""


def stopped_verdict(settings: HangSettings, *, stopped_for_s: float, last_step: int) -> HangVerdict:
    """Is a rank whose process has been stopped by a signal for ``stopped_for_s`` hung? After ``stopped_s``:
    a stopped process cannot run until someone resumes it, so its peers' wait is not a slow step or a
    checkpoint, whatever the job's step times, and the floors' margin for those is not needed."""
    timeout = settings.stopped_s
    if not (settings.enabled and stopped_for_s > timeout):
        return HangVerdict(hung=False, age_s=stopped_for_s, timeout_s=timeout)
    took = f"{stopped_for_s:.1f} s > {timeout:.1f} s"
    reason = f"after step {last_step}, stopped by a signal (host side, {took})"
    return HangVerdict(hung=True, age_s=stopped_for_s, timeout_s=timeout, reason=reason, side="host")


def _where(activity: pb.RankActivity, *, last_step: int) -> str:
    cur = activity.current
    if cur.name:
        return f"in {cur.name} #{cur.seq} of {cur.group}"
    return f"after step {last_step}, in no collective"


def describe(rank: int, v: HangVerdict) -> str:
    """The hang's one-line reason, e.g.
    ``rank 1 hung in all_reduce #41 of dp:0,1 (host side, 12.3 s > 10.0 s)`` (beacon verdicts keep their
    old form: ``rank 1 hung: no progress past step ...``)."""
    if v.side in ("device", "host"):
        return f"rank {rank} hung {v.reason}"
    return f"rank {rank} hung: {v.reason}"


def evidence(v: HangVerdict, activity: pb.RankActivity | None) -> pb.HangEvidence:
    """The verdict as the failure report carries it."""
    ev = pb.HangEvidence(side=v.side or "beacon", age_s=v.age_s, timeout_s=v.timeout_s)
    if activity is not None:
        ev.activity.CopyFrom(activity)
    return ev


def evidence_view(failure: pb.WorkerFailure) -> dict[str, Any] | None:
    """A hung rank's evidence as the master keeps it with the failure (JSON): the verdict's side and ages,
    the collective the rank was in, and its NCCL flight-recorder dump (torch's JSON, as text: a dump cut at
    the agent's bound is not valid JSON). None when the report carries none. Cut to the agent's bounds, not
    trusted to keep them."""
    if not failure.HasField("hang"):
        return None
    ev = failure.hang
    view: dict[str, Any] = {
        "rank": failure.rank,
        "local_rank": failure.local_rank,
        "side": ev.side if ev.side in SIDES else "beacon",
        "age_s": round(ev.age_s, 3),
        "timeout_s": round(ev.timeout_s, 3),
    }
    current = ev.activity.current
    if current.name:
        view["collective"] = {
            "op": current.name[: limits.MAX_NAME_CHARS],
            "group": current.group[: limits.MAX_NAME_CHARS],
            "seq": current.seq,
        }
    if ev.nccl_trace:
        view["nccl_trace"] = ev.nccl_trace[: limits.MAX_NCCL_TRACE_BYTES + 16]  # + the cut marker
    return view


def flight_recorder_summary(text: str) -> str:
    """A hung rank's flight-recorder dump (torch's JSON) in a few words: its entries and, per process group,
    the last collective enqueued and the last completed; the first one between them is where the rank
    waits. A dump cut at the agent's bound is no JSON: its length is all that is said."""
    try:
        dump = json.loads(text)
    except ValueError:
        return f"flight recorder: {len(text)} characters, cut"
    if not isinstance(dump, dict):
        return "flight recorder: not a dump"
    if "error" in dump:
        return f"flight recorder: none ({str(dump['error'])[:200]})"
    entries = dump.get("entries")
    said = [f"{len(entries) if isinstance(entries, list) else 0} entries"]
    status = dump.get("pg_status")
    for pg, st in sorted(status.items())[:4] if isinstance(status, dict) else []:
        if isinstance(st, dict):
            enqueued, completed = st.get("last_enqueued_collective"), st.get("last_completed_collective")
            said.append(f"pg {pg} enqueued #{enqueued}, completed #{completed}")
    return "flight recorder: " + "; ".join(said)


@dataclass(frozen=True)
class Suspects:
    """The members of a collective's group that never entered it, while others wait in it."""

    op: str
    group: str
    seq: int
    waiting: list[int]
    """The ranks that entered collective ``seq`` of ``group`` and wait in it."""
    ranks: list[int]
    """The members that never entered it: the suspects."""

    def describe(self) -> str:
        who = ", ".join(str(r) for r in self.ranks)
        waiting = ", ".join(str(r) for r in self.waiting)
        return (
            f"rank(s) {who} never entered {self.op} #{self.seq} of {self.group}; rank(s) {waiting} wait in it"
        )


def find_suspects(activities: dict[int, pb.RankActivity]) -> Suspects | None:
    """From every rank's last activity (global rank -> activity): the collective that ranks wait in, and the
    members of its group that never entered it. When ranks wait in several collectives, the one with most
    suspects (then most waiters) is chosen. None: nobody waits in a collective, or every member entered it
    (then the hang is not one rank's absence: the ranks that reported it are the ones to blame)."""
    waits: dict[tuple[str, int], tuple[str, list[int]]] = {}
    for rank, act in sorted(activities.items()):
        cur = act.current
        if cur.name and cur.group:
            waits.setdefault((cur.group, cur.seq), (cur.name, []))[1].append(rank)
    best: Suspects | None = None
    for (group, seq), (op, waiting) in waits.items():
        _, members = intervals.parse_group(group)
        # A member whose activity is unknown (no heartbeat with one yet) is not accused.
        absent = [m for m in members if m in activities and activities[m].entered.get(group, 0) < seq]
        if not absent:
            continue
        found = Suspects(op=op, group=group, seq=seq, waiting=waiting, ranks=absent)
        if best is None or (len(absent), len(waiting)) > (len(best.ranks), len(best.waiting)):
            best = found
    return best


STOPPED_STATES = frozenset({"T", "t"})
"""``/proc/<pid>/stat`` states of a process that cannot run until someone resumes it: stopped by a signal
(SIGSTOP, SIGTSTP) or by a tracer. Its peers, blocked in a collective, sleep (``S``): the state tells the
stopped rank from its victims even with two ranks, where stacks and beacon ages cannot."""


@dataclass(frozen=True)
class Blame:
    """The node a hang counts against (its second hang evicts it), and the evidence that singles it out."""

    node: str
    """"": no node is singled out; the hang restarts the round and counts against none."""
    why: str


def stopped_ranks(states: Mapping[str, Mapping[int, str]]) -> dict[str, list[int]]:
    """Node -> its ranks whose process was stopped when the agent dumped their stacks (``states``: node ->
    global rank -> process state letter, as ``RankStacks.process_state`` carries it)."""
    out = {n: sorted(r for r, st in ranks.items() if st in STOPPED_STATES) for n, ranks in states.items()}
    return {n: ranks for n, ranks in sorted(out.items()) if ranks}


def blame(
    *,
    members: Sequence[str],
    stopped: Mapping[str, Sequence[int]],
    suspect_nodes: Sequence[str] = (),
    odd_nodes: Sequence[str] = (),
) -> Blame:
    """The node a hang of a round with ``members`` counts against, from the evidence at hand, strongest
    first; each must name exactly one member node:

    1. ``stopped``: the nodes whose ranks' processes are stopped (:func:`stopped_ranks`): such a rank cannot
       run, so it holds up its peers, whatever they look like;
    2. ``suspect_nodes``: the nodes whose ranks never entered the collective the others wait in
       (:func:`find_suspects`, needs the interval recorder);
    3. ``odd_nodes``: the nodes whose stacks differ from a majority of ranks (``compare_stacks`` without a
       fallback: a tie names nobody).

    Otherwise nobody: the node that reported first is not charged, it may be the victim (see the module
    docstring). Nor is the only node of a round for being the only one: a hang without evidence may be the
    script's own (a teardown slower than the idle floor, a deadlock), which a replacement would not fix."""
    member = set(members)

    def one(nodes: Sequence[str]) -> str:
        found = sorted({n for n in nodes if n in member})
        return found[0] if len(found) == 1 else ""

    node = one([n for n, ranks in stopped.items() if ranks])
    if node:
        ranks = ", ".join(str(r) for r in stopped[node])
        return Blame(node, f"rank(s) {ranks} on {node} stopped (SIGSTOP or a tracer)")
    node = one(suspect_nodes)
    if node:
        return Blame(node, f"rank(s) on {node} never entered the collective the others wait in")
    node = one(odd_nodes)
    if node:
        return Blame(node, f"the stacks of {node} differ from the majority")
    several = [n for n, ranks in stopped.items() if ranks and n in member]
    return Blame(
        "",
        "no evidence singles out a node ("
        + (f"ranks stopped on {', '.join(sorted(several))}" if several else "no rank found stopped")
        + ", "
        + (f"suspects on {', '.join(sorted(set(suspect_nodes)))}" if suspect_nodes else "no suspect")
        + ", "
        + (f"odd stacks on {', '.join(sorted(set(odd_nodes)))}" if odd_nodes else "no odd stack")
        + ")",
    )
