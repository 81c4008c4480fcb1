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
  next incarnation; that is a *replacement* and counts against ``restart.maxEvictions``;
* evictions the master wrote into ``status.evictions`` are carried out: the replacement is created with
  node affinity keeping it off the evicted machine, then the evicted Pod is deleted (in this order, so a
  crash between the two steps loses nothing). The machine kept off and, with ``cordonBadNodes`` and the
  operator's ``cordon_nodes`` switch, cordoned and tainted is the ``spec.nodeName`` of the evicted Pod as
  the operator observed it, never the machine name the master reports (a training script can read the
  job token and report any name);
* a supporting object of the job's name that exists but is not the job's (no ownerReference with its uid)
  is neither used, overwritten nor deleted: the job waits with Created False (reason ForeignObject) and
  creates no Pod until it is gone;
* slots beyond ``nodes.max`` (the spec was scaled down) are deleted, new slots (scaled up) created; the
  master Pod is restarted with the new ``--nodes MIN:MAX`` and resumes from its state;
* the master's verdict (``status.master.phase``) ends the job: Succeeded or Failed with the master's
  reason in the condition message; then worker Pods are cleaned up per ``cleanPodPolicy``;
* ``spec.suspend`` (ignored by a finished job) frees the job's worker nodes: until the master acknowledged
  (``status.master.phase`` Suspended: it then forgets nodes that leave instead of evicting them) worker
  Pods are neither created, replaced nor deleted; then every worker Pod is deleted gracefully (its agent
  persists its newest in-memory checkpoint on SIGTERM), and once none is left the job is Suspended. The
  master Pod stays and keeps the job's state. None of this is a replacement;
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

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from phalanx.api.errors import ConfigError
from phalanx.api.settings import OperatorSettings
from phalanx.operator import builders, names, refusals, resources
from phalanx.operator.conditions import get_condition, is_true, parse_rfc3339, rfc3339, set_condition
from phalanx.operator.crd import MANAGED_BY, format_duration
from phalanx.operator.spec import JobSpec, parse_spec, ttl_after_finished

LIVE_PHASES = ("Pending", "Running", "Unknown")
GANG_VERDICT = "PodGroupInitiallyScheduled"
"""The condition the Kubernetes scheduler sets on a PodGroup: whether it placed the gang (it stays True)."""
NO_POD_GROUP_API = (
    "spec.gangScheduling needs the PodGroup API (scheduling.k8s.io/v1beta1), which this cluster does not "
    "serve: it comes with Kubernetes 1.37 or later, with the GenericWorkload feature gate on in "
    "kube-apiserver and kube-scheduler and --runtime-config=scheduling.k8s.io/v1beta1=true on "
    "kube-apiserver. Enable it, or create the job without spec.gangScheduling"
)
EVICTED_GRACE_S = 10
"""Seconds an evicted worker Pod gets beyond restart.gracePeriod: its agent stops its workers, has its
persist refused by the master at once, and exits."""
SUSPENDING_REASONS = ("Suspending", "Resuming")
"""Reasons of a False ``Suspended`` condition while a suspension (or the resume after one) is under way."""


@dataclass(frozen=True, kw_only=True)
class PodView:
    """What the decision needs to know about one Pod of the job."""

    name: str
    role: str
    phase: str
    node_name: str = ""
    terminating: bool = False
    exit_code: int | None = None
    reason: str = ""
    nodes: str = ""
    """For the master Pod: the MIN:MAX it runs with (its phalanx.dev/nodes annotation)."""

    @property
    def slot(self) -> int | None:
        parsed = names.parse_worker(self.name)
        return parsed[0] if parsed else None

    @property
    def incarnation(self) -> int:
        parsed = names.parse_worker(self.name)
        return parsed[1] if parsed else 0

    @property
    def live(self) -> bool:
        return not self.terminating and self.phase in LIVE_PHASES


@dataclass(frozen=True, kw_only=True)
class Observed:
    """A job as the operator sees it at one moment."""

    job: Mapping[str, Any]
    pods: Sequence[PodView] = ()
    existing: frozenset[tuple[str, str]] = frozenset()
    """(kind, name) of the supporting objects that exist and are the job's (ownerReference with its uid)."""
    foreign: frozenset[tuple[str, str]] = frozenset()
    """(kind, name) of objects with the names of the job's supporting objects that are not the job's."""
    pod_group: Mapping[str, Any] | None = None
    """The job's PodGroup as read (``spec.gangScheduling`` only); None when it does not exist."""
    pod_group_api: bool = True
    """Whether the API server serves PodGroups (read only for jobs that ask for gang scheduling)."""


# ------------------------------------------------------------------------------------------------------
# Actions


@dataclass(frozen=True)
class Create:
    obj: dict[str, Any]


@dataclass(frozen=True)
class DeletePod:
    name: str
    grace_period_s: int | None = None


@dataclass(frozen=True)
class PatchStatus:
    status: dict[str, Any]


@dataclass(frozen=True)
class PatchPodGroup:
    """Sets the gang's minCount of the job's PodGroup (it follows nodes.min unless the spec fixes it)."""

    name: str
    min_count: int


@dataclass(frozen=True)
class Event:
    type: str  # Normal or Warning
    reason: str
    message: str
    about: str = ""
    """The name of the object whose creation this Event reports: the executor drops it if the API server
    refused that create (the ReplicaFailure condition and a FailedCreate Event tell that story)."""


@dataclass(frozen=True)
class CordonNode:
    node: str
    reason: str


@dataclass(frozen=True)
class DeleteJob:
    """Deletes the ElasticJob itself; what it owns (Pods, Secret, ConfigMap, master RBAC, Service) goes with
    it. ``message`` says why; the executor logs it (an Event on a deleted object would be lost with it)."""

    message: str


Action = Create | DeletePod | PatchStatus | PatchPodGroup | Event | CordonNode | DeleteJob


SetCondition = Callable[[str, bool, str, str], None]
"""Sets one status condition in the pass: (type, status, reason, message)."""


@dataclass
class _Pass:
    actions: list[Action] = field(default_factory=list)
    status: dict[str, Any] = field(default_factory=dict)


def supporting_objects(
    job: Mapping[str, Any],
    *,
    settings: OperatorSettings,
    token: str,
    metrics_token: str = "",
    tls_pems: Mapping[str, str] | None = None,
) -> list[dict[str, Any]]:
    """The objects the job needs besides its Pods, in creation order (the Role before its binding).
    ``tls_pems``: the job's certificate (:mod:`phalanx.operator.tls`), needed only when its Secret is to be
    made."""
    objects = [builders.token_secret(job, token=token)]
    if metrics_token:
        objects.append(builders.metrics_secret(job, metrics_token=metrics_token))
    if settings.tls_ca_secret:
        objects.append(builders.tls_secret(job, pems=tls_pems or {}))
    objects += [
        builders.state_config_map(job),
        builders.master_service_account(job),
        builders.master_role(job),
        builders.master_role_binding(job),
        builders.master_service(job, settings=settings),
    ]
    if settings.network_policy:
        objects.append(builders.master_network_policy(job, settings=settings))
    return objects


def managed_here(job: Mapping[str, Any]) -> bool:
    """Whether this operator reconciles the job: ``spec.managedBy`` absent or naming it. A job another
    controller manages gets no write of any kind from this one, not even a condition."""
    managed_by = (job.get("spec") or {}).get("managedBy")
    return managed_by in (None, "", MANAGED_BY)


def supporting_names(objects: Sequence[Mapping[str, Any]]) -> list[tuple[str, str]]:
    """(kind, name) of each object, as :attr:`Observed.existing` lists them."""
    return [(str(o["kind"]), str(o["metadata"]["name"])) for o in objects]


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
    NetworkPolicies, TLS)."""
    job = observed.job
    status: Mapping[str, Any] = job.get("status") or {}
    generation = int(job["metadata"].get("generation", 1))
    p = _Pass(status={"conditions": list(status.get("conditions") or [])})

    def condition(kind: str, value: bool, reason: str, message: str) -> None:
        p.status["conditions"] = set_condition(
            p.status["conditions"], kind=kind, status=value, reason=reason, message=message,
            now=now, generation=generation,
        )  # fmt: skip

    phase = status.get("phase", "")
    workers = [pod for pod in observed.pods if pod.role == "worker"]
    if is_true(p.status["conditions"], "ReconcileError"):  # this pass got this far: the error is over
        condition("ReconcileError", False, "Reconciled", "the last reconciliation pass succeeded")
    if phase in ("Succeeded", "Failed"):
        _cleanup(p, job, observed.pods, finished_for=_finished_for(status, now), settings=settings)
        actions = _finish(p, status)
        if expired := _ttl_expired(job, status, phase=phase, now=now):
            actions.append(DeleteJob(expired))  # last: nothing is patched on a job being deleted
        return actions

    try:
        spec = parse_spec(job.get("spec") or {})
        builders.training_entry(spec.template["spec"]["containers"][0])
    except ConfigError as exc:
        return _fail(p, status, condition, reason="InvalidSpec", message=str(exc), job=job,
                     pods=observed.pods, settings=settings)  # fmt: skip
    if spec.gang_min_nodes is not None and not observed.pod_group_api:
        return _fail(p, status, condition, reason="GangSchedulingUnavailable", message=NO_POD_GROUP_API,
                     job=job, pods=observed.pods, spec=spec, settings=settings)  # fmt: skip
    if expired := _refused_for_too_long(job, status, spec, now=now):
        return _fail(p, status, condition, reason=refusals.REASON, message=expired, job=job,
                     pods=observed.pods, spec=spec, settings=settings)  # fmt: skip
    refused = frozenset(str(n) for n in status.get("refusedPods") or [])

    # --- supporting objects ------------------------------------------------------------------------
    wanted = supporting_objects(job, settings=settings, token=new_token, metrics_token=metrics_token)
    if foreign := sorted(set(supporting_names(wanted)) & observed.foreign):
        return _blocked_by_foreign(p, status, condition, foreign, job=job)
    for obj in wanted:
        if (obj["kind"], obj["metadata"]["name"]) not in observed.existing:
            if obj["metadata"]["name"] == names.tls_secret(job["metadata"]["name"]):
                if issue_tls is None:
                    raise ValueError("the job's TLS Secret is missing and no certificate can be issued")
                obj["stringData"] = dict(issue_tls())  # issued only when the Secret is to be made
            p.actions.append(Create(obj))
    created = get_condition(p.status["conditions"], "Created")
    if not created or created.get("status") != "True":
        condition(
            "Created", True, "ObjectsCreated", "Secret, RBAC, Service and state ConfigMap of the job exist"
        )
        p.actions.append(
            Event("Normal", "Created", "created the job's Secret, master RBAC, Service and state")
        )

    # --- master ------------------------------------------------------------------------------------
    master = next((pod for pod in observed.pods if pod.role == "master"), None)
    master_status: Mapping[str, Any] = status.get("master") or {}
    verdict = str(master_status.get("phase", "")).lower()
    if verdict == "succeeded":
        condition("Succeeded", True, "TrainingCompleted", "all nodes finished training")
        condition("Running", False, "Completed", "the job finished")
        condition("Restarting", False, "Completed", "the job finished")
        _not_suspended(p, condition, "Completed")
        p.status["phase"] = "Succeeded"
        p.actions.append(Event("Normal", "Succeeded", "training completed"))
        _cleanup(p, job, observed.pods, spec=spec, finished_for=0.0, settings=settings)
        return _finish(p, status)
    if verdict == "failed":
        reason = str(master_status.get("reason") or "the master reported the job failed")
        kind, message = _master_failure(reason, spec)
        return _fail(p, status, condition, reason=kind, message=message, job=job,
                     pods=observed.pods, spec=spec, settings=settings)  # fmt: skip

    # --- spec.activeDeadline -----------------------------------------------------------------------
    # Neither suspended nor being resumed (the resume below starts the clock again): the job is active.
    if not spec.suspend and not _suspension(status):
        started = _start_time(status, now)
        p.status["startTime"] = rfc3339(started)
        if spec.active_deadline_s is not None and now - started >= spec.active_deadline_s:
            limit = (job.get("spec") or {}).get("activeDeadline") or format_duration(spec.active_deadline_s)
            message = (
                f"the job was active for longer than spec.activeDeadline ({limit}), counted from "
                f"{rfc3339(started)} (its start or last resume); give a job that needs more time a larger "
                "spec.activeDeadline or none (a running job's can be raised before it expires)"
            )
            return _fail(p, status, condition, reason="DeadlineExceeded", message=message, job=job,
                         pods=observed.pods, spec=spec, settings=settings)  # fmt: skip

    if master is None:
        master_name = names.master(job["metadata"]["name"])
        p.actions.append(Create(builders.master_pod(job, spec, settings=settings)))
        if get_condition(p.status["conditions"], "MasterReady") and master_name not in refused:
            message = "started a new master Pod; it resumes from the saved state"
            p.actions.append(Event("Warning", "MasterRecreated", message, about=master_name))
        else:
            p.actions.append(
                Event("Normal", "MasterCreated", f"created master Pod {master_name}", about=master_name)
            )
    elif master.live and master.nodes and master.nodes != f"{spec.min_nodes}:{spec.max_nodes}":
        # nodes.min/max changed: the master takes them as flags, so it restarts (and resumes from its
        # state ConfigMap) with the new range; the worker slots follow below.
        p.actions.append(DeletePod(master.name))
        p.actions.append(
            Event(
                "Normal",
                "MasterReconfigured",
                f"nodes changed from {master.nodes} to {spec.min_nodes}:{spec.max_nodes}; "
                "restarting the master",
            )
        )
    elif not master.live and not master.terminating:
        p.actions.append(DeletePod(master.name, grace_period_s=0))
        p.actions.append(
            Event(
                "Warning",
                "MasterLost",
                f"master Pod {master.name} is {master.phase} ({_exit(master)}); replacing it",
            )
        )
    master_ready = master is not None and master.phase == "Running" and bool(master_status)
    condition(
        "MasterReady",
        master_ready,
        "MasterRunning" if master_ready else "MasterStarting",
        "the master runs and publishes the job status" if master_ready else "waiting for the master",
    )
    running = sum(1 for w in workers if w.phase == "Running" and not w.terminating)
    p.status["nodes"] = running
    p.status["selector"] = names.label_selector(job["metadata"]["name"], component="worker")
    p.status["masterEndpoint"] = builders.master_address(job, settings=settings)

    # --- gang scheduling (before the first worker Pod: its group must be there to place it) ----------
    if spec.gang_min_nodes is not None:
        _gang(p, job, spec, observed.pod_group, condition)

    # --- suspension --------------------------------------------------------------------------------
    if spec.suspend:
        # The master's Suspended is an acknowledgement only if it follows this spec: one published before a
        # resume and the next suspension (seconds apart) is stale, and the master may not know yet.
        followed = int(master_status.get("observedGeneration") or 0)
        acked = verdict == "suspended" and followed >= generation
        _suspend(p, status, condition, workers, phase=phase, acked=acked, spec=spec)
        _settle_refusals(p, condition)
        p.status["observedGeneration"] = generation
        return _finish(p, status)
    resuming = False
    if was := _suspension(status):
        stopping = [w for w in workers if w.terminating]
        if stopping:
            # Pods deleted for the suspension are still persisting their newest checkpoint: new ones started
            # now would resume from an older one.
            message = f"waiting for {len(stopping)} worker Pods to stop before creating new ones"
            condition("Suspended", False, "Resuming", message)
            _settle_refusals(p, condition)
            p.status["observedGeneration"] = generation
            return _finish(p, status)
        resuming = True
        message = (
            "resumed: new worker Pods resume from the last committed checkpoint"
            if was == "suspended"
            else "suspension cancelled before it completed"
        )
        condition("Suspended", False, "Resumed", message)
        p.actions.append(Event("Normal", "Resumed", message))
        p.status["startTime"] = rfc3339(now)  # spec.activeDeadline counts from the resume, as batch/v1 Job's

    # --- workers -----------------------------------------------------------------------------------
    replaced = _reconcile_workers(
        p, job, spec, status, workers, resuming=resuming, refused=refused, settings=settings
    )
    budget = spec.restart.max_evictions
    used = int(status.get("replacements", 0)) + replaced
    p.status["replacements"] = used
    if used > budget:
        return _fail(
            p, status, condition, reason="ReplacementBudgetExhausted",
            message=f"{used} worker Pods had to be replaced, more than restart.maxEvictions={budget}",
            job=job, pods=observed.pods, spec=spec, settings=settings,
        )  # fmt: skip

    # A job whose worker Pods the suspension deleted has too few nodes because of that, not because any were
    # lost: it starts again (Created, then Running) instead of Restarting.
    was_up = phase in ("Running", "Restarting") and not (resuming and not any(w.live for w in workers))
    # A slot whose newest Pod exited 0 is a node that finished training (the others follow within a
    # heartbeat, then the master's verdict): it is neither lost nor replaced.
    finished = _finished_slots(workers, spec.max_nodes)
    restarting = replaced > 0 or (was_up and running + finished < spec.min_nodes)
    if restarting:
        new_phase = "Restarting"
    elif master_ready and running >= spec.min_nodes:
        new_phase = "Running"
    else:  # still starting, or a master being replaced: keep what the job was
        new_phase = phase if was_up else "Created"
    if new_phase not in (phase, "Created"):  # "Created" has its own Event above
        p.actions.append(Event("Normal" if new_phase != "Restarting" else "Warning", new_phase,
                               f"job is {new_phase} with {running} of {spec.max_nodes} nodes"))  # fmt: skip
    p.status["phase"] = new_phase
    done = f", {finished} finished" if finished else ""
    message = f"{running} of {spec.max_nodes} worker Pods running{done} (minimum {spec.min_nodes})"
    condition("Running", new_phase == "Running", "NodesRunning" if new_phase == "Running" else "NotRunning",
              message)  # fmt: skip
    condition("Restarting", new_phase == "Restarting", "Replacing" if restarting else "Stable",
              "replacing lost nodes" if restarting else "no node is being replaced")  # fmt: skip
    _settle_refusals(p, condition)
    p.status["observedGeneration"] = generation
    return _finish(p, status)


def _finished_slots(workers: Sequence[PodView], slots: int) -> int:
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


def _settle_refusals(p: _Pass, condition: SetCondition) -> None:
    """A pass with nothing left to create ends a refusal: what the API server refused exists now, or is no
    longer wanted (a scale-down, a suspension)."""
    if is_true(p.status["conditions"], refusals.CONDITION) and not any(
        isinstance(a, Create) for a in p.actions
    ):
        condition(refusals.CONDITION, False, "Created", "the API server accepted every object the job needs")
        p.status["refusedPods"] = []


def _refused_for_too_long(
    job: Mapping[str, Any], status: Mapping[str, Any], spec: JobSpec, *, now: float
) -> str:
    """Why the job fails now because the API server has refused its objects for longer than
    spec.createRefusedTimeout (counted from the ReplicaFailure condition's transition); "" if it does not."""
    c = get_condition(status.get("conditions") or [], refusals.CONDITION)
    if not c or c.get("status") != "True" or not c.get("lastTransitionTime"):
        return ""
    since = parse_rfc3339(str(c["lastTransitionTime"]))
    if now - since < spec.create_refused_timeout_s:
        return ""
    limit = (job.get("spec") or {}).get("createRefusedTimeout") or format_duration(
        spec.create_refused_timeout_s
    )
    return (
        f"the API server refused to create the job's objects since {rfc3339(since)}, longer than "
        f"spec.createRefusedTimeout ({limit}): {c.get('message') or 'no message'}"
    )


def _master_failure(reason: str, spec: JobSpec) -> tuple[str, str]:
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


def _gang(
    p: _Pass,
    job: Mapping[str, Any],
    spec: JobSpec,
    group: Mapping[str, Any] | None,
    condition: SetCondition,
) -> None:
    """Keeps the job's PodGroup (created once, its minCount following the spec) and mirrors the
    scheduler's verdict on it, PodGroupInitiallyScheduled, as the GangScheduled condition, with an Event
    when it changes: a job whose gang does not fit says so instead of sitting Pending without a word."""
    assert spec.gang_min_nodes is not None
    if group is None:
        p.actions.append(Create(builders.pod_group(job, spec)))
        return
    gang = ((group.get("spec") or {}).get("schedulingPolicy") or {}).get("gang") or {}
    if gang.get("minCount") != spec.gang_min_nodes:
        name = names.pod_group(job["metadata"]["name"])
        p.actions.append(PatchPodGroup(name, spec.gang_min_nodes))
    verdict = get_condition((group.get("status") or {}).get("conditions") or [], GANG_VERDICT)
    if verdict is None:  # the scheduler has not looked at it yet
        return
    placed = verdict.get("status") == "True"
    count, detail = gang.get("minCount"), str(verdict.get("message") or "")
    if placed:
        message = f"the scheduler placed at least {count} worker Pods at once"
    else:
        message = f"the scheduler cannot place {count} worker Pods at once{': ' if detail else ''}{detail}"
    reason = str(verdict.get("reason") or ("Scheduled" if placed else "Unknown"))
    before = get_condition(p.status["conditions"], "GangScheduled")
    condition("GangScheduled", placed, reason, message)
    if before is None or before.get("status") != str(placed):  # an Event per change, not per pass
        kind, event = ("Normal", "GangScheduled") if placed else ("Warning", "GangUnschedulable")
        p.actions.append(Event(kind, event, message))


def _blocked_by_foreign(
    p: _Pass,
    status: Mapping[str, Any],
    condition: SetCondition,
    foreign: Sequence[tuple[str, str]],
    *,
    job: Mapping[str, Any],
) -> list[Action]:
    """Objects with the names of the job's own exist but belong to someone else (or to an earlier job of
    the name, still being garbage-collected): the job neither adopts, overwrites nor deletes them, and
    starts no Pod, which would mount or run as them. It says so and waits; a later pass goes on once they
    are gone."""
    meta = job["metadata"]
    listed = ", ".join(f"{kind} {meta['namespace']}/{name}" for kind, name in foreign)
    message = (
        f"{listed} already exists and is not this job's (no ownerReference with uid {meta['uid']}): the "
        "operator never uses, overwrites or deletes an object it does not own. Delete or rename it, or "
        "give the job another name"
    )
    before = get_condition(p.status["conditions"], "Created")
    condition("Created", False, "ForeignObject", message)
    if not before or before.get("reason") != "ForeignObject" or before.get("message") != message:
        p.actions.append(Event("Warning", "ForeignObject", message))
    p.status["phase"] = status.get("phase") or "Pending"
    return _finish(p, status)


def _exit(pod: PodView) -> str:
    if pod.exit_code is not None:
        return f"exit code {pod.exit_code}" + (f", {pod.reason}" if pod.reason else "")
    return pod.reason or "gone"


def _reconcile_workers(
    p: _Pass,
    job: Mapping[str, Any],
    spec: JobSpec,
    status: Mapping[str, Any],
    workers: Sequence[PodView],
    *,
    resuming: bool = False,
    refused: frozenset[str] = frozenset(),
    settings: OperatorSettings,
) -> int:
    """Worker Pod actions; returns how many replacements this pass makes. ``resuming``: the slots' Pods
    were deleted by a suspension, so a slot without a Pod is no replacement. ``refused``: Pods the API
    server refused to create, asked for again under the same name (no replacement either)."""
    evictions = [e for e in status.get("evictions") or [] if isinstance(e, Mapping)]
    evicted = {str(e.get("nodeId")): e for e in evictions}
    excluded = list(status.get("excludedMachines") or [])
    for e in evictions:
        machine = evicted_machine(e, workers)
        if machine and machine not in excluded:
            excluded.append(machine)
            if spec.cordon_bad_nodes and settings.cordon_nodes:
                p.actions.append(CordonNode(machine, reason=str(e.get("reason") or "evicted by phalanx")))
                p.actions.append(Event("Warning", "NodeCordoned", f"cordoned and tainted bad node {machine}"))
            elif spec.cordon_bad_nodes:
                message = (
                    "spec.cordonBadNodes is set but this operator does not cordon nodes (its cordon_nodes "
                    f"setting is off): {machine} stays schedulable; the job's replacements are kept off it"
                )
                p.actions.append(Event("Warning", "NodeNotCordoned", message))
    p.status["excludedMachines"] = excluded
    incarnations = _incarnations(status, workers, slots=spec.max_nodes)
    by_slot: dict[int, list[PodView]] = {}
    for w in workers:
        if w.slot is not None:
            by_slot.setdefault(w.slot, []).append(w)
    replaced = 0
    for slot in range(spec.max_nodes):
        pods = sorted(by_slot.get(slot, []), key=lambda w: w.incarnation)
        newest = incarnations[slot]
        live = [w for w in pods if w.live]
        done = [w for w in pods if w.phase == "Succeeded" and not w.terminating]
        evict = [w for w in live if w.name in evicted]
        keep = [w for w in live if w.name not in evicted]
        cause = ""
        # The newest incarnation was refused by the API server and never existed: ask for it again.
        retry = (
            newest >= 0
            and names.worker(job["metadata"]["name"], slot=slot, incarnation=newest) in refused
            and not any(w.incarnation == newest for w in pods)
        )
        if evict and not keep:
            e = evicted[evict[0].name]
            cause = f"evicted by the master: {e.get('reason') or 'no reason given'}"
        elif not live and not done and not retry:
            last = pods[-1] if pods else None
            if last:
                cause = f"{last.name} {last.phase} ({_exit(last)})"
            elif newest >= 0 and not resuming:  # the slot had a Pod; a suspension did not delete it
                cause = "Pod vanished"
        if not keep and not done:
            inc = newest if retry else newest + 1
            pod = builders.worker_pod(job, spec, slot=slot, incarnation=inc, settings=settings,
                                      excluded_machines=excluded)  # fmt: skip
            name = pod["metadata"]["name"]
            p.actions.append(Create(pod))
            incarnations[slot] = inc
            if cause:
                replaced += 1
                p.actions.append(Event("Warning", "WorkerReplaced", f"slot {slot}: {cause}; created {name}",
                                       about=name))  # fmt: skip
            else:
                p.actions.append(Event("Normal", "WorkerCreated", f"created worker Pod {name}", about=name))
        for w in evict:
            # An evicted node persists nothing (the master refuses what a bad node holds), so it needs no
            # time for the write spec.terminationGracePeriod leaves: only to stop its workers.
            p.actions.append(
                DeletePod(w.name, grace_period_s=math.ceil(spec.restart.grace_period_s) + EVICTED_GRACE_S)
            )
            p.actions.append(
                Event(
                    "Warning",
                    "Evicted",
                    f"deleted {w.name} on {w.node_name or '?'}: {evicted[w.name].get('reason', '')}",
                )
            )
        for w in pods:  # failed Pods of older incarnations are garbage once a newer one exists
            if (
                not w.live
                and not w.terminating
                and w.phase != "Succeeded"
                and w.incarnation < incarnations[slot]
            ):
                p.actions.append(DeletePod(w.name, grace_period_s=0))
    for slot, pods in by_slot.items():
        if slot >= spec.max_nodes:
            for w in pods:
                if not w.terminating:
                    p.actions.append(DeletePod(w.name))
                    p.actions.append(
                        Event("Normal", "ScaledDown", f"deleted {w.name}: nodes.max is {spec.max_nodes}")
                    )
    p.status["workerIncarnations"] = incarnations
    return replaced


def evicted_machine(eviction: Mapping[str, Any], workers: Sequence[PodView]) -> str:
    """The Kubernetes node of an eviction the master asked for: the ``spec.nodeName`` of the live worker Pod
    it names, as the operator observed it; "" when no such Pod is seen (already gone, or not the job's).
    The ``machine`` the master reports is never used: it is what an agent said, and a training script can
    register a node under any name with the job token."""
    node_id = str(eviction.get("nodeId") or "")
    pod = next((w for w in workers if w.name == node_id and w.live), None)
    return pod.node_name if pod else ""


def _incarnations(status: Mapping[str, Any], workers: Sequence[PodView], *, slots: int) -> list[int]:
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


def _suspension(status: Mapping[str, Any]) -> str:
    """Where the job stood with a suspension at the start of the pass: "suspended", "suspending" (asked
    for, or being resumed from, but not finished), or "" (none)."""
    conditions = status.get("conditions") or []
    if status.get("phase") == "Suspended" or is_true(conditions, "Suspended"):
        return "suspended"
    c = get_condition(conditions, "Suspended")
    return "suspending" if c and c.get("reason") in SUSPENDING_REASONS else ""


def _suspend(
    p: _Pass,
    status: Mapping[str, Any],
    condition: SetCondition,
    workers: Sequence[PodView],
    *,
    phase: str,
    acked: bool,
    spec: JobSpec,
) -> None:
    """spec.suspend is true: free the job's worker nodes, the master Pod stays (small, no GPU, the state).

    The worker Pods go only after the master acknowledged (``status.master.phase`` Suspended): before, it
    would count them as lost and spend the eviction budget on them. Deletion is graceful: an agent persists
    its newest in-memory checkpoint on SIGTERM, and the job is Suspended only once every Pod is gone.
    Nothing here is a replacement; the incarnations are kept so that resumed Pods get new names.
    """
    p.status["workerIncarnations"] = _incarnations(status, workers, slots=spec.max_nodes)
    # A job already Suspended with no worker Pod left stays so while the master catches up with a spec edit
    # (a new generation): there is nothing left to delete, hence nothing to wait for.
    settled = not workers and _suspension(status) == "suspended"
    if not acked and not settled:  # a failing worker is not replaced either: the job is about to stop anyway
        message = "waiting for the master to acknowledge the suspension before deleting worker Pods"
        condition("Suspended", False, "Suspending", message)
        p.status["phase"] = phase or "Created"
        return
    stop = [w for w in workers if not w.terminating]
    live = [w for w in stop if w.live]
    for w in stop:  # a finished Pod has nothing left to persist
        p.actions.append(DeletePod(w.name, grace_period_s=None if w.live else 0))
    if stop:
        finished = len(stop) - len(live)
        message = f"deleting {len(live)} worker Pods; each persists its newest checkpoint first"
        if finished:
            message += f" (and {finished} finished ones)"
        p.actions.append(Event("Normal", "Suspending", message))
    if workers:  # terminating ones too: they are still persisting their checkpoint
        condition("Suspended", False, "Suspending", f"waiting for {len(workers)} worker Pods to stop")
        return
    condition("Suspended", True, "JobSuspended", "no worker Pods run; set spec.suspend to false to resume")
    condition("Running", False, "Suspended", "the job is suspended")
    condition("Restarting", False, "Suspended", "the job is suspended")
    if phase != "Suspended":
        p.actions.append(Event("Normal", "Suspended", "the job is suspended; its master Pod keeps its state"))
    p.status["phase"] = "Suspended"


def _not_suspended(p: _Pass, condition: SetCondition, reason: str) -> None:
    """A job that finishes is no longer suspended (the master may end a suspended job); a job that never
    was keeps having no Suspended condition."""
    if get_condition(p.status["conditions"], "Suspended"):
        condition("Suspended", False, reason, "the job finished")


def _finished_at(status: Mapping[str, Any]) -> float | None:
    """When the job's Succeeded or Failed condition became true (None if it has not)."""
    for kind in ("Succeeded", "Failed"):
        c = get_condition(status.get("conditions") or [], kind)
        if c and c.get("status") == "True" and c.get("lastTransitionTime"):
            return parse_rfc3339(str(c["lastTransitionTime"]))
    return None


def _finished_for(status: Mapping[str, Any], now: float) -> float:
    """Seconds since the job's Succeeded or Failed condition became true (0 if it has not)."""
    at = _finished_at(status)
    return 0.0 if at is None else max(0.0, now - at)


def _ttl_expired(job: Mapping[str, Any], status: Mapping[str, Any], *, phase: str, now: float) -> str:
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
    finished_at = _finished_at(status)
    if ttl is None or finished_at is None or now - finished_at < ttl:
        return ""
    return (
        f"deleting the job: {phase} since {rfc3339(finished_at)}, longer than spec.ttlAfterFinished "
        f"({spec.get('ttlAfterFinished')})"
    )


def _start_time(status: Mapping[str, Any], now: float) -> float:
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


def _cleanup(
    p: _Pass,
    job: Mapping[str, Any],
    pods: Sequence[PodView],
    *,
    finished_for: float,
    settings: OperatorSettings,
    spec: JobSpec | None = None,
) -> None:
    """Deletes the finished job's Pods per spec.cleanPodPolicy (None, Running or All).

    Pods still running get ``finish_grace_s`` to exit by themselves first: when the master declares success
    the agents are told to exit at their next heartbeat, and a succeeded job's Pods should read Completed,
    not deleted. A later pass (the timer) deletes whatever still runs after the grace.
    """
    policy = spec.clean_pod_policy if spec else str((job.get("spec") or {}).get("cleanPodPolicy", "Running"))
    if policy == "None":
        return
    for pod in pods:
        if pod.terminating:
            continue
        overdue = pod.live and finished_for >= settings.finish_grace_s
        if overdue or (policy == "All" and not pod.live):
            p.actions.append(DeletePod(pod.name))


def _fail(
    p: _Pass,
    status: Mapping[str, Any],
    condition: SetCondition,
    *,
    reason: str,
    message: str,
    job: Mapping[str, Any],
    pods: Sequence[PodView],
    settings: OperatorSettings,
    spec: JobSpec | None = None,
) -> list[Action]:
    condition("Failed", True, reason, message)
    condition("Running", False, reason, "the job failed")
    condition("Restarting", False, reason, "the job failed")
    _not_suspended(p, condition, reason)
    p.status["phase"] = "Failed"
    p.actions.append(Event("Warning", "Failed", message))
    _cleanup(p, job, pods, spec=spec, finished_for=0.0, settings=settings)
    return _finish(p, status)


def _finish(p: _Pass, status: Mapping[str, Any]) -> list[Action]:
    """Adds one status patch with the fields that changed (none: no patch)."""
    changed = {k: v for k, v in p.status.items() if status.get(k) != v}
    if changed:
        p.actions.append(PatchStatus(changed))
    return p.actions
