"""Recovery accounting of ``phalanx local``: what became of each injected fault, written into its
:class:`~phalanx.local.report.FailureRecord` from what the run observed.

No process, no socket, no clock: :class:`phalanx.local.cluster.LocalCluster` hands in the job (the master's
``/v1/job``), its events, the beacons' steps and the time, and prints the lines these functions return.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from phalanx.api import views
from phalanx.api.elasticjob import Phase
from phalanx.local import foldin
from phalanx.local.decide import (
    ATTRIBUTED_EVENTS,
    Steps,
    eviction_action,
    recovery_since_ns,
    resumed_step,
    steps_lost,
)
from phalanx.local.report import FailureRecord, cause_of, recovery_action
from phalanx.local.watch import SeenEvent


def _round(job: views.JobView | None) -> int:
    return job.round if job else 0


def _world(job: views.JobView | None) -> int:
    return job.world_size if job else 0


def master_answers(failures: list[FailureRecord], *, at: float) -> None:
    """For a master kill, "detected" is when the restarted master serves the job again."""
    for f in failures:
        if f.kind == "kill-master" and f.detected_at is None:
            f.detected_at = at


def on_event(failures: list[FailureRecord], ev: SeenEvent) -> None:
    """An event of the job: one about a node marks the fault it is put down to as detected (and an eviction
    as its action); a new round is a step of every pending fold-in."""
    if ev.kind in ATTRIBUTED_EVENTS:
        f = cause_of(failures, node=ev.node, at=ev.at)
        if f is not None:
            f.detected_at = ev.at
            if ev.kind == "eviction_requested":
                f.action = f"evicted {ev.node}"
    if ev.kind == "round_open":
        for f in failures:
            if f.fold_in is not None:
                foldin.round_opened(f.fold_in, at=ev.at, reason=ev.message)


def event_line(ev: views.EventView) -> str:
    """How an event of the job is shown."""
    return "event " + f"{ev.kind:<18} {ev.node:<8} {ev.message}".rstrip()


def track_recovery(
    failures: list[FailureRecord],
    *,
    job: views.JobView | None,
    steps: Steps,
    t0_unix_ns: int,
    now_ns: int,
    at: float,
    is_running: Callable[[int], bool],
) -> list[str]:
    """Marks the faults the job recovered from: a step completed after the recovery began (see
    :func:`~phalanx.local.decide.recovery_since_ns`), and how the job recovered (the spared workers'
    processes, ``is_running``, tell an in-process regroup from a restart). Returns the lines to show."""
    round_now = _round(job)
    lines = []
    for f in failures:
        since_ns = recovery_since_ns(
            f, round_now=round_now, phase=job.phase if job else None, t0_unix_ns=t0_unix_ns, now_ns=now_ns
        )
        if since_ns is None:
            continue
        if f.kind != "kill-master":
            f.recovery_round_seen_ns = since_ns
        resumed = resumed_step(steps, since_ns=since_ns)
        if resumed is None:
            continue
        if f.kind != "kill-master":
            running = {f"{n}/{lr}": pid for (n, lr), (_, _, pid) in steps.items() if is_running(pid)}
            f.recovery = recovery_action(
                survivors=f.survivors, running=running, world=_world(job), round_=round_now
            )
        f.resumed_step = resumed
        f.recovered_at = at
        f.steps_lost = steps_lost(step_at_injection=f.step_at_injection, resumed=resumed)
        lines.append(
            f"recovered from {f.kind} on {f.node}: step {f.resumed_step} completed "
            f"{f.recovered_at - f.injected_at:.2f}s after the fault, {f.steps_lost} steps lost"
        )
    return lines


def evicted(failures: list[FailureRecord], *, node: str, reason: str | None) -> None:
    """The master evicted ``node``: the faults on it say so (once)."""
    for f in failures:
        if f.node == node and "evicted" not in f.action:
            f.action = eviction_action(node, reason)


def replaced(
    failures: list[FailureRecord],
    evictions: list[dict[str, Any]],
    *,
    lost: str,
    new: str,
    job: views.JobView | None,
) -> None:
    """``new`` replaces the evicted ``lost``: its eviction entry and the faults on it say so, and each such
    fault follows the replacement until the job's first step with it (:mod:`.foldin`)."""
    for entry in evictions:
        if entry.get("node_id") == lost and "replacement" not in entry:
            entry["replacement"] = new
    for f in failures:
        if f.node == lost and "replaced" not in f.action:
            f.action += f", replaced by {new}"
            f.fold_in = foldin.started(
                node=new, lost=lost, round_=_round(job), members=job.members if job else [], world=_world(job)
            )


def track_fold_ins(
    failures: list[FailureRecord], *, job: views.JobView | None, steps: Steps, at: float, now_ns: int
) -> list[str]:
    """Follows each fault's replacement until the job's first step with it (:mod:`.foldin`); returns the
    lines to show."""
    folds = [f.fold_in for f in failures if f.fold_in is not None and f.fold_in.folded_at is None]
    if not folds:
        return []
    by_rank = {key: (step, unix_ns) for key, (step, unix_ns, _) in steps.items()}
    lines = []
    for fold in folds:
        done = foldin.observe(
            fold,
            at=at,
            now_ns=now_ns,
            round_=_round(job),
            members=job.members if job else [],
            world=_world(job),
            running=job is not None and job.phase is Phase.RUNNING,
            steps=by_rank,
        )
        if done:
            lines.append(
                f"folded {fold.node} in: step {fold.resumed_step} completed {fold.cost_s or 0.0:.2f}s "
                f"after round {fold.round} opened, {fold.steps_lost} steps lost"
            )
    return lines
