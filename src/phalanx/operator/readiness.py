"""Why the job's Pods do not run, said where people look: the ``PodsReady`` condition, a Warning Event per
distinct cause, and from there ``kubectl describe ej`` and ``phalanx status``. Pure: the condition and events
go into the :class:`Pass`.

A Pod the scheduler cannot place, or whose container the kubelet cannot start (an image that does not exist,
a Secret that is missing) or keeps restarting, is otherwise only a Pending Pod: the job would wait for its
minimum node count and fail much later with a message about nodes, not about the image.

A cause that waiting does not heal (:data:`UNHEALABLE`) fails the job with that cause once it has held the job
back for the operator's ``stuck_pod_timeout_s`` (:func:`unstartable`).
"""

from __future__ import annotations

from phalanx.operator import lifecycle
from phalanx.operator.actions import Event, PodView
from phalanx.operator.conditions import ConditionType, get_condition, parse_rfc3339, rfc3339
from phalanx.operator.context import Pass
from phalanx.operator.spec import JobSpec

CONDITION: ConditionType = "PodsReady"
MAX_MESSAGE = 1024
"""Bytes of the condition's message; the Events say each cause in full."""
UNHEALABLE = frozenset({
    "ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull", "CreateContainerConfigError",
})  # fmt: skip
"""Waiting reasons that waiting does not heal: the image does not exist or cannot be pulled, its name is
invalid, a Secret or ConfigMap the container needs is missing. A registry that is down for a while looks the
same for a while; ``stuck_pod_timeout_s`` is that patience. (Unschedulable is not here: an autoscaler may
add the node. A crash loop is the workers' failure, counted by the restart policy.)"""
STUCK_SINCE = "stuckSince"
"""``status.stuckSince``: since when an unhealable cause has held the job back (:func:`unstartable`)."""


def stuck_pods(pods: list[PodView]) -> list[PodView]:
    """The live Pods that do not run for a cause (:attr:`PodView.stuck`), by name."""
    return sorted((p for p in pods if p.live and p.stuck[0]), key=lambda p: p.name)


def pods_ready(ctx: Pass) -> None:
    """Sets ``PodsReady``: True once every live Pod of the job runs; False with the first stuck Pod's reason
    and every stuck Pod's cause, or reason ``Starting`` while Pods start normally. A cause new to the
    condition gets a Warning Event (the Event aggregation counts repeats up)."""
    live = [p for p in ctx.pods if p.live]
    stuck = stuck_pods(live)
    if stuck:
        reason = stuck[0].stuck[0]
        causes = [f"{p.name}: {p.stuck[0]}: {p.stuck[1]}" for p in stuck]
        message = "; ".join(causes)[:MAX_MESSAGE]
        before = get_condition(ctx.status.get("conditions") or [], CONDITION) or {}
        for p, cause in zip(stuck, causes, strict=True):
            if cause[:MAX_MESSAGE] not in str(before.get("message", "")):
                ctx.actions.append(Event("Warning", p.stuck[0], cause))
        ctx.condition(CONDITION, False, reason, message)
    elif starting := [p for p in live if p.phase != "Running"]:
        ctx.condition(CONDITION, False, "Starting", f"{len(starting)} of {len(live)} Pods are starting")
    elif live:
        ctx.condition(CONDITION, True, "PodsRunning", f"all {len(live)} Pods of the job run")


def blocking_cause(pods: list[PodView], *, min_nodes: int) -> PodView | None:
    """The Pod whose unhealable cause holds the job back, if one does: the master's, or a worker's while
    fewer than ``min_nodes`` workers run (a job at its minimum goes on without the Pod; the replacement logic
    deals with it). Pure."""
    blocked = [p for p in stuck_pods([p for p in pods if p.live]) if p.stuck[0] in UNHEALABLE]
    if not blocked:
        return None
    running = sum(1 for p in pods if p.role == "worker" and p.live and p.phase == "Running")
    master = next((p for p in blocked if p.role == "master"), None)
    if master is not None:
        return master
    return blocked[0] if running < min_nodes else None


def unstartable(ctx: Pass, spec: JobSpec) -> bool:
    """Fails the job with the cause of :func:`blocking_cause` once it has held the job back for the
    operator's ``stuck_pod_timeout_s`` (counted in ``status.stuckSince`` from the first pass that saw it, and
    cleared once no cause does); True when the job failed."""
    pod = blocking_cause(list(ctx.pods), min_nodes=spec.min_nodes)
    if pod is None:
        ctx.out[STUCK_SINCE] = None
        return False
    since_text = ctx.status.get(STUCK_SINCE)
    since = parse_rfc3339(str(since_text)) if since_text else ctx.now
    ctx.out[STUCK_SINCE] = rfc3339(since)
    limit = ctx.settings.stuck_pod_timeout_s
    if ctx.now - since < limit:
        return False
    reason, cause = pod.stuck
    held = "the master" if pod.role == "master" else f"fewer than nodes.min={spec.min_nodes} workers run"
    message = f"{pod.name} cannot start: {cause} ({held}; waited {limit:g}s: stuck_pod_timeout_s)"
    lifecycle.fail(ctx, reason=reason, message=message, spec=spec)
    return True
