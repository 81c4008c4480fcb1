"""The worker slots of a job in one reconciliation pass: every slot ``0..nodes.max-1`` has one live Pod.

A slot whose Pod failed or vanished gets the next incarnation, a *replacement* that counts against
``restart.maxEvictions``, unless the cluster ended that Pod for its own reasons (a preemption, a drain, node
pressure: its ``DisruptionTarget`` condition): that replacement is a *disruption*, counted apart against
``restart.maxDisruptions``, so a busy or preemptible cluster does not spend the job's budget for failures.
The evictions the master wrote into ``status.evictions`` are carried out
(replacement first, kept off the evicted machine, then the evicted Pod deleted, so a crash between the
two loses nothing); slots beyond ``nodes.max`` are deleted. Pure: the actions go into the :class:`Pass`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from phalanx.api import elasticjob
from phalanx.operator import builders
from phalanx.operator.actions import CordonNode, Create, DeletePod, Event, PatchStatus, PodView
from phalanx.operator.context import Pass
from phalanx.operator.spec import JobSpec

SLOW_START_CREATES = 16
"""Worker Pods a job's first pass may create; each later pass may create as many as the job has, so the
creates double pass by pass (Kubernetes' ReplicaSet slow start) up to :data:`MAX_CREATES_PER_PASS`."""
MAX_CREATES_PER_PASS = 64
"""The most worker Pods one pass creates. A pass holds every Pod it builds until it ends, each a copy of the
template: this bounds the operator's memory whatever ``nodes.max`` says (with the template's own bound,
:data:`phalanx.operator.spec.MAX_TEMPLATE_BYTES`), and a template the API server refuses (a quota, an
admission webhook) costs a few refused requests per pass, not ``nodes.max`` of them."""

EVICTED_GRACE_S = 10
"""Seconds an evicted worker Pod gets beyond restart.gracePeriod: its agent stops its workers, has its
persist refused by the master at once, and exits."""


@dataclass(frozen=True)
class Replacements:
    """The Pods one pass creates in place of lost ones."""

    failed: int = 0
    """Pods that failed, vanished or were evicted by the master: charged to restart.maxEvictions."""
    disrupted: int = 0
    """Pods the cluster ended (:attr:`PodView.disruption`): charged to restart.maxDisruptions."""

    def plus(self, other: Replacements) -> Replacements:
        return Replacements(self.failed + other.failed, self.disrupted + other.disrupted)

    @property
    def any(self) -> bool:
        return self.failed + self.disrupted > 0


def reconcile_workers(ctx: Pass, spec: JobSpec, *, resuming: bool = False) -> Replacements:
    """Worker Pod actions; returns the replacements this pass makes. ``resuming``: the slots' Pods were
    deleted by a suspension, so a slot without a Pod is no replacement. Pods the API server refused to
    create are asked for again under the same name (no replacement either)."""
    workers = ctx.workers
    evicted = {
        str(e.get(elasticjob.EVICTION_NODE_ID)): e
        for e in ctx.status.get(elasticjob.STATUS_EVICTIONS) or []
        if isinstance(e, Mapping)
    }
    excluded = _exclude_evicted_machines(ctx, spec, evicted.values(), workers)
    incarnations = newest_incarnations(ctx.status, workers, slots=spec.max_nodes)
    by_slot: dict[int, list[PodView]] = {}
    for w in workers:
        if w.slot is not None:
            by_slot.setdefault(w.slot, []).append(w)
    replaced = Replacements()
    creates_left = create_budget(existing=len(workers), refused=bool(ctx.refused))
    for slot in range(spec.max_nodes):
        pods = sorted(by_slot.get(slot, []), key=lambda w: w.incarnation)
        slot_replaced, created = _keep_slot(ctx, spec, slot, pods, incarnations, evicted=evicted,
                                            excluded=excluded, resuming=resuming,
                                            may_create=creates_left > 0)  # fmt: skip
        replaced = replaced.plus(slot_replaced)
        creates_left -= created
    _scale_down(ctx, spec, by_slot)
    ctx.out["workerIncarnations"] = incarnations
    return replaced


def create_budget(*, existing: int, refused: bool) -> int:
    """How many worker Pods this pass may create, given how many the job has: the slow start above. While
    the API server refuses some of the job's Pods, no more than the first pass's share is asked for."""
    if refused:
        return SLOW_START_CREATES
    return min(MAX_CREATES_PER_PASS, max(SLOW_START_CREATES, existing))


def _exclude_evicted_machines(
    ctx: Pass, spec: JobSpec, evictions: Iterable[Mapping[str, Any]], workers: Sequence[PodView]
) -> list[str]:
    """``status.excludedMachines`` with the machines of this pass's evictions added (replacements are kept
    off them), cordoning each new one where the job asks for it and the operator allows it.

    A machine new to the list is written to the status at once, before any Pod is created or deleted: an
    operator that dies before the pass's closing status patch leaves it recorded, so whichever replica
    leads next keeps every later replacement off it, even once the evicted Pod is gone."""
    excluded = list(ctx.status.get("excludedMachines") or [])
    new: list[tuple[str, Mapping[str, Any]]] = []
    for e in evictions:
        machine = evicted_machine(e, workers)
        if machine and machine not in excluded:
            excluded.append(machine)
            new.append((machine, e))
    if new:
        ctx.actions.append(PatchStatus({"excludedMachines": list(excluded)}))
    for machine, e in new:
        if spec.cordon_bad_nodes and ctx.settings.cordon_nodes:
            reason = str(e.get(elasticjob.EVICTION_REASON) or "evicted by phalanx")
            ctx.actions.append(CordonNode(machine, reason=reason))
            ctx.actions.append(Event("Warning", "NodeCordoned", f"cordoned and tainted bad node {machine}"))
        elif spec.cordon_bad_nodes:
            message = (
                "spec.cordonBadNodes is set but this operator does not cordon nodes (its cordon_nodes "
                f"setting is off): {machine} stays schedulable; the job's replacements are kept off it"
            )
            ctx.actions.append(Event("Warning", "NodeNotCordoned", message))
    ctx.out["excludedMachines"] = excluded
    return excluded


class _Cause(NamedTuple):
    """Why a slot gets a new Pod: "" (no replacement) or what happened to the old one, and whether the
    cluster did it."""

    text: str = ""
    disrupted: bool = False


def _keep_slot(
    ctx: Pass,
    spec: JobSpec,
    slot: int,
    pods: Sequence[PodView],
    incarnations: list[int],
    *,
    evicted: Mapping[str, Mapping[str, Any]],
    excluded: list[str],
    resuming: bool,
    may_create: bool,
) -> tuple[Replacements, int]:
    """One slot's actions (its Pods sorted by incarnation); returns (the replacement it made, 1 when it
    created a Pod). A slot that needs a Pod when ``may_create`` is false waits for a later pass, whole: its
    evicted Pod is deleted only after its replacement was created."""
    newest = incarnations[slot]
    live = [w for w in pods if w.live]
    done = [w for w in pods if w.phase == "Succeeded" and not w.terminating]
    evict = [w for w in live if w.name in evicted]
    keep = [w for w in live if w.name not in evicted]
    # The newest incarnation was refused by the API server and never existed: ask for it again.
    retry = (
        newest >= 0
        and elasticjob.worker(ctx.name, slot=slot, incarnation=newest) in ctx.refused
        and not any(w.incarnation == newest for w in pods)
    )
    replaced, created = Replacements(), 0
    if not keep and not done:
        if not may_create:
            return replaced, 0
        created = 1
        cause = _replacement_cause(pods, evict, evicted, newest=newest, live=bool(live), retry=retry,
                                   resuming=resuming)  # fmt: skip
        inc = newest if retry else newest + 1
        pod = builders.worker_pod(ctx.job, spec, slot=slot, incarnation=inc, settings=ctx.settings,
                                  excluded_machines=excluded)  # fmt: skip
        name = pod["metadata"]["name"]
        ctx.actions.append(Create(pod))
        incarnations[slot] = inc
        if cause.disrupted:
            replaced = Replacements(disrupted=1)
            message = f"slot {slot}: {cause.text}; created {name}, not charged to restart.maxEvictions"
            ctx.actions.append(Event("Warning", "WorkerDisrupted", message, about=name))
        elif cause.text:
            replaced = Replacements(failed=1)
            message = f"slot {slot}: {cause.text}; created {name}"
            ctx.actions.append(Event("Warning", "WorkerReplaced", message, about=name))
        else:
            ctx.actions.append(Event("Normal", "WorkerCreated", f"created worker Pod {name}", about=name))
    for w in evict:
        # An evicted node persists nothing (the master refuses what a bad node holds), so it needs no
        # time for the write spec.terminationGracePeriod leaves: only to stop its workers.
        grace = math.ceil(spec.restart.grace_period_s) + EVICTED_GRACE_S
        ctx.actions.append(DeletePod(w.name, grace_period_s=grace))
        reason = evicted[w.name].get(elasticjob.EVICTION_REASON, "")
        ctx.actions.append(Event("Warning", "Evicted", f"deleted {w.name} on {w.node_name or '?'}: {reason}"))
    for w in pods:  # failed Pods of older incarnations are garbage once a newer one exists
        if not w.live and not w.terminating and w.phase != "Succeeded" and w.incarnation < incarnations[slot]:
            ctx.actions.append(DeletePod(w.name, grace_period_s=0))
    return replaced, created


def _replacement_cause(
    pods: Sequence[PodView],
    evict: Sequence[PodView],
    evicted: Mapping[str, Mapping[str, Any]],
    *,
    newest: int,
    live: bool,
    retry: bool,
    resuming: bool,
) -> _Cause:
    """Why a slot without a Pod to keep gets a new one; no text when that is no replacement (a new slot, a
    resume after a suspension, a create the API server refused).

    A Pod the cluster ended is seen with its ``DisruptionTarget`` condition while it stops (the eviction
    API and the scheduler's preemption set it before they delete it, and a deleted Pod stops for its grace
    period), so its replacement is known as a disruption. One that vanished before any pass saw it (the
    operator was down for all of that grace period) can no longer tell, and is charged as lost."""
    if evict:
        e = evicted[evict[0].name]
        return _Cause(f"evicted by the master: {e.get(elasticjob.EVICTION_REASON) or 'no reason given'}")
    if live or retry:
        return _Cause()
    last = pods[-1] if pods else None
    if last and last.disruption:
        return _Cause(f"{last.name} was ended by the cluster ({last.disruption})", disrupted=True)
    if last:
        return _Cause(f"{last.name} {last.phase} ({pod_exit(last)})")
    if newest >= 0 and not resuming:  # the slot had a Pod; a suspension did not delete it
        return _Cause("Pod vanished")
    return _Cause()


def _scale_down(ctx: Pass, spec: JobSpec, by_slot: Mapping[int, Sequence[PodView]]) -> None:
    """Deletes the Pods of slots beyond nodes.max (the spec was scaled down)."""
    for slot, pods in by_slot.items():
        if slot < spec.max_nodes:
            continue
        for w in pods:
            if not w.terminating:
                ctx.actions.append(DeletePod(w.name))
                ctx.actions.append(
                    Event("Normal", "ScaledDown", f"deleted {w.name}: nodes.max is {spec.max_nodes}")
                )


def pod_exit(pod: PodView) -> str:
    """How a Pod ended, for an Event: its exit code and reason, or "gone"."""
    if pod.exit_code is not None:
        return f"exit code {pod.exit_code}" + (f", {pod.reason}" if pod.reason else "")
    return pod.reason or "gone"


def evicted_machine(eviction: Mapping[str, Any], workers: Sequence[PodView]) -> str:
    """The Kubernetes node of an eviction the master asked for: the ``spec.nodeName`` of the worker Pod it
    names, as the operator observed it; "" when no such Pod is seen (gone, or not the job's).

    Live or not: the agent of an evicted node exits on the master's word, and a previous leader may have
    deleted the Pod and died before recording its machine, so the first pass that sees the eviction may
    see that Pod Failed or terminating. Its node is the same, and the decision must not depend on which
    of those events the operator saw first.
    The ``machine`` the master reports is never used: it is what an agent said, and a training script can
    register a node under any name with the job token."""
    node_id = str(eviction.get(elasticjob.EVICTION_NODE_ID) or "")
    pod = next((w for w in workers if w.name == node_id), None)
    return pod.node_name if pod else ""


def newest_incarnations(status: Mapping[str, Any], workers: Sequence[PodView], *, slots: int) -> list[int]:
    """Newest Pod incarnation per worker slot (-1: none yet), from the status and the Pods that exist (a
    Pod created just before a crash that lost the status patch counts). Slots beyond ``slots`` (removed by
    a scale-down) are remembered too: a later pass never reuses a Pod name."""
    incarnations = list(status.get("workerIncarnations") or [])
    incarnations += [-1] * (slots - len(incarnations))
    for w in workers:
        if w.slot is not None:
            incarnations += [-1] * (w.slot + 1 - len(incarnations))
            incarnations[w.slot] = max(incarnations[w.slot], w.incarnation)
    return incarnations


def finished_slots(workers: Sequence[PodView], slots: int) -> int:
    """Worker slots whose newest Pod exited 0 (Succeeded): nodes that finished training."""
    newest: dict[int, PodView] = {}
    for w in workers:
        if (
            w.slot is not None
            and w.slot < slots
            and (w.slot not in newest or w.incarnation > newest[w.slot].incarnation)
        ):
            newest[w.slot] = w
    return sum(1 for w in newest.values() if w.phase == "Succeeded" and not w.terminating)
