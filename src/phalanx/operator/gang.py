"""Gang scheduling (``spec.gangScheduling``): which scheduler holds a job's worker Pods until ``minNodes`` of
them fit at once, the PodGroup API it reads, and how a worker Pod joins its group. Pure.

* ``kubernetes``: the in-tree PodGroup (``scheduling.k8s.io/v1beta1``, Kubernetes 1.37 with the
  GenericWorkload feature gate); a Pod names it in ``spec.schedulingGroup``; the scheduler's verdict is the
  group's ``PodGroupInitiallyScheduled`` condition.
* ``coscheduling``: scheduler-plugins' Coscheduling plugin (``scheduling.x-k8s.io/v1alpha1`` PodGroup,
  ``minMember``), run as a second scheduler (``schedulerName``, by default ``scheduler-plugins-scheduler``, as
  its release names it); a Pod joins by the label ``scheduling.x-k8s.io/pod-group``. Its Permit stage holds
  the Pods it placed until ``minMember`` are, and releases them all if they are not within its timeout. Its
  PodGroup status is kept by a controller of its own that not every install runs, so the verdict is read
  from the Pods: placed once ``minMember`` workers are bound, else the scheduler's own words on a waiting one.

Volcano's PodGroup is not offered: no release of ``volcano.sh/volcano`` could be had here to build and test
against (the module proxy refused v1.13.0), and a scheduler integration that never met its scheduler is not
shipped.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from phalanx.api.errors import ConfigError
from phalanx.operator.actions import PodView
from phalanx.operator.conditions import get_condition


@dataclass(frozen=True)
class GangApi:
    group: str
    version: str
    plural: str = "podgroups"

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}"


KUBERNETES, COSCHEDULING = "kubernetes", "coscheduling"
APIS = {
    KUBERNETES: GangApi("scheduling.k8s.io", "v1beta1"),
    COSCHEDULING: GangApi("scheduling.x-k8s.io", "v1alpha1"),
}
SCHEDULERS = tuple(APIS)
GANG_VERDICT = "PodGroupInitiallyScheduled"
"""The condition the Kubernetes scheduler sets on a PodGroup: whether it placed the gang (it stays True)."""
COSCHEDULING_LABEL = "scheduling.x-k8s.io/pod-group"
DEFAULT_SCHEDULER_NAMES = {KUBERNETES: "", COSCHEDULING: "scheduler-plugins-scheduler"}
"""The Pods' ``schedulerName`` unless ``gangScheduling.schedulerName`` says otherwise ("": the template's)."""
UNAVAILABLE = {
    KUBERNETES: (
        "spec.gangScheduling needs the PodGroup API (scheduling.k8s.io/v1beta1), which this cluster does not "
        "serve: it comes with Kubernetes 1.37 or later, with the GenericWorkload feature gate on in "
        "kube-apiserver and kube-scheduler and --runtime-config=scheduling.k8s.io/v1beta1=true on "
        "kube-apiserver. Enable it, or create the job without spec.gangScheduling"
    ),
    COSCHEDULING: (
        "spec.gangScheduling.scheduler coscheduling needs scheduler-plugins' PodGroup API "
        "(scheduling.x-k8s.io/v1alpha1), which this cluster does not serve: install scheduler-plugins' CRDs "
        "and its scheduler with the Coscheduling plugin, or choose another scheduler"
    ),
}


@dataclass(frozen=True)
class Gang:
    min_nodes: int
    scheduler: str = KUBERNETES
    scheduler_name: str = ""
    """The worker Pods' ``schedulerName`` ("": the template's own)."""


def enabled(spec: Mapping[str, Any]) -> bool:
    """Whether ``spec.gangScheduling`` is on; read on its own by the executor, before the spec is parsed."""
    gang = spec.get("gangScheduling")
    return isinstance(gang, Mapping) and gang.get("enabled") is True


def scheduler_of(spec: Mapping[str, Any]) -> str:
    """The scheduler a job's raw spec names: the executor reads its PodGroup before the spec is parsed."""
    gang = spec.get("gangScheduling")
    name = gang.get("scheduler", KUBERNETES) if isinstance(gang, Mapping) else KUBERNETES
    return name if name in APIS else KUBERNETES


def parse(spec: Mapping[str, Any], *, min_nodes: int, max_nodes: int) -> Gang | None:
    """``spec.gangScheduling`` -> the gang (minNodes defaults to nodes.min), None when off."""
    gang = spec.get("gangScheduling") or {}
    if not isinstance(gang, Mapping):
        raise ConfigError("expected an object", field="spec.gangScheduling")
    on = gang.get("enabled", False)
    if not isinstance(on, bool):
        raise ConfigError(f"expected true or false, got {on!r}", field="spec.gangScheduling.enabled")
    if not on:
        return None
    count = gang.get("minNodes", min_nodes)
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= max_nodes:
        raise ConfigError(
            f"must be a whole number from 1 to nodes.max ({max_nodes}), got {count!r}",
            field="spec.gangScheduling.minNodes",
        )
    scheduler = gang.get("scheduler", KUBERNETES)
    if scheduler not in APIS:
        raise ConfigError(f"must be one of {', '.join(SCHEDULERS)}, got {scheduler!r}",
                          field="spec.gangScheduling.scheduler")  # fmt: skip
    name = gang.get("schedulerName", DEFAULT_SCHEDULER_NAMES[scheduler])
    if not isinstance(name, str):
        raise ConfigError(f"expected a string, got {name!r}", field="spec.gangScheduling.schedulerName")
    return Gang(min_nodes=count, scheduler=scheduler, scheduler_name=name)


def group_spec(gang: Gang, *, priority_class: str = "") -> dict[str, Any]:
    if gang.scheduler == COSCHEDULING:
        return {"minMember": gang.min_nodes}
    spec: dict[str, Any] = {"schedulingPolicy": {"gang": {"minCount": gang.min_nodes}}}
    if priority_class:
        spec["priorityClassName"] = priority_class  # the group preempts and is preempted as its Pods are
    return spec


def min_count(group: Mapping[str, Any], scheduler: str) -> Any:
    """The gang's minimum as the PodGroup holds it."""
    spec = group.get("spec") or {}
    if scheduler == COSCHEDULING:
        return spec.get("minMember")
    return ((spec.get("schedulingPolicy") or {}).get("gang") or {}).get("minCount")


def join(pod: dict[str, Any], group: str, gang: Gang) -> None:
    """Makes a worker Pod a member of its job's PodGroup, scheduled by the gang's scheduler."""
    if gang.scheduler == COSCHEDULING:
        pod["metadata"]["labels"][COSCHEDULING_LABEL] = group
    else:
        pod["spec"]["schedulingGroup"] = {"podGroupName": group}
    if gang.scheduler_name:
        pod["spec"]["schedulerName"] = gang.scheduler_name


def verdict(group: Mapping[str, Any], workers: Sequence[PodView], gang: Gang) -> tuple[bool, str, str] | None:
    """(placed, reason, detail) of the scheduler on the gang; None before it said anything. The in-tree
    scheduler's is its PodGroup's condition; one that writes none on its group (Coscheduling without its
    controller) is read from the worker Pods: placed once ``min_nodes`` are bound, not placed while one waits
    with the scheduler's message."""
    if gang.scheduler == KUBERNETES:
        said = get_condition((group.get("status") or {}).get("conditions") or [], GANG_VERDICT)
        if said is None:
            return None
        placed = said.get("status") == "True"
        return (
            placed,
            str(said.get("reason") or ("Scheduled" if placed else "Unknown")),
            str(said.get("message") or ""),
        )
    live = [w for w in workers if w.live]
    if sum(1 for w in live if w.node_name) >= gang.min_nodes:
        return True, "Scheduled", ""
    waiting = [w.stuck[1] for w in live if not w.node_name and w.stuck[0] == "Unschedulable" and w.stuck[1]]
    return (False, "Unschedulable", waiting[0]) if waiting else None
