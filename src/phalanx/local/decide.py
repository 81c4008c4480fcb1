"""The decisions of ``phalanx local``, pure: what it observed in, what to do out.

:class:`phalanx.local.cluster.LocalCluster` observes (the master's HTTP API, the workers' beacons, the
clock) and carries out what these functions decide, as the operator's executor carries out its reconcile
decisions; so each decision is unit-tested without a process.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import TypeVar

from phalanx.api import views
from phalanx.api.elasticjob import FINISHED_PHASES, Phase
from phalanx.local.inject import SLOW_KINDS, UNNOTICED_KINDS, Injection
from phalanx.local.report import FailureRecord

Steps = dict[tuple[str, int], tuple[int, int, int]]
"""(node id, local rank) -> (step, unix_ns, pid) of every live node's workers, from their beacons."""

T = TypeVar("T")

RANK_KINDS = ("kill-worker", "hang-worker")
"""Faults that hit one worker (one local rank) of a node, not the node."""
ATTRIBUTED_EVENTS = ("failure", "node_disconnected", "node_lost", "hang", "eviction_requested", "slow_steps")
"""Events of the job that mark an injected fault on their node as detected."""
END_GRACE_S = 15.0
"""How long after the master reports the job finished the nodes get to exit by themselves."""
IDLE_LIMIT_S = 10.0
"""How long every node may have exited, with nothing left to start, before the run gives up on the master."""
STATUS_EVERY_S = 1.0
"""Shortest time between two status lines."""


def job_step(steps: Steps, *, fallback: int) -> int:
    """The step every live rank has completed (the slowest rank's), ``fallback`` before any rank stepped."""
    stepped = [s for (s, _, _) in steps.values() if s >= 0]
    return min(stepped) if stepped else fallback


def node_id(index: int) -> str:
    """The node id of the node started ``index``-th (replacements get new ones)."""
    return f"node-{index}"


def should_inject(inj: Injection, *, steps: Steps, max_step: int, elapsed_s: float, node_alive: bool) -> bool:
    """Whether a pending fault fires now: it is due (its rank's step, or the highest step for a master kill;
    the time), its node runs, and a fault on one worker has that worker's pid from its beacon."""
    target = node_id(inj.node)
    step = max_step if inj.kind == "kill-master" else steps.get((target, inj.rank), (-1, 0, 0))[0]
    if not inj.due(step=step, elapsed_s=elapsed_s):
        return False
    if inj.kind != "kill-master" and not node_alive:
        return False
    pid = steps.get((target, inj.rank), (-1, 0, 0))[2]
    return not (inj.kind in RANK_KINDS and pid <= 0)


def failure_record(
    inj: Injection, *, steps: Steps, max_step: int, round_: int, injected_at: float
) -> FailureRecord:
    """The record of a fault as it fires: where it hit, the step and round the job was at, and the workers
    it spared (which tell an in-process regroup from a restart later)."""
    target = node_id(inj.node)
    return FailureRecord(
        kind=inj.kind,
        node=target if inj.kind != "kill-master" else "master",
        rank=inj.rank if inj.kind in RANK_KINDS else -1,
        injected_at=injected_at,
        step_at_injection=job_step(steps, fallback=max_step),
        round_at_injection=round_,
        survivors={
            f"{n}/{lr}": pid
            for (n, lr), (_, _, pid) in steps.items()
            if n != target or (inj.kind in RANK_KINDS and lr != inj.rank)
        },
    )


def recovery_since_ns(
    f: FailureRecord, *, round_now: int, phase: Phase | None, t0_unix_ns: int, now_ns: int
) -> int | None:
    """Since when (unix ns) a completed step proves the job recovered from ``f``; None: not yet, or nothing
    to recover from. Recovery means a step completed by the recovered job: after a new round formed (workers
    restarted), or, for a master kill, after the master answers again (workers never stopped). For a new
    round it is when the round was first seen running (``now_ns`` the first time; the caller keeps it in
    ``f.recovery_round_seen_ns``)."""
    if f.recovered_at is not None:
        return None
    if f.kind in UNNOTICED_KINDS and f.detected_at is None:
        return None  # the job did not notice the fault: there is nothing to recover from
    if f.kind == "kill-master":
        if f.detected_at is None:
            return None
        return t0_unix_ns + int(f.injected_at * 1e9)
    if round_now <= f.round_at_injection or phase != Phase.RUNNING:
        return None
    return f.recovery_round_seen_ns or now_ns


def resumed_step(steps: Steps, *, since_ns: int) -> int | None:
    """The first step completed after ``since_ns`` (the slowest fresh rank's); None while there is none."""
    fresh = [s for (s, ns, _) in steps.values() if ns > since_ns and s >= 0]
    return min(fresh) if fresh else None


def steps_lost(*, step_at_injection: int, resumed: int) -> int:
    """Steps the job completed again after a fault: from the resumed one up to the one done when it hit."""
    return max(0, step_at_injection - resumed + 1)


def new_evictions(
    evictions: list[views.EvictionView], *, handled: Collection[str]
) -> list[views.EvictionView]:
    """The master's evictions not carried out yet, one per node id, in the master's order."""
    out: list[views.EvictionView] = []
    seen = set(handled)
    for ev in evictions:
        if not ev.node_id or ev.node_id in seen:
            continue
        seen.add(ev.node_id)
        out.append(ev)
    return out


def eviction_action(node: str, reason: str | None) -> str:
    """What a fault's record says was done to its node when the master evicted it."""
    return f"evicted {node}" + (f" ({reason})" if reason else "")


def split_due(items: list[tuple[float, T]], *, now: float) -> list[tuple[float, T]]:
    """The timed items (due time, item) whose time has come, in their order."""
    return [(due, item) for due, item in items if now >= due]


def heal_is_moot(inj: Injection, *, nets: Collection[str], cpu_groups: Collection[str]) -> bool:
    """Whether a slow fault's node was evicted before its heal: there is nothing left to heal."""
    where = nets if inj.kind == "slow-network" else cpu_groups
    return inj.kind in SLOW_KINDS and node_id(inj.node) not in where


def status_line(*, max_step: int, job: views.JobView | None, alive: list[str]) -> str:
    """The live progress line: the highest step, the job's phase, round and world, the nodes running."""
    phase, round_, world = (str(job.phase), str(job.round), str(job.world_size)) if job else ("?", "?", "?")
    return f"step {max_step:>5} | {phase:<10} | round {round_} | world {world} | nodes {' '.join(alive)}"


def status_due(line: str, *, last: str, last_at: float, now: float) -> bool:
    """A status line is shown when it changed, at most once a second."""
    return line != last and now - last_at >= STATUS_EVERY_S


@dataclass(frozen=True)
class RunState:
    """When the end of the job was first seen, and since when nothing has run (None: not so)."""

    end_seen_at: float | None = None
    idle_since: float | None = None


@dataclass(frozen=True)
class RunEnd:
    """The run is over: its exit code, the summary's ``exit`` ("" leaves it) and, if set, its reason."""

    code: int
    exit: str = ""
    reason: str = ""


def run_end(
    state: RunState,
    *,
    phase: Phase | None,
    reason: str,
    any_alive: bool,
    work_left: bool,
    now: float,
    timeout_s: float,
) -> tuple[RunState, RunEnd | None]:
    """Whether the run ends now: the job finished and its nodes exited (or had :data:`END_GRACE_S` to), or
    every node exited with nothing left to inject or start for :data:`IDLE_LIMIT_S` while the master did
    not report the end, or the run's time is up. ``work_left``: faults still pending or replacements due."""
    end_seen_at, idle_since = state.end_seen_at, state.idle_since
    if phase in FINISHED_PHASES:
        end_seen_at = end_seen_at if end_seen_at is not None else now
        if not any_alive or now - end_seen_at > END_GRACE_S:
            ok = phase == Phase.SUCCEEDED
            end = RunEnd(code=0 if ok else 1, exit="succeeded" if ok else "failed", reason=reason)
            return RunState(end_seen_at, idle_since), end
    if not any_alive and not work_left:
        idle_since = idle_since if idle_since is not None else now
        if now - idle_since > IDLE_LIMIT_S:
            why = "every node exited but the master did not report the job as finished"
            return RunState(end_seen_at, idle_since), RunEnd(code=1, reason=why)
    else:
        idle_since = None
    if now > timeout_s:
        return RunState(end_seen_at, idle_since), RunEnd(code=1, reason=f"timed out after {timeout_s:g}s")
    return RunState(end_seen_at, idle_since), None
