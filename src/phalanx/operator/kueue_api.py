"""Kueue through the API server: what a queued job's pass reads (its Workload, the ResourceFlavors its
admission names, the priority a new Workload gets) and the writes :mod:`phalanx.operator.kueue` decides."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from phalanx.api.elasticjob import GROUP as JOB_GROUP
from phalanx.api.elasticjob import PLURAL as JOB_PLURAL
from phalanx.api.elasticjob import VERSION as JOB_VERSION
from phalanx.api.errors import KubernetesError
from phalanx.operator import kueue
from phalanx.operator.actions import AdoptWorkload, DeleteWorkload, PatchWorkloadStatus, QueueView, SetSuspend

QueueAction = SetSuspend | DeleteWorkload | PatchWorkloadStatus | AdoptWorkload

KUEUE = kueue.GROUP
SERVED_SEEN_FOR_S = 60.0
"""How long a "no" to whether Workloads are served is believed before it is asked again."""
FLAVOR_SEEN_FOR_S = 60.0
"""How long a ResourceFlavor read is used before it is read again (they change when an administrator edits
them; a pass of every admitted job would otherwise read them every reconcile interval)."""


class QueueClient:
    """One per operator process; ``custom`` is a CustomObjectsApi, ``scheduling`` a SchedulingV1Api. With
    :meth:`use_cache`, Workloads are read from the operator's watch of them (:mod:`phalanx.operator.cache`),
    else with a GET per pass of a queued job."""

    def __init__(self, *, custom: Any, scheduling: Any) -> None:
        self.custom, self.scheduling = custom, scheduling
        self.workloads: Any = None
        self._served = False
        self._unserved_until = 0.0
        self._flavors: dict[str, tuple[float, Mapping[str, Any]]] = {}

    def use_cache(self, workloads: Any) -> None:
        self.workloads = workloads

    def observe(self, job: Mapping[str, Any]) -> QueueView:
        if not self.serves_workloads(fresh=True):  # a "no" fails the job: never a stale one
            return QueueView(served=False)
        name, namespace = kueue.workload_name(job), job["metadata"]["namespace"]
        if self.workloads is not None:
            found = self.workloads.get(namespace, name)
        else:
            found = self._get(kueue.VERSION, kueue.WORKLOADS, name, namespace)
        flavors = {flavor: self._flavor(flavor) for flavor in kueue.flavor_names(found)}
        return QueueView(workload=found, flavors=flavors, priority={} if found else self._priority(job))

    def _flavor(self, name: str) -> Mapping[str, Any]:
        seen_at, spec = self._flavors.get(name, (0.0, {}))
        if time.monotonic() - seen_at < FLAVOR_SEEN_FOR_S:
            return spec
        flavor = self._get("v1beta2", "resourceflavors", name)
        if flavor is None:
            raise KubernetesError(f"ResourceFlavor {name}, named by the job's admission, does not exist")
        self._flavors[name] = (time.monotonic(), flavor.get("spec") or {})
        return self._flavors[name][1]

    def serves_workloads(self, *, fresh: bool = False) -> bool:
        """API discovery: a yes is kept for the process's life, a no for a minute (``fresh``: asked again)."""
        from kubernetes.client.exceptions import ApiException

        if self._served or (not fresh and time.monotonic() < self._unserved_until):
            return self._served
        try:
            found = self.custom.get_api_resources(KUEUE, kueue.VERSION)
        except ApiException as exc:
            if exc.status != 404:
                raise KubernetesError(
                    f"cannot discover the {KUEUE}/{kueue.VERSION} API: {exc.reason}"
                ) from exc
            found = None
        self._served = found is not None and any(r.name == kueue.WORKLOADS for r in found.resources or [])
        if not self._served:
            self._unserved_until = time.monotonic() + SERVED_SEEN_FOR_S
        return self._served

    def _get(self, version: str, plural: str, name: str, namespace: str = "") -> Mapping[str, Any] | None:
        from kubernetes.client.exceptions import ApiException

        try:
            if namespace:
                found: Mapping[str, Any] = self.custom.get_namespaced_custom_object(
                    KUEUE, version, namespace, plural, name
                )
            else:
                found = self.custom.get_cluster_custom_object(KUEUE, version, plural, name)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise KubernetesError(f"cannot read {plural} {name}: {exc.reason}") from exc
        return found

    def _priority(self, job: Mapping[str, Any]) -> dict[str, Any]:
        """The priority of a new Workload, as Kueue's job framework chooses it: the WorkloadPriorityClass the
        label names, else the PriorityClass of the worker template, else none (0)."""
        from kubernetes.client.exceptions import ApiException

        named = str((job["metadata"].get("labels") or {}).get(kueue.PRIORITY_LABEL) or "")
        if named:
            found = self._get("v1beta2", "workloadpriorityclasses", named)
            if found is None:
                raise KubernetesError(f"the WorkloadPriorityClass {named} of label {kueue.PRIORITY_LABEL} "
                                      "does not exist")  # fmt: skip
            ref = {"group": KUEUE, "kind": "WorkloadPriorityClass", "name": named}
            return {"priorityClassRef": ref, "priority": int(found.get("value", 0))}
        template = ((job.get("spec") or {}).get("template") or {}).get("spec") or {}
        if not (pod_class := str(template.get("priorityClassName") or "")):
            return {}
        try:
            value = self.scheduling.read_priority_class(pod_class).value
        except ApiException as exc:
            raise KubernetesError(f"cannot read the PriorityClass {pod_class}: {exc.reason}") from exc
        ref = {"group": "scheduling.k8s.io", "kind": "PriorityClass", "name": pod_class}
        return {"priorityClassRef": ref, "priority": int(value or 0)}

    def create(self, namespace: str, obj: Mapping[str, Any]) -> Any:
        created = self.custom.create_namespaced_custom_object(
            KUEUE, kueue.VERSION, namespace, kueue.WORKLOADS, obj
        )
        if self.workloads is not None:
            self.workloads.put(created)  # write-through: the next pass sees it before the watch does
        return created

    def _put(self, workload: Mapping[str, Any]) -> None:
        if self.workloads is not None:
            self.workloads.put(workload)  # write-through, as for a create

    def apply(self, job: Mapping[str, Any], action: QueueAction) -> Any:
        """Carries out one of the queue's actions; returns the job as patched for :class:`SetSuspend`."""
        from kubernetes.client.exceptions import ApiException

        ns, name = job["metadata"]["namespace"], job["metadata"]["name"]
        if isinstance(action, SetSuspend):
            body = {"spec": {"suspend": action.suspend}}
            return self.custom.patch_namespaced_custom_object(
                JOB_GROUP, JOB_VERSION, ns, JOB_PLURAL, name, body
            )
        try:
            if isinstance(action, DeleteWorkload):
                self.custom.delete_namespaced_custom_object(
                    KUEUE, kueue.VERSION, ns, kueue.WORKLOADS, action.name
                )
                if self.workloads is not None:
                    self.workloads.remove(ns, action.name)
            elif isinstance(action, AdoptWorkload):
                meta = {"resourceVersion": action.resource_version, "ownerReferences": list(action.owners)}
                self._put(self.custom.patch_namespaced_custom_object(
                    KUEUE, kueue.VERSION, ns, kueue.WORKLOADS, action.name, {"metadata": meta}
                ))  # fmt: skip
            else:
                patch = {"metadata": {"resourceVersion": action.resource_version}, "status": action.status}
                self._put(self.custom.patch_namespaced_custom_object_status(
                    KUEUE, kueue.VERSION, ns, kueue.WORKLOADS, action.name, patch
                ))  # fmt: skip
        except ApiException as exc:
            if exc.status not in (404, 409):  # gone, or changed since read: the next pass sees it anew
                raise
        return None
