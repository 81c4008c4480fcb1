"""How a job ends and pauses, in one reconciliation pass: failing it, cleaning up after it, deleting it after
``spec.ttlAfterFinished``, its active deadline's clock, and suspending it. Pure: the actions go into the
:class:`Pass`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from phalanx.api.elasticjob import Phase
from phalanx.api.errors import ConfigError
from phalanx.operator import resources
from phalanx.operator.actions import DeletePod, Event
from phalanx.operator.conditions import get_condition, is_true, parse_rfc3339, rfc3339
from phalanx.operator.context import Pass
from phalanx.operator.spec import JobSpec, ttl_after_finished
from phalanx.operator.workers import newest_incarnations

SUSPENDING_REASONS = ("Suspending", "Resuming")
"""Reasons of a False ``Suspended`` condition while a suspension (or the resume after one) is under way."""
SUSPENDING_SINCE = "suspendingSince"
"""The status field with the time the operator began waiting for the master to acknowledge a suspension."""

# --- Ending a job -----------------------------------------------------------------------------------------


def fail(ctx: Pass, *, reason: str, message: str, spec: JobSpec | None = None) -> None:
    """Fails the job: the Failed condition, phase and Event, and its Pods cleaned up per cleanPodPolicy."""
    ctx.condition("Failed", True, reason, message)
    ctx.condition("Running", False, reason, "the job failed")
    ctx.condition("Restarting", False, reason, "the job failed")
    not_suspended(ctx, reason)
    ctx.out["phase"] = Phase.FAILED
    ctx.actions.append(Event("Warning", "Failed", message))
    cleanup(ctx, spec=spec, finished_for=0.0)


def succeed(ctx: Pass, spec: JobSpec) -> None:
    """The master's verdict is success: the job Succeeded, its Pods cleaned up per cleanPodPolicy."""
    ctx.condition("Succeeded", True, "TrainingCompleted", "all nodes finished training")
    ctx.condition("Running", False, "Completed", "the job finished")
    ctx.condition("Restarting", False, "Completed", "the job finished")
    not_suspended(ctx, "Completed")
    ctx.out["phase"] = Phase.SUCCEEDED
    ctx.actions.append(Event("Normal", "Succeeded", "training completed"))
    cleanup(ctx, spec=spec, finished_for=0.0)


def master_failure(reason: str, spec: JobSpec) -> tuple[str, str]:
    """The Failed condition's reason and message for the master's verdict. A flash-checkpoint save that did
    not fit in /dev/shm gets a reason of its own and says which field to raise."""
    if not resources.shared_memory_exhausted(reason):
        return "MasterReportedFailure", reason
    if spec.shared_memory is None:
        hint = "spec.sharedMemory is disabled: enable it (the container runtime's /dev/shm is 64Mi)"
    else:
        size = resources.format_mib(spec.shared_memory)
        fits = resources.format_mib(resources.state_fits(spec.shared_memory, spec.nproc_per_node))
        hint = (
            f"/dev/shm is {size} (spec.sharedMemory.sizeLimit): two slots for each of {spec.nproc_per_node} "
            f"ranks hold about {fits} of checkpointed state per rank; raise sizeLimit (and the container's "
            "memory limit, which its pages count against)"
        )
    return "SharedMemoryExhausted", f"{reason}; {hint}"


def cleanup(ctx: Pass, *, finished_for: float, spec: JobSpec | None = None) -> None:
    """Deletes the finished job's Pods per spec.cleanPodPolicy (None, Running or All).

    Pods still running get ``finish_grace_s`` to exit by themselves first: when the master declares success
    the agents are told to exit at their next heartbeat, and a succeeded job's Pods should read Completed,
    not deleted. A later pass (the timer) deletes whatever still runs after the grace.
    """
    job = ctx.job
    policy = spec.clean_pod_policy if spec else str((job.get("spec") or {}).get("cleanPodPolicy", "Running"))
    if policy == "None":
        return
    for pod in ctx.pods:
        if pod.terminating:
            continue
        overdue = pod.live and finished_for >= ctx.settings.finish_grace_s
        if overdue or (policy == "All" and not pod.live):
            ctx.actions.append(DeletePod(pod.name))


def finished_at(status: Mapping[str, Any]) -> float | None:
    """When the job's Succeeded or Failed condition became true (None if it has not)."""
    for kind in ("Succeeded", "Failed"):
        c = get_condition(status.get("conditions") or [], kind)
        if c and c.get("status") == "True" and c.get("lastTransitionTime"):
            return parse_rfc3339(str(c["lastTransitionTime"]))
    return None


def finished_for(status: Mapping[str, Any], now: float) -> float:
    """Seconds since the job's Succeeded or Failed condition became true (0 if it has not)."""
    at = finished_at(status)
    return 0.0 if at is None else max(0.0, now - at)


def ttl_expired(job: Mapping[str, Any], status: Mapping[str, Any], *, phase: Phase | None, now: float) -> str:
    """Why the finished job is to be deleted now per spec.ttlAfterFinished; "" while it is kept.

    The field is read on its own, not through :func:`parse_spec`: a job that failed for an invalid spec
    is deleted too. One whose ttlAfterFinished itself cannot be read is kept (admission refuses those).
    """
    spec = job.get("spec")
    if not isinstance(spec, Mapping):
        return ""
    try:
        ttl = ttl_after_finished(spec)
    except ConfigError:
        return ""
    at = finished_at(status)
    if ttl is None or at is None or now - at < ttl:
        return ""
    return (
        f"deleting the job: {phase} since {rfc3339(at)}, longer than spec.ttlAfterFinished "
        f"({spec.get('ttlAfterFinished')})"
    )


def start_time(status: Mapping[str, Any], now: float) -> float:
    """When the job started or was last resumed (``status.startTime``). A job from before that field counts
    from its Created condition, or from its Suspended condition turning False (a resume) if later; a new
    job from now."""
    if text := status.get("startTime"):
        return parse_rfc3339(str(text))
    conditions = status.get("conditions") or []
    times = [
        parse_rfc3339(str(c["lastTransitionTime"]))
        for kind, value in (("Created", "True"), ("Suspended", "False"))
        if (c := get_condition(conditions, kind)) and c.get("status") == value and c.get("lastTransitionTime")
    ]
    return max(times, default=now)


# --- Suspension -------------------------------------------------------------------------------------------


def suspension(status: Mapping[str, Any]) -> str:
    """Where the job stood with a suspension at the start of the pass: "suspended", "suspending" (asked
    for, or being resumed from, but not finished), or "" (none)."""
    conditions = status.get("conditions") or []
    if status.get("phase") == Phase.SUSPENDED or is_true(conditions, "Suspended"):
        return "suspended"
    c = get_condition(conditions, "Suspended")
    return "suspending" if c and c.get("reason") in SUSPENDING_REASONS else ""


def never_started(ctx: Pass) -> bool:
    """Whether the job has never had a Pod nor heard from a master: created suspended (as a queue such as
    Kueue creates the jobs it holds) and never resumed."""
    incarnations = ctx.status.get("workerIncarnations") or []
    return not ctx.pods and not ctx.master_status and all(int(i) < 0 for i in incarnations)


def held(ctx: Pass) -> None:
    """A job created suspended: Suspended at once, with no master Pod either. Queued, it holds nothing of
    the cluster's (a master per waiting job would take resources outside the queue's quota); the master is
    created when spec.suspend turns false, and the job then starts as any new one."""
    if ctx.phase != Phase.SUSPENDED:
        ctx.actions.append(Event("Normal", "Suspended", "created suspended: no Pod runs until it is resumed"))
    ctx.condition("Suspended", True, "CreatedSuspended", "no Pod runs; set spec.suspend to false to start")
    ctx.out["phase"] = Phase.SUSPENDED


def suspend(ctx: Pass, spec: JobSpec, *, acked: bool) -> None:
    """spec.suspend is true: free the job's worker nodes, the master Pod stays (small, no GPU, the state).

    The worker Pods go only after the master acknowledged (``acked``: ``status.master.phase`` Suspended):
    before, it would count them as lost and spend the eviction budget on them. A master that has not
    acknowledged within the operator's ``suspend_ack_timeout_s`` (gone, stuck, unschedulable) holds the
    nodes no longer: the Pods go then, with a Warning. Deletion is graceful: an agent persists its newest
    in-memory checkpoint on SIGTERM, and the job is Suspended only once every Pod is gone. Nothing here is a
    replacement; the incarnations are kept so that resumed Pods get new names.
    """
    workers, phase = ctx.workers, ctx.phase
    ctx.out["workerIncarnations"] = newest_incarnations(ctx.status, workers, slots=spec.max_nodes)
    # A job already Suspended with no worker Pod left stays so while the master catches up with a spec edit
    # (a new generation): there is nothing left to delete, hence nothing to wait for.
    settled = not workers and suspension(ctx.status) == "suspended"
    overdue = not acked and not settled and _ack_overdue(ctx)
    if not acked and not settled and not overdue:
        # A failing worker is not replaced either: the job is about to stop anyway.
        message = "waiting for the master to acknowledge the suspension before deleting worker Pods"
        ctx.condition("Suspended", False, "Suspending", message)
        ctx.out["phase"] = phase or Phase.CREATED
        return
    stop = [w for w in workers if not w.terminating]
    live = [w for w in stop if w.live]
    for w in stop:  # a finished Pod has nothing left to persist
        ctx.actions.append(DeletePod(w.name, grace_period_s=None if w.live else 0))
    if stop and overdue:
        limit = ctx.settings.suspend_ack_timeout_s
        message = (
            f"the master did not acknowledge the suspension within {limit:g}s (gone or stuck): deleting "
            "the worker Pods without it; their departures may count as lost nodes when it comes back"
        )
        ctx.actions.append(Event("Warning", "SuspendedWithoutMaster", message))
    if stop:
        finished = len(stop) - len(live)
        message = f"deleting {len(live)} worker Pods; each persists its newest checkpoint first"
        if finished:
            message += f" (and {finished} finished ones)"
        ctx.actions.append(Event("Normal", "Suspending", message))
    if workers:  # terminating ones too: they are still persisting their checkpoint
        ctx.condition("Suspended", False, "Suspending", f"waiting for {len(workers)} worker Pods to stop")
        return
    ctx.out[SUSPENDING_SINCE] = None
    ctx.condition(
        "Suspended", True, "JobSuspended", "no worker Pods run; set spec.suspend to false to resume"
    )
    ctx.condition("Running", False, "Suspended", "the job is suspended")
    ctx.condition("Restarting", False, "Suspended", "the job is suspended")
    if phase != Phase.SUSPENDED:
        ctx.actions.append(
            Event("Normal", "Suspended", "the job is suspended; its master Pod keeps its state")
        )
    ctx.out["phase"] = Phase.SUSPENDED


def _ack_overdue(ctx: Pass) -> bool:
    """Whether the master has had ``suspend_ack_timeout_s`` to acknowledge the suspension, counted from the
    first pass that waited for it (``status.suspendingSince``, kept until the job is Suspended or resumed)."""
    since_text = ctx.status.get(SUSPENDING_SINCE)
    since = parse_rfc3339(str(since_text)) if since_text else ctx.now
    ctx.out[SUSPENDING_SINCE] = rfc3339(since)
    return ctx.now - since >= ctx.settings.suspend_ack_timeout_s


def not_suspended(ctx: Pass, reason: str) -> None:
    """A job that finishes is no longer suspended (the master may end a suspended job); a job that never
    was keeps having no Suspended condition."""
    ctx.out[SUSPENDING_SINCE] = None
    if get_condition(ctx.conditions, "Suspended"):
        ctx.condition("Suspended", False, reason, "the job finished")
