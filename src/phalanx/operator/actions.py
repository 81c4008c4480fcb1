"""What a reconciliation pass sees (:class:`Observed`, :class:`PodView`) and what it decides (the actions).

:func:`phalanx.operator.reconcile.reconcile` turns the one into a list of the other; the executor
(:mod:`phalanx.operator.executor`) observes and carries the actions out. Plain frozen records, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from phalanx.api import elasticjob
from phalanx.operator.admission import MAX_NODES

MAX_POD_NAME = 63
"""A worker Pod's name is its hostname too, a DNS label (the job name's bound keeps the operator's within)."""

PodPhase = Literal["Pending", "Running", "Succeeded", "Failed", "Unknown"]
"""A Pod's phase as Kubernetes reports it: a misspelt phase in a comparison is a mypy error."""
POD_PHASES: tuple[PodPhase, ...] = get_args(PodPhase)
LIVE_PHASES: tuple[PodPhase, ...] = ("Pending", "Running", "Unknown")


NODE_LOST = "DeletionByTaintManager"
"""The ``DisruptionTarget`` reason of a Pod evicted for its node's NoExecute taint."""


@dataclass(frozen=True, kw_only=True)
class PodView:
    """What the decision needs to know about one Pod of the job."""

    name: str
    role: str
    phase: PodPhase
    node_name: str = ""
    terminating: bool = False
    exit_code: int | None = None
    reason: str = ""
    nodes: str = ""
    """For the master Pod: the MIN:MAX it runs with (its phalanx.dev/nodes annotation)."""
    stuck: tuple[str, str] = ("", "")
    """Why the Pod does not run though it should: (reason, message) of an unschedulable Pod (the scheduler's
    words) or of a container the kubelet cannot start or keeps restarting (``ImagePullBackOff``,
    ``CreateContainerConfigError``, ``CrashLoopBackOff``, ...); empty for a Pod that runs or starts
    normally."""
    disruption: str = ""
    """Why the cluster, not the job, ended the Pod: the reason of its ``DisruptionTarget`` condition
    (``PreemptionByScheduler``, ``EvictionByEvictionAPI`` for a drain, ``TerminationByKubelet``,
    ``DeletionByTaintManager``, ...) or ``Evicted`` for a kubelet's node-pressure eviction; "" for none."""
    unready: bool = False
    """Its Ready condition is False while it runs: its node stopped answering (the node controller marks
    every Pod there so) or its container is not ready."""

    @property
    def slot(self) -> int | None:
        parsed = _worker(self.name)
        return parsed[0] if parsed else None

    @property
    def incarnation(self) -> int:
        parsed = _worker(self.name)
        return parsed[1] if parsed else 0

    @property
    def node_lost(self) -> bool:
        """Kubernetes is deleting it for its node's NoExecute taint: the node stayed unreachable or not ready
        longer than the Pod tolerates (a master: the operator's ``master_node_lost_s``)."""
        return self.terminating and self.disruption == NODE_LOST

    @property
    def live(self) -> bool:
        return not self.terminating and self.phase in LIVE_PHASES

    @property
    def started(self) -> bool:
        """Its containers were started (phase Running): placed, its images pulled, its volumes mounted. A Pod
        still pulling a large training image is placed but not started."""
        return not self.terminating and self.phase == "Running"


def _worker(name: str) -> tuple[int, int] | None:
    """(slot, incarnation) of a worker Pod's name, or None for a name the operator never gives: a slot at or
    beyond the largest ``nodes.max`` admission accepts, or a name longer than a DNS label. Anyone who may
    create Pods can name one after a job, and a pass sizes its lists by the slots it sees: bounded here, one
    job's forged Pod cannot take the operator's memory from every other job. (A forged incarnation within
    the label still moves that job's next Pod names on; only someone who may create Pods in its namespace
    can do that, and they could delete the job as well.)"""
    parsed = elasticjob.parse_worker(name) if len(name) <= MAX_POD_NAME else None
    return parsed if parsed is not None and parsed[0] < MAX_NODES else None


@dataclass(frozen=True, kw_only=True)
class QueueView:
    """What a pass of a queued job needs to know of Kueue."""

    served: bool = True
    """Whether the API server serves Workloads."""
    workload: Mapping[str, Any] | None = None
    flavors: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    """The ``spec`` of each ResourceFlavor the Workload's admission names."""
    priority: Mapping[str, Any] = field(default_factory=dict)
    """``priorityClassRef`` and ``priority`` for a new Workload (read only while there is none)."""


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
    admission_policy: bool = True
    """Whether the operator's admission policy and its binding exist (read only for jobs whose templates
    ask for privileges: :mod:`phalanx.operator.privileged`)."""
    queue: QueueView | None = None
    """Kueue's side of a queued job (label ``kueue.x-k8s.io/queue-name``: :mod:`phalanx.operator.kueue`)."""


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
    """Sets the gang's minimum of the job's PodGroup (it follows nodes.min unless the spec fixes it)."""

    name: str
    min_count: int
    scheduler: str = "kubernetes"
    """Whose PodGroup (:mod:`phalanx.operator.gang`)."""


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


@dataclass(frozen=True)
class SetSuspend:
    """Sets the job's ``spec.suspend``: a queued job's is its admission by Kueue (:mod:`~.kueue`)."""

    suspend: bool


@dataclass(frozen=True)
class DeleteWorkload:
    name: str


@dataclass(frozen=True)
class PatchWorkloadStatus:
    """A merge patch of a Workload's status, made only if the Workload is still at ``resource_version``."""

    name: str
    resource_version: str
    status: dict[str, Any]


@dataclass(frozen=True)
class AdoptWorkload:
    """Makes the job the controlling owner of a Workload made for it by another (a prebuilt Workload:
    MultiKueue's in a worker cluster), as Kueue's job framework adopts one; only if it is still at
    ``resource_version``. ``owners`` is the whole new list of ownerReferences."""

    name: str
    resource_version: str
    owners: tuple[Mapping[str, Any], ...]


Action = (
    Create
    | DeletePod
    | PatchStatus
    | PatchPodGroup
    | Event
    | CordonNode
    | DeleteJob
    | SetSuspend
    | DeleteWorkload
    | PatchWorkloadStatus
    | AdoptWorkload
)
