"""ElasticJobs under Kueue: the operator is to an ElasticJob what Kueue's job framework is to its own job
kinds, for a kind Kueue knows only by name (its configuration's ``integrations.externalFrameworks``:
``ElasticJob.v1alpha1.phalanx.dev``). Pure: the Workload and what a pass does with it; the reads and writes
are :mod:`phalanx.operator.kueue_api`'s.

A job labelled ``kueue.x-k8s.io/queue-name`` is *queued*:

* the operator creates its Workload, owned by the job (garbage-collected with it), with two pod sets:
  ``master`` (1) and ``workers`` (``nodes.max``, with ``minCount`` ``nodes.min`` when that is smaller, so
  Kueue may admit fewer: partial admission). Its priority is the WorkloadPriorityClass of the label
  ``kueue.x-k8s.io/priority-class``, else the PriorityClass the worker template names, else 0;
* until Kueue admits the Workload the job is held, exactly as a suspended job (``spec.suspend``, which the
  operator sets as Kueue's job framework does for its own jobs): a job never admitted has no Pod at all, not
  even its master;
* admitted, the job runs with the node labels and tolerations of the ResourceFlavors assigned to each pod set
  put on its Pods (Pods are built from the spec and the admission in every pass, so nothing is restored
  after an eviction), and with as many worker slots as Kueue admitted;
* evicted (preempted, deactivated, its ClusterQueue stopped), the job is suspended: the master acknowledges,
  every agent persists its newest in-memory snapshot on SIGTERM, and once no worker Pod is left the
  operator gives the quota back (the Workload's admission cleared, QuotaReserved False, Requeued), so Kueue
  queues it again. Readmitted, it resumes from its step;
* a job that finishes marks its Workload Finished, which frees its quota at once.

A job labelled ``kueue.x-k8s.io/prebuilt-workload-name`` (MultiKueue's copy in a worker cluster,
:mod:`phalanx.operator.multikueue`) uses that Workload instead of one of its own: it never creates nor
replaces it, makes itself its owner, and fails (``WorkloadOutOfSync``) if it was made for other node counts.

The Workload carries no finalizer (the job framework's ``kueue.x-k8s.io/resource-in-use``): the operator
puts none on anything, so deleting a job never waits for it; a deleted job's quota is then freed while its
Pods are still stopping. To stop a queued job, deactivate its Workload (``spec.active: false``), as for
Kueue's own jobs: ``spec.suspend`` of a queued job is Kueue's to set.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping, Sequence
from enum import Enum
from typing import Any

from phalanx.api.elasticjob import Phase
from phalanx.operator import builders, lifecycle, names
from phalanx.operator.actions import (
    AdoptWorkload,
    Create,
    DeleteWorkload,
    Event,
    PatchWorkloadStatus,
    QueueView,
    SetSuspend,
)
from phalanx.operator.conditions import ConditionType, get_condition, is_true, set_condition
from phalanx.operator.context import Pass
from phalanx.operator.meta import Obj, owner_reference
from phalanx.operator.placement import Placement
from phalanx.operator.spec import JobSpec

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
JOB_UID_LABEL = "kueue.x-k8s.io/job-uid"
PREBUILT_LABEL = "kueue.x-k8s.io/prebuilt-workload-name"
"""Names a Workload made for the job by another (MultiKueue, for the job's copy in a worker cluster): the job
uses and adopts that one and never creates its own."""
GROUP, VERSION, WORKLOADS = "kueue.x-k8s.io", "v1beta2", "workloads"
MASTER_SET, WORKER_SET = "master", "workers"
CONDITION: ConditionType = "Admitted"
"""The job's condition that mirrors its Workload: whether Kueue admitted it, and Kueue's words if not."""
REQUEUED_ON = ("Preempted", "NodeFailures")
"""Eviction reasons after which Kueue's job framework marks a Workload Requeued (to be admitted again)."""
NO_WORKLOAD_API = (
    "the job has the label kueue.x-k8s.io/queue-name, but this cluster does not serve Kueue's Workloads "
    "(kueue.x-k8s.io/v1beta2): install Kueue (v0.15 or later) with ElasticJob.v1alpha1.phalanx.dev in its "
    "integrations.externalFrameworks, or remove the label"
)
_POD_SET_FIELDS = ("nodeSelector", "affinity", "tolerations", "priorityClassName", "runtimeClassName")
_CONTAINER_FIELDS = ("name", "image", "resources")


class State(Enum):
    MISSING = "missing"
    STALE = "stale"  # made for other node counts: replaced, the job held meanwhile
    PENDING = "pending"
    ADMITTED = "admitted"
    EVICTED = "evicted"
    FINISHED = "finished"


def queue_name(job: Mapping[str, Any]) -> str:
    return str(((job.get("metadata") or {}).get("labels") or {}).get(QUEUE_LABEL) or "")


def prebuilt(job: Mapping[str, Any]) -> str:
    return str(((job.get("metadata") or {}).get("labels") or {}).get(PREBUILT_LABEL) or "")


def workload_name(job: Mapping[str, Any]) -> str:
    """The prebuilt Workload's name, else ``elasticjob-<name>-<hash of uid>``, as Kueue names its own jobs'
    Workloads: a job re-created under the same name never meets the old one's Workload while it is being
    garbage-collected."""
    if name := prebuilt(job):
        return name
    meta = job["metadata"]
    digest = hashlib.sha256(str(meta["uid"]).encode()).hexdigest()[:5]
    return f"elasticjob-{str(meta['name'])[:236]}-{digest}"


def workload(job: Mapping[str, Any], spec: JobSpec, *, settings: Any, priority: Mapping[str, Any]) -> Obj:
    """The job's Workload: its two pod sets with the requests of the Pods the operator will create."""
    meta = job["metadata"]
    master = builders.master_pod(job, spec, settings=settings)
    worker = builders.worker_pod(job, spec, slot=0, incarnation=0, settings=settings)
    workers: Obj = {"name": WORKER_SET, "count": spec.max_nodes, "template": _pod_set_template(worker)}
    if spec.min_nodes < spec.max_nodes:
        workers["minCount"] = spec.min_nodes
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "Workload",
        "metadata": {
            "name": workload_name(job),
            "namespace": meta["namespace"],
            "labels": {
                **names.labels(meta["name"], component="workload"),
                JOB_UID_LABEL: str(meta["uid"]),
            },
            "ownerReferences": [owner_reference(job)],
        },
        "spec": {
            "queueName": queue_name(job),
            "podSets": [
                {"name": MASTER_SET, "count": 1, "template": _pod_set_template(master)},
                workers,
            ],
            **priority,
        },
    }


def _pod_set_template(pod: Mapping[str, Any]) -> Obj:
    """What Kueue reads of a Pod: its containers' requests and the fields that choose a flavor's nodes."""
    spec = pod["spec"]
    kept: Obj = {k: spec[k] for k in _POD_SET_FIELDS if spec.get(k)}
    for key in ("containers", "initContainers"):
        if spec.get(key):
            kept[key] = [{k: c[k] for k in _CONTAINER_FIELDS if c.get(k)} for c in spec[key]]
    return {"spec": kept}


def state(found: Mapping[str, Any] | None, spec: JobSpec) -> State:
    if found is None:
        return State.MISSING
    conditions = (found.get("status") or {}).get("conditions") or []
    if is_true(conditions, "Finished"):
        return State.FINISHED
    if is_true(conditions, "Evicted"):
        return State.EVICTED
    if _pod_set_counts(found) != _pod_set_counts_for(spec):
        return State.STALE
    return State.ADMITTED if is_true(conditions, "Admitted") else State.PENDING


def _pod_set_counts(found: Mapping[str, Any]) -> list[tuple[str, int, int | None]]:
    sets = (found.get("spec") or {}).get("podSets") or []
    return [(str(s.get("name")), int(s.get("count", 1)), s.get("minCount")) for s in sets]


def _pod_set_counts_for(spec: JobSpec) -> list[tuple[str, int, int | None]]:
    minimum = spec.min_nodes if spec.min_nodes < spec.max_nodes else None
    return [(MASTER_SET, 1, None), (WORKER_SET, spec.max_nodes, minimum)]


def admitted(found: Mapping[str, Any], spec: JobSpec, flavors: Mapping[str, Mapping[str, Any]]) -> JobSpec:
    """The spec as Kueue admitted it: the worker slots it gave quota for, each pod set's flavors' nodes."""
    assignments = ((found.get("status") or {}).get("admission") or {}).get("podSetAssignments") or []
    placement: dict[str, Placement] = {}
    slots = spec.max_nodes
    for assignment in assignments:
        name = str(assignment.get("name"))
        if name == WORKER_SET and assignment.get("count") is not None:
            slots = max(spec.min_nodes, min(slots, int(assignment["count"])))
        placement[name] = _placement(assignment.get("flavors") or {}, flavors)
    rendezvous = dataclasses.replace(spec.rendezvous, max_nodes=slots)
    return dataclasses.replace(spec, rendezvous=rendezvous, placement=placement)


def _placement(assigned: Mapping[str, str], flavors: Mapping[str, Mapping[str, Any]]) -> Placement:
    """The node labels and tolerations of the flavors assigned to a pod set's resources (Kueue's own
    ``podset.FromAssignment``)."""
    selector: dict[str, str] = {}
    tolerations: list[Mapping[str, Any]] = []
    for flavor in dict.fromkeys(assigned.values()):
        found = flavors.get(flavor) or {}
        selector.update(found.get("nodeLabels") or {})
        tolerations.extend(t for t in found.get("tolerations") or [] if t not in tolerations)
    return Placement(node_selector=selector, tolerations=tuple(tolerations))


def flavor_names(found: Mapping[str, Any] | None) -> list[str]:
    """The ResourceFlavors a Workload's admission assigns, each once."""
    assignments = (((found or {}).get("status") or {}).get("admission") or {}).get("podSetAssignments") or []
    return list(dict.fromkeys(str(f) for a in assignments for f in (a.get("flavors") or {}).values()))


# ------------------------------------------------------------------------------------------------------
# A pass


def queued(ctx: Pass, spec: JobSpec) -> JobSpec | None:
    """The spec a queued job's pass follows (held: ``suspend``; admitted: the admission's), with the
    Workload's actions and the job's Admitted condition; None when the job failed (no Workload API, or its
    Workload was finished by Kueue)."""
    view: QueueView = ctx.observed.queue or QueueView()
    if not view.served:
        lifecycle.fail(ctx, reason="QueueUnavailable", message=NO_WORKLOAD_API, spec=spec)
        return None
    found, now = view.workload, state(view.workload, spec)
    if now is State.FINISHED:
        message = said(found, "Finished") or "Kueue finished the job's Workload"
        lifecycle.fail(ctx, reason="WorkloadFinished", message=message, spec=spec)
        return None
    if prebuilt(ctx.job):
        if now is State.STALE:  # Kueue's job framework finishes such a Workload: it cannot be run as made
            message = (f"the prebuilt Workload {workload_name(ctx.job)} was made for other node counts than "
                       f"this job's ({spec.min_nodes}:{spec.max_nodes})")  # fmt: skip
            lifecycle.fail(ctx, reason="WorkloadOutOfSync", message=message, spec=spec)
            return None
        _adopt(ctx, found)
    elif now is State.MISSING:
        ctx.actions.append(Create(workload(ctx.job, spec, settings=ctx.settings, priority=view.priority)))
    elif now is State.STALE:
        assert found is not None
        ctx.actions.append(DeleteWorkload(str(found["metadata"]["name"])))
    mirror(ctx, found, now)
    run = now is State.ADMITTED
    if run:
        assert found is not None
        spec = admitted(found, spec, view.flavors)
    if bool((ctx.job.get("spec") or {}).get("suspend")) == run:
        ctx.actions.append(SetSuspend(not run))
    return dataclasses.replace(spec, suspend=not run)


def _adopt(ctx: Pass, found: Mapping[str, Any] | None) -> None:
    """A prebuilt Workload becomes the job's (garbage-collected with it), as Kueue's job framework does."""
    if found is None:
        return
    meta = found["metadata"]
    owners = [r for r in meta.get("ownerReferences") or [] if isinstance(r, Mapping)]
    if any(r.get("uid") == ctx.job["metadata"]["uid"] for r in owners):
        return
    if any(r.get("controller") for r in owners):
        return  # another's: Kueue's framework would not take it either; the job still runs by it
    adopted = (*owners, owner_reference(ctx.job))
    ctx.actions.append(AdoptWorkload(str(meta["name"]), str(meta.get("resourceVersion", "")), adopted))


def mirror(ctx: Pass, found: Mapping[str, Any] | None, now: State) -> None:
    """The Admitted condition, with an Event when it changes."""
    name = str(found["metadata"]["name"]) if found else workload_name(ctx.job)
    if now is State.ADMITTED:
        assert found is not None
        queue = ((found.get("status") or {}).get("admission") or {}).get("clusterQueue", "")
        value, reason, message = True, "Admitted", f"Kueue admitted Workload {name} in ClusterQueue {queue}"
    elif now is State.EVICTED:
        evicted = get_condition((found or {}).get("status", {}).get("conditions") or [], "Evicted") or {}
        value, reason = False, f"Evicted{evicted.get('reason') or ''}"
        message = f"Kueue evicted Workload {name}: {evicted.get('message') or 'no message'}"
    elif found is None and prebuilt(ctx.job):
        value, reason = False, "Queued"
        message = f"waiting for its prebuilt Workload {name} (label {PREBUILT_LABEL})"
    else:
        waiting = said(found, "QuotaReserved") or "waiting for Kueue to look at it"
        checks = [str(c.get("message")) for c in (found or {}).get("status", {}).get("admissionChecks") or []
                  if c.get("state") != "Ready" and c.get("message")]  # fmt: skip
        waiting = "; ".join([waiting, *checks])
        value, reason = False, "Queued"
        message = f"queued in LocalQueue {queue_name(ctx.job)} (Workload {name}): {waiting}"
    before = get_condition(ctx.conditions, CONDITION)
    ctx.condition(CONDITION, value, reason, message)
    if before is None or before.get("status") != str(value) or before.get("reason") != reason:
        ctx.actions.append(Event("Normal" if value or reason == "Queued" else "Warning", reason, message))


def said(found: Mapping[str, Any] | None, kind: str) -> str:
    c = get_condition(((found or {}).get("status") or {}).get("conditions") or [], kind)
    return str(c.get("message") or "") if c else ""


def held_queued(ctx: Pass) -> None:
    """A queued job never admitted: Suspended, no Pod at all (after :func:`lifecycle.held`)."""
    message = get_condition(ctx.conditions, CONDITION) or {}
    ctx.condition("Suspended", True, "Queued", str(message.get("message") or "queued"))


def release_if_stopped(ctx: Pass) -> None:
    """After an eviction, once the suspension left no worker Pod: gives the quota back, so Kueue queues the
    Workload again (what Kueue's job framework does once a job is no longer active)."""
    if ctx.workers or ctx.out.get("phase") != Phase.SUSPENDED:
        return
    release(ctx)


def release(ctx: Pass) -> None:
    """Gives an evicted Workload's quota back (its admission cleared, QuotaReserved False, Requeued)."""
    view = ctx.observed.queue
    if view is None or view.workload is None:
        return
    found = view.workload
    status = found.get("status") or {}
    conditions = status.get("conditions") or []
    if not is_true(conditions, "Evicted") or not status.get("admission"):
        return
    evicted = get_condition(conditions, "Evicted") or {}
    reason, message = str(evicted.get("reason") or "Evicted"), str(evicted.get("message") or "evicted")
    generation = int(found["metadata"].get("generation", 1))
    for kind, value, why, text in (
        ("QuotaReserved", False, "Pending", message),
        ("Admitted", False, "NoReservation", "The workload has no reservation"),
        ("Requeued", reason in REQUEUED_ON, reason, message),
    ):
        conditions = set_condition(conditions, kind=kind, status=value, reason=why, message=text,
                                   now=ctx.now, generation=generation)  # fmt: skip
    ctx.actions.append(_status_patch(found, {"admission": None, "conditions": conditions}))
    ctx.actions.append(Event("Normal", "QuotaReleased", f"gave Workload {found['metadata']['name']}'s "
                             "quota back; Kueue queues it again"))  # fmt: skip


def finish(ctx: Pass, *, succeeded: bool, message: str) -> None:
    """A finished job marks its Workload Finished: Kueue frees its quota at once."""
    view = ctx.observed.queue
    if view is None or view.workload is None:
        return
    found = view.workload
    conditions: Sequence[Mapping[str, Any]] = (found.get("status") or {}).get("conditions") or []
    if is_true(conditions, "Finished"):
        return
    generation = int(found["metadata"].get("generation", 1))
    reason = "Succeeded" if succeeded else "Failed"
    conditions = set_condition(conditions, kind="Finished", status=True, reason=reason, message=message,
                               now=ctx.now, generation=generation)  # fmt: skip
    ctx.actions.append(_status_patch(found, {"conditions": conditions}))


def _status_patch(found: Mapping[str, Any], status: Mapping[str, Any]) -> PatchWorkloadStatus:
    meta = found["metadata"]
    return PatchWorkloadStatus(str(meta["name"]), str(meta.get("resourceVersion", "")), dict(status))
