"""Reconciliation as a pure function: (observed objects, spec, status, now) -> actions.

The operator calls :func:`reconcile` on a timer for every job (level based: whatever events were
missed, the next pass sees the world as it is) and hands the actions to the executor
(:mod:`phalanx.operator.executor`). Nothing here does I/O.

Rules, per pass:

* the job's supporting objects (token Secret, the master's metrics Secret when the operator has a metrics
  token, state ConfigMap, master ServiceAccount/Role/RoleBinding, master Service, and the master's
  NetworkPolicy when the operator's network_policy switch is on) and the master Pod exist; a lost or
  finished master Pod (while the job runs) is deleted and recreated under the same name, and the new master
  resumes from the state ConfigMap;
* every worker slot ``0..nodes.max-1`` has one live Pod. A slot whose Pod failed or vanished gets the
  next incarnation; that is a *replacement* and counts against ``restart.maxEvictions``, unless the cluster
  ended the Pod (a preemption, a drain, node pressure: its ``DisruptionTarget`` condition), which counts
  against ``restart.maxDisruptions`` instead (``status.disruptions``; reason DisruptionBudgetExhausted);
* evictions the master wrote into ``status.evictions`` are carried out: the replacement is created with
  node affinity keeping it off the evicted machine, then the evicted Pod is deleted (in this order, so a
  crash between the two steps loses nothing). The machine kept off and, with ``cordonBadNodes`` and the
  operator's ``cordon_nodes`` switch, cordoned and tainted is the ``spec.nodeName`` of the evicted Pod as
  the operator observed it (running, or already Failed or terminating), never the machine name the master
  reports (a training script can read the job token and report any name). It goes into
  ``status.excludedMachines`` before any Pod is created or deleted, so every later replacement, by any
  leader, keeps off it;
* a supporting object of the job's name that exists but is not the job's (no ownerReference with its uid)
  is neither used, overwritten nor deleted: the job waits with Created False (reason ForeignObject) and
  creates no Pod until it is gone;
* slots beyond ``nodes.max`` (the spec was scaled down) are deleted, new slots (scaled up) created; the
  master Pod is restarted with the new ``--nodes MIN:MAX`` and resumes from its state;
* the master's verdict (``status.master.phase``) ends the job: Succeeded or Failed with the master's
  reason in the condition message; then worker Pods are cleaned up per ``cleanPodPolicy``;
* ``spec.suspend`` (ignored by a finished job) frees the job's worker nodes: until the master acknowledged
  (``status.master.phase`` Suspended: it then forgets nodes that leave instead of evicting them), or for
  at most the operator's ``suspend_ack_timeout_s`` when it does not, worker Pods are neither created,
  replaced nor deleted; then every worker Pod is deleted gracefully (its agent
  persists its newest in-memory checkpoint on SIGTERM), and once none is left the job is Suspended. The
  master Pod stays and keeps the job's state. None of this is a replacement;
* a job created suspended (a queue's pattern) gets no Pod at all, not even its master, until it is resumed;
* a job labelled ``kueue.x-k8s.io/queue-name`` is Kueue's to admit (:mod:`phalanx.operator.kueue`): its
  Workload is created, the job held (``spec.suspend``) until admitted, its Pods placed by the admission's
  flavors, suspended when evicted (its quota given back once no worker is left) and its Workload finished
  with it. A job with ``spec.managedBy: kueue.x-k8s.io/multikueue`` gets its Workload and nothing else: it
  runs in the worker cluster MultiKueue dispatches it to (:mod:`phalanx.operator.multikueue`), and its
  copy there uses the Workload named by ``kueue.x-k8s.io/prebuilt-workload-name``;
* ``spec.suspend`` false again resumes (once the deleted Pods are gone, so the new ones start from the
  checkpoint they persisted): every slot gets a Pod of its next incarnation, again not a replacement;
* ``spec.activeDeadline`` fails a job active for longer (reason DeadlineExceeded), counted from
  ``status.startTime``: set when the job starts and again at each resume, so suspended time never counts
  and a suspended job is never failed by it;
* ``spec.gangScheduling`` keeps a PodGroup (scheduling.k8s.io/v1beta1) that every worker Pod names as its
  scheduling group, so the Kubernetes scheduler binds none of them until minNodes fit at once; its verdict is
  mirrored as the GangScheduled condition. A cluster without that API fails the job at once
  (GangSchedulingUnavailable) rather than placing its Pods one by one unannounced;
* ``spec.ttlAfterFinished`` deletes the ElasticJob itself once it has been Succeeded or Failed that long
  (its Pods and supporting objects are owned by it and go with it);
* a create the API server refused (:mod:`phalanx.operator.refusals`: the executor records it in the
  ReplicaFailure condition and ``status.refusedPods``) is asked for again under the same name, as no
  replacement; the condition turns False once a pass has nothing left to create, and a refusal older than
  ``spec.createRefusedTimeout`` fails the job (reason FailedCreate);
* a worker Pod that exited 0 is a node that finished, not one lost: a job whose nodes finish one by one
  before the master's verdict is not Restarting.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from phalanx.api import elasticjob
from phalanx.api.elasticjob import Phase
from phalanx.api.errors import ConfigError
from phalanx.api.settings import OperatorSettings
from phalanx.operator import builders, kueue, lifecycle, multikueue, names, privileged, readiness, refusals
from phalanx.operator import gang as gang_module
from phalanx.operator.actions import Action, Create, DeleteJob, DeletePod, Event, Observed, PatchPodGroup
from phalanx.operator.admission import MANAGED_BY
from phalanx.operator.conditions import get_condition, is_true, parse_rfc3339, rfc3339
from phalanx.operator.context import FINISHED_PHASES, Pass
from phalanx.operator.schema import format_duration
from phalanx.operator.spec import JobSpec, parse_spec
from phalanx.operator.supporting import master_address, supporting_names, supporting_objects
from phalanx.operator.workers import Replacements, finished_slots, pod_exit, reconcile_workers


def managed_here(job: Mapping[str, Any]) -> bool:
    """Whether this operator reconciles the job: ``spec.managedBy`` absent or naming it, or MultiKueue's
    (whose jobs the operator queues and Kueue dispatches: :mod:`phalanx.operator.multikueue`). A job another
    controller manages gets no write of any kind from this one, not even a condition."""
    managed_by = (job.get("spec") or {}).get("managedBy")
    return managed_by in (None, "", MANAGED_BY) or multikueue.dispatched(job)


def reconcile(
    observed: Observed,
    *,
    now: float,
    settings: OperatorSettings,
    new_token: str,
    metrics_token: str = "",
    issue_tls: Callable[[], Mapping[str, str]] | None = None,
) -> list[Action]:
    """The actions that bring the cluster closer to the job's spec. ``new_token`` and ``metrics_token`` are
    used only if the token Secret does not exist yet, ``issue_tls`` (the job's master certificate) only if
    its TLS Secret does not. ``settings`` carries the administrator's trust switches too (cordoning,
    NetworkPolicies, TLS).

    The pass runs the stages below in order; a stage that ends the pass (the job failed, finished, or
    waits for something) says so by returning True, and the pass's status patch goes out as it stands."""
    ctx = Pass(observed, now=now, settings=settings)
    if multikueue.dispatched(ctx.job):
        return multikueue.dispatch(ctx)  # a manager cluster's: the job runs in a worker cluster
    _clear_reconcile_error(ctx)
    if ctx.phase in FINISHED_PHASES:
        return _finished_job(ctx)
    spec = _runnable_spec(ctx)
    if spec is not None and kueue.queue_name(ctx.job):
        spec = kueue.queued(ctx, spec)  # held until Kueue admits it, then as admitted
    if spec is None:
        return ctx.finish()
    if (
        _supporting_objects_blocked(
            ctx, new_token=new_token, metrics_token=metrics_token, issue_tls=issue_tls
        )
        or _master_ended_the_job(ctx, spec)
        or _deadline_exceeded(ctx, spec)
    ):
        return ctx.finish()
    if spec.suspend and lifecycle.never_started(ctx):
        lifecycle.held(ctx)  # queued: not even a master Pod until it is admitted
        if kueue.queue_name(ctx.job):
            kueue.held_queued(ctx)
        return _settled(ctx)
    master_ready = _keep_master(ctx, spec)
    if spec.gang_min_nodes is not None:  # before the first worker Pod: its group must be there to place it
        _keep_gang(ctx, spec)
    if spec.suspend:
        _suspend(ctx, spec)
        kueue.release_if_stopped(ctx)  # a job Kueue evicted gives its quota back once stopped
        return _settled(ctx)
    ctx.out[lifecycle.SUSPENDING_SINCE] = None  # a suspension cancelled before it completed
    resuming = _resume(ctx)
    if resuming is None:
        return _settled(ctx)
    replaced = reconcile_workers(ctx, spec, resuming=resuming)
    if (
        _replacement_budget_exhausted(ctx, spec, replaced.failed)
        or _disruption_budget_exhausted(ctx, spec, replaced.disrupted)
        or readiness.unstartable(ctx, spec)
    ):
        return ctx.finish()
    _running_phase(ctx, spec, replaced=replaced, resuming=resuming, master_ready=master_ready)
    readiness.pods_ready(ctx)
    return _settled(ctx)


def _clear_reconcile_error(ctx: Pass) -> None:
    if is_true(ctx.conditions, "ReconcileError"):  # this pass got this far: the error is over
        ctx.condition("ReconcileError", False, "Reconciled", "the last reconciliation pass succeeded")


def _finished_job(ctx: Pass) -> list[Action]:
    """A Succeeded or Failed job: its Pods cleaned up, its Workload finished (a queued job's quota freed),
    and the job itself deleted after its TTL."""
    lifecycle.cleanup(ctx, finished_for=lifecycle.finished_for(ctx.status, ctx.now))
    if kueue.queue_name(ctx.job):
        kueue.finish(ctx, succeeded=ctx.phase == Phase.SUCCEEDED, message=f"the job {ctx.phase}")
    actions = ctx.finish()
    if expired := lifecycle.ttl_expired(ctx.job, ctx.status, phase=ctx.phase, now=ctx.now):
        actions.append(DeleteJob(expired))  # last: nothing is patched on a job being deleted
    return actions


def _runnable_spec(ctx: Pass) -> JobSpec | None:
    """The job's spec, or None after failing the job: a spec that cannot be run (InvalidSpec), gang
    scheduling on a cluster without the PodGroup API, or creates refused for longer than allowed."""
    try:
        spec = parse_spec(ctx.job.get("spec") or {})
        builders.training_entry(spec.template["spec"]["containers"][0])
    except ConfigError as exc:
        lifecycle.fail(ctx, reason="InvalidSpec", message=str(exc))
        return None
    if not ctx.observed.admission_policy and (asked := privileged.requests(ctx.job.get("spec") or {})):
        message = privileged.refusal(asked, policy=ctx.settings.admission_policy)
        lifecycle.fail(ctx, reason=privileged.REASON, message=message, spec=spec)
        return None
    if spec.gang is not None and not ctx.observed.pod_group_api:
        message = gang_module.UNAVAILABLE[spec.gang.scheduler]
        lifecycle.fail(ctx, reason="GangSchedulingUnavailable", message=message, spec=spec)
        return None
    if expired := _refused_for_too_long(ctx, spec):
        lifecycle.fail(ctx, reason=refusals.REASON, message=expired, spec=spec)
        return None
    return spec


def _supporting_objects_blocked(
    ctx: Pass,
    *,
    new_token: str,
    metrics_token: str,
    issue_tls: Callable[[], Mapping[str, str]] | None,
) -> bool:
    """Creates the supporting objects that are missing; True when one of their names is taken by an object
    that is not the job's (the job then waits)."""
    job = ctx.job
    wanted = supporting_objects(job, settings=ctx.settings, token=new_token, metrics_token=metrics_token)
    names = set(supporting_names(wanted))
    if gang_module.enabled(
        job.get("spec") or {}
    ):  # its PodGroup too: a foreign one would take the job's Pods in
        names.add(("PodGroup", elasticjob.pod_group(ctx.name)))
    if foreign := sorted(names & ctx.observed.foreign):
        _blocked_by_foreign(ctx, foreign)
        return True
    for obj in wanted:
        if (obj["kind"], obj["metadata"]["name"]) not in ctx.observed.existing:
            if obj["metadata"]["name"] == elasticjob.tls_secret(ctx.name):
                if issue_tls is None:
                    raise ValueError("the job's TLS Secret is missing and no certificate can be issued")
                obj["stringData"] = dict(issue_tls())  # issued only when the Secret is to be made
            ctx.actions.append(Create(obj))
    created = get_condition(ctx.conditions, "Created")
    if not created or created.get("status") != "True":
        ctx.condition(
            "Created", True, "ObjectsCreated", "Secret, RBAC, Service and state ConfigMap of the job exist"
        )
        ctx.actions.append(
            Event("Normal", "Created", "created the job's Secret, master RBAC, Service and state")
        )
    return False


def _master_ended_the_job(ctx: Pass, spec: JobSpec) -> bool:
    """The master's verdict (``status.master.phase``) ends the job: Succeeded, or Failed with its reason."""
    if ctx.verdict is Phase.SUCCEEDED:
        lifecycle.succeed(ctx, spec)
        return True
    if ctx.verdict is Phase.FAILED:
        reason = str(ctx.master_status.get(elasticjob.MASTER_REASON) or "the master reported the job failed")
        kind, message = lifecycle.master_failure(reason, spec)
        lifecycle.fail(ctx, reason=kind, message=message, spec=spec)
        return True
    return False


def _deadline_exceeded(ctx: Pass, spec: JobSpec) -> bool:
    """spec.activeDeadline, counted from ``status.startTime`` while the job is active: neither suspended
    nor being resumed (the resume starts the clock again). True when it failed the job."""
    if spec.suspend or lifecycle.suspension(ctx.status):
        return False
    started = lifecycle.start_time(ctx.status, ctx.now)
    ctx.out["startTime"] = rfc3339(started)
    if spec.active_deadline_s is None or ctx.now - started < spec.active_deadline_s:
        return False
    limit = (ctx.job.get("spec") or {}).get("activeDeadline") or format_duration(spec.active_deadline_s)
    message = (
        f"the job was active for longer than spec.activeDeadline ({limit}), counted from "
        f"{rfc3339(started)} (its start or last resume); give a job that needs more time a larger "
        "spec.activeDeadline or none (a running job's can be raised before it expires)"
    )
    lifecycle.fail(ctx, reason="DeadlineExceeded", message=message, spec=spec)
    return True


def _keep_master(ctx: Pass, spec: JobSpec) -> bool:
    """One live master Pod with the spec's MIN:MAX; sets MasterReady and the status fields that describe
    the job's Pods. Returns whether the master is ready."""
    master = next((pod for pod in ctx.pods if pod.role == "master"), None)
    nodes = f"{spec.min_nodes}:{spec.max_nodes}"
    if master is None:
        master_name = elasticjob.master(ctx.name)
        ctx.actions.append(Create(builders.master_pod(ctx.job, spec, settings=ctx.settings)))
        if get_condition(ctx.conditions, "MasterReady") and master_name not in ctx.refused:
            message = "started a new master Pod; it resumes from the saved state"
            ctx.actions.append(Event("Warning", "MasterRecreated", message, about=master_name))
        else:
            message = f"created master Pod {master_name}"
            ctx.actions.append(Event("Normal", "MasterCreated", message, about=master_name))
    elif master.live and master.nodes and master.nodes != nodes:
        # nodes.min/max changed: the master takes them as flags, so it restarts (and resumes from its
        # state ConfigMap) with the new range; the worker slots follow.
        ctx.actions.append(DeletePod(master.name))
        message = f"nodes changed from {master.nodes} to {nodes}; restarting the master"
        ctx.actions.append(Event("Normal", "MasterReconfigured", message))
    elif not master.live and not master.terminating:
        ctx.actions.append(DeletePod(master.name, grace_period_s=0))
        message = f"master Pod {master.name} is {master.phase} ({pod_exit(master)}); replacing it"
        ctx.actions.append(Event("Warning", "MasterLost", message))
    elif master.node_lost:
        # Evicted from a node that stopped answering: no kubelet will confirm the deletion, and the new master
        # needs the name. Removed at once; the old process, if it still runs, is fenced off the state.
        ctx.actions.append(DeletePod(master.name, grace_period_s=0))
        message = (f"master Pod {master.name}'s node {master.node_name or '?'} stopped answering; starting a "
                   "new master elsewhere, which resumes from the saved state")  # fmt: skip
        ctx.actions.append(Event("Warning", "MasterNodeLost", message))
    ready = (
        master is not None and master.phase == "Running" and not master.terminating and not master.unready
        and bool(ctx.master_status)
    )  # fmt: skip
    ctx.condition(
        "MasterReady",
        ready,
        "MasterRunning" if ready else "MasterStarting",
        "the master runs and publishes the job status" if ready else "waiting for the master",
    )
    ctx.out["nodes"] = _running_workers(ctx)
    ctx.out["selector"] = names.label_selector(ctx.name, component="worker")
    ctx.out["masterEndpoint"] = master_address(ctx.job, settings=ctx.settings)
    return ready


def _running_workers(ctx: Pass) -> int:
    return sum(1 for w in ctx.workers if w.phase == "Running" and not w.terminating)


def _suspend(ctx: Pass, spec: JobSpec) -> None:
    """spec.suspend: the master's Suspended is an acknowledgement only if it follows this spec: one
    published before a resume and the next suspension (seconds apart) is stale, and the master may not
    know yet."""
    followed = int(ctx.master_status.get(elasticjob.MASTER_OBSERVED_GENERATION) or 0)
    written = (ctx.job.get("spec") or {}).get("suspend") is True  # not yet, when a queue just evicted it
    acked = written and ctx.verdict is Phase.SUSPENDED and followed >= ctx.generation
    lifecycle.suspend(ctx, spec, acked=acked)


def _resume(ctx: Pass) -> bool | None:
    """Whether this pass resumes the job from a suspension (its slots then get Pods that are no
    replacements); None while Pods deleted for the suspension are still stopping (the pass waits)."""
    was = lifecycle.suspension(ctx.status)
    if not was:
        return False
    if stopping := [w for w in ctx.workers if w.terminating]:
        # Pods deleted for the suspension are still persisting their newest checkpoint: new ones started
        # now would resume from an older one.
        message = f"waiting for {len(stopping)} worker Pods to stop before creating new ones"
        ctx.condition("Suspended", False, "Resuming", message)
        return None
    message = (
        "resumed: new worker Pods resume from the last committed checkpoint"
        if was == "suspended"
        else "suspension cancelled before it completed"
    )
    ctx.condition("Suspended", False, "Resumed", message)
    ctx.actions.append(Event("Normal", "Resumed", message))
    ctx.out["startTime"] = rfc3339(ctx.now)  # spec.activeDeadline counts from the resume, as batch/v1 Job's
    return True


def _replacement_budget_exhausted(ctx: Pass, spec: JobSpec, replaced: int) -> bool:
    """Counts this pass's replacements into ``status.replacements``; True when that failed the job."""
    budget = spec.restart.max_evictions
    used = int(ctx.status.get("replacements", 0)) + replaced
    ctx.out["replacements"] = used
    if used <= budget:
        return False
    message = f"{used} worker Pods had to be replaced, more than restart.maxEvictions={budget}"
    lifecycle.fail(ctx, reason="ReplacementBudgetExhausted", message=message, spec=spec)
    return True


def _disruption_budget_exhausted(ctx: Pass, spec: JobSpec, disrupted: int) -> bool:
    """Counts this pass's disruptions into ``status.disruptions``; True when that failed the job: a cluster
    that ends the job's Pods without end (a node pool that is always reclaimed) stops it, with a reason
    that is the cluster's, not the job's."""
    used = int(ctx.status.get("disruptions", 0)) + disrupted
    ctx.out["disruptions"] = used
    if used <= spec.max_disruptions:
        return False
    message = (
        f"the cluster ended {used} worker Pods (preemptions, drains, node pressure), more than "
        f"restart.maxDisruptions={spec.max_disruptions}"
    )
    lifecycle.fail(ctx, reason="DisruptionBudgetExhausted", message=message, spec=spec)
    return True


def _running_phase(
    ctx: Pass, spec: JobSpec, *, replaced: Replacements, resuming: bool, master_ready: bool
) -> None:
    """The phase of a job that runs: Running, Restarting (replacing nodes, or fewer than nodes.min up), or
    still starting; with its Running and Restarting conditions and an Event when it changes."""
    phase, workers, running = ctx.phase, ctx.workers, _running_workers(ctx)
    # A job whose worker Pods the suspension deleted has too few nodes because of that, not because any were
    # lost: it starts again (Created, then Running) instead of Restarting.
    was_up = phase in (Phase.RUNNING, Phase.RESTARTING) and not (
        resuming and not any(w.live for w in workers)
    )
    # A slot whose newest Pod exited 0 is a node that finished training (the others follow within a
    # heartbeat, then the master's verdict): it is neither lost nor replaced.
    finished = finished_slots(workers, spec.max_nodes)
    restarting = replaced.any or (was_up and running + finished < spec.min_nodes)
    new_phase: Phase
    if restarting:
        new_phase = Phase.RESTARTING
    elif master_ready and running >= spec.min_nodes:
        new_phase = Phase.RUNNING
    else:  # still starting, or a master being replaced: keep what the job was
        new_phase = phase if was_up and phase is not None else Phase.CREATED
    if new_phase not in (phase, Phase.CREATED):  # CREATED has its own Event
        ctx.actions.append(Event("Normal" if new_phase != Phase.RESTARTING else "Warning", new_phase,
                                 f"job is {new_phase} with {running} of {spec.max_nodes} nodes"))  # fmt: skip
    ctx.out["phase"] = new_phase
    done = f", {finished} finished" if finished else ""
    message = f"{running} of {spec.max_nodes} worker Pods running{done} (minimum {spec.min_nodes})"
    running_now = new_phase == Phase.RUNNING
    ctx.condition("Running", running_now, "NodesRunning" if running_now else "NotRunning", message)
    ctx.condition("Restarting", new_phase == Phase.RESTARTING, "Replacing" if restarting else "Stable",
                  _restarting_message(replaced) if restarting else "no node is being replaced")  # fmt: skip


def _restarting_message(replaced: Replacements) -> str:
    if replaced.disrupted and not replaced.failed:
        return "replacing nodes the cluster took (preemption, drain or node pressure), not charged to the job"
    return "replacing lost nodes"


def _settled(ctx: Pass) -> list[Action]:
    """The end of a pass that followed the spec: refusals settled, the generation observed."""
    _settle_refusals(ctx)
    ctx.out["observedGeneration"] = ctx.generation
    return ctx.finish()


def _settle_refusals(ctx: Pass) -> None:
    """A pass with nothing left to create ends a refusal: what the API server refused exists now, or is no
    longer wanted (a scale-down, a suspension)."""
    if is_true(ctx.conditions, refusals.CONDITION) and not any(isinstance(a, Create) for a in ctx.actions):
        ctx.condition(
            refusals.CONDITION, False, "Created", "the API server accepted every object the job needs"
        )
        ctx.out["refusedPods"] = []


def _refused_for_too_long(ctx: Pass, spec: JobSpec) -> str:
    """Why the job fails now because the API server has refused its objects for longer than
    spec.createRefusedTimeout (counted from the ReplicaFailure condition's transition); "" if it does not."""
    c = get_condition(ctx.status.get("conditions") or [], refusals.CONDITION)
    if not c or c.get("status") != "True" or not c.get("lastTransitionTime"):
        return ""
    since = parse_rfc3339(str(c["lastTransitionTime"]))
    if ctx.now - since < spec.create_refused_timeout_s:
        return ""
    limit = (ctx.job.get("spec") or {}).get("createRefusedTimeout") or format_duration(
        spec.create_refused_timeout_s
    )
    return (
        f"the API server refused to create the job's objects since {rfc3339(since)}, longer than "
        f"spec.createRefusedTimeout ({limit}): {c.get('message') or 'no message'}"
    )


def _keep_gang(ctx: Pass, spec: JobSpec) -> None:
    """Keeps the job's PodGroup (created once, its minimum following the spec) and mirrors the scheduler's
    verdict as the GangScheduled condition, with an Event when it changes: a job whose gang does not fit says
    so instead of sitting Pending without a word."""
    assert spec.gang is not None
    group, scheduler = ctx.observed.pod_group, spec.gang.scheduler
    if group is None:
        ctx.actions.append(Create(builders.pod_group(ctx.job, spec)))
        return
    count = gang_module.min_count(group, scheduler)
    if count != spec.gang.min_nodes:
        ctx.actions.append(PatchPodGroup(elasticjob.pod_group(ctx.name), spec.gang.min_nodes, scheduler))
    verdict = gang_module.verdict(group, ctx.workers, spec.gang)
    if verdict is None:  # the scheduler has not looked at it yet
        return
    placed, reason, detail = verdict
    if placed:
        message = f"the scheduler placed at least {count} worker Pods at once"
    else:
        message = f"the scheduler cannot place {count} worker Pods at once{': ' if detail else ''}{detail}"
    before = get_condition(ctx.conditions, "GangScheduled")
    ctx.condition("GangScheduled", placed, reason, message)
    if before is None or before.get("status") != str(placed):  # an Event per change, not per pass
        kind, event = ("Normal", "GangScheduled") if placed else ("Warning", "GangUnschedulable")
        ctx.actions.append(Event(kind, event, message))


def _blocked_by_foreign(ctx: Pass, foreign: Sequence[tuple[str, str]]) -> None:
    """Objects with the names of the job's own exist but belong to someone else (or to an earlier job of
    the name, still being garbage-collected): the job neither adopts, overwrites nor deletes them, and
    starts no Pod, which would mount or run as them. It says so and waits; a later pass goes on once they
    are gone."""
    meta = ctx.job["metadata"]
    listed = ", ".join(f"{kind} {meta['namespace']}/{name}" for kind, name in foreign)
    message = (
        f"{listed} already exists and is not this job's (no ownerReference with uid {meta['uid']}): the "
        "operator never uses, overwrites or deletes an object it does not own. Delete or rename it, or "
        "give the job another name"
    )
    before = get_condition(ctx.conditions, "Created")
    ctx.condition("Created", False, "ForeignObject", message)
    if not before or before.get("reason") != "ForeignObject" or before.get("message") != message:
        ctx.actions.append(Event("Warning", "ForeignObject", message))
    ctx.out["phase"] = ctx.status.get("phase") or Phase.PENDING
