"""ElasticJobs dispatched by MultiKueue: the manager cluster's side (``spec.managedBy:
kueue.x-k8s.io/multikueue``). Pure, as :mod:`phalanx.operator.kueue`, whose Workload it shares.

In a manager cluster the job runs nowhere: Kueue's MultiKueue admission check copies its Workload to the
worker clusters, and once one of them admits it, Kueue's generic adapter for external frameworks
(``multiKueue.externalFrameworks: [{name: ElasticJob.v1alpha1.phalanx.dev}]``) creates a copy of the job
there, without ``managedBy`` and labelled ``kueue.x-k8s.io/prebuilt-workload-name``, which the worker's
operator runs with that Workload as any queued job. The adapter copies the worker job's whole status back.

So the operator of the manager cluster does, for such a job, what Kueue's job framework does for its own
dispatched jobs and nothing more:

* it creates the job's Workload (as for a queued job) and holds the job (``spec.suspend``) until Kueue
  admits it, which in a manager cluster means: a worker admitted its copy;
* until a worker runs it, the job's status is this operator's (``Admitted`` False reason ``Queued`` with
  Kueue's words, ``Suspended``); from then on it is the worker's, copied by Kueue: this operator writes none
  of it (two writers of one status would undo each other's writes);
* evicted in the manager (preempted there, deactivated), the job is suspended; MultiKueue stops the
  worker's copy, and once the copied status says it stopped (or no worker had it) the quota is given
  back, so Kueue queues the Workload again and deletes the copy;
* it makes no Pod, Service or Secret: a manager cluster may have no node at all. A finished job is deleted
  after ``spec.ttlAfterFinished``, read from the copied status.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from phalanx.api.elasticjob import FINISHED_PHASES, Phase
from phalanx.api.errors import ConfigError
from phalanx.operator import kueue, lifecycle
from phalanx.operator.actions import Action, Create, DeleteJob, DeleteWorkload, QueueView, SetSuspend
from phalanx.operator.conditions import is_true
from phalanx.operator.context import Pass
from phalanx.operator.spec import parse_spec

MANAGED_BY = "kueue.x-k8s.io/multikueue"
"""``spec.managedBy`` of a job MultiKueue dispatches to a worker (Kueue's ``MultiKueueControllerName``)."""
NOT_QUEUED = (
    f"spec.managedBy is {MANAGED_BY}, but the job has no label {kueue.QUEUE_LABEL}: MultiKueue dispatches "
    "only jobs in a LocalQueue whose ClusterQueue has a MultiKueue admission check; add the label"
)


def dispatched(job: Mapping[str, Any]) -> bool:
    return (job.get("spec") or {}).get("managedBy") == MANAGED_BY


def worker_cluster(found: Mapping[str, Any] | None) -> str:
    """The worker cluster running the job's copy: the Workload's ``status.clusterName`` while it holds
    quota (or finished there); "" while the job is this cluster's to describe."""
    status = (found or {}).get("status") or {}
    conditions = status.get("conditions") or []
    holding = is_true(conditions, "QuotaReserved") or is_true(conditions, "Finished")
    return str(status.get("clusterName") or "") if holding else ""


def dispatch(ctx: Pass) -> list[Action]:
    """A pass of a job in a manager cluster: its Workload, its ``spec.suspend``, and its status only while no
    worker runs it."""
    found = (ctx.observed.queue or QueueView()).workload
    if worker_cluster(found):
        return _handed_over(ctx, found)
    if ctx.phase in FINISHED_PHASES:
        return ctx.finish()
    try:
        spec = parse_spec(ctx.job.get("spec") or {})
    except ConfigError as exc:
        lifecycle.fail(ctx, reason="InvalidSpec", message=str(exc))
        return ctx.finish()
    if not kueue.queue_name(ctx.job):
        lifecycle.fail(ctx, reason="NotQueued", message=NOT_QUEUED)
        return ctx.finish()
    view = ctx.observed.queue or QueueView()
    if not view.served:
        lifecycle.fail(ctx, reason="QueueUnavailable", message=kueue.NO_WORKLOAD_API)
        return ctx.finish()
    now = kueue.state(found, spec)
    if now is kueue.State.FINISHED:  # finished by Kueue before any worker ran it: it never will
        message = kueue.said(found, "Finished") or "Kueue finished the job's Workload"
        lifecycle.fail(ctx, reason="WorkloadFinished", message=message)
        return ctx.finish()
    if now is kueue.State.MISSING:
        made = kueue.workload(ctx.job, spec, settings=ctx.settings, priority=view.priority)
        ctx.actions.append(Create(made))
    elif now is kueue.State.STALE and found is not None:
        ctx.actions.append(DeleteWorkload(str(found["metadata"]["name"])))
    elif now is kueue.State.EVICTED:
        kueue.release(ctx)  # no worker had it: nothing to wait for
    _hold(ctx, run=False)
    kueue.mirror(ctx, found, now)
    lifecycle.held(ctx)
    kueue.held_queued(ctx)
    return ctx.finish()


def _handed_over(ctx: Pass, found: Mapping[str, Any] | None) -> list[Action]:
    """A worker runs the job (or ran it): its status is the worker's; only the suspension, the quota of an
    evicted job once the worker's copy stopped, and the TTL are this cluster's."""
    conditions = ((found or {}).get("status") or {}).get("conditions") or []
    evicted = is_true(conditions, "Evicted")
    if not is_true(conditions, "Finished"):
        _hold(ctx, run=is_true(conditions, "Admitted") and not evicted)
    if evicted and ctx.phase in (Phase.SUSPENDED, *FINISHED_PHASES):
        kueue.release(ctx)
    actions = list(ctx.actions)  # no status patch: the status is the worker's
    if ctx.phase in FINISHED_PHASES and (
        expired := lifecycle.ttl_expired(ctx.job, ctx.status, phase=ctx.phase, now=ctx.now)
    ):
        actions.append(DeleteJob(expired))
    return actions


def _hold(ctx: Pass, *, run: bool) -> None:
    if bool((ctx.job.get("spec") or {}).get("suspend")) == run:
        ctx.actions.append(SetSuspend(not run))
