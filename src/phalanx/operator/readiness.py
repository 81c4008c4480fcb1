"""Why the job's Pods do not run, said where people look: the ``PodsReady`` condition, a Warning Event per
distinct cause, and from there ``kubectl describe ej`` and ``phalanx status``. Pure: the condition and events
go into the :class:`Pass`.

A Pod the scheduler cannot place, or whose container the kubelet cannot start (an image that does not exist,
a Secret that is missing) or keeps restarting, is otherwise only a Pending Pod: the job would wait for its
minimum node count and fail much later with a message about nodes, not about the image.
"""

from __future__ import annotations

from phalanx.operator.actions import Event, PodView
from phalanx.operator.conditions import get_condition
from phalanx.operator.context import Pass

CONDITION = "PodsReady"
MAX_MESSAGE = 1024
"""Bytes of the condition's message; the Events say each cause in full."""


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
