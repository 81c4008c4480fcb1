"""The executor: observes a job's objects through the Kubernetes API and carries out the actions that
:func:`phalanx.operator.reconcile.reconcile` decided. All I/O of the operator is here."""

from __future__ import annotations

import copy
import logging
import secrets
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from phalanx.api import elasticjob
from phalanx.api.elasticjob import FINISHED_PHASES, GROUP, PLURAL, SCHEDULED_ANNOTATION, VERSION
from phalanx.api.errors import KubernetesError
from phalanx.api.settings import OperatorSettings
from phalanx.operator import gang, kueue, names, privileged, refusals, tls
from phalanx.operator.actions import (
    Action,
    CordonNode,
    Create,
    DeleteJob,
    DeletePod,
    Event,
    Observed,
    PatchPodGroup,
    PatchStatus,
)
from phalanx.operator.builders import with_bad_node_taint
from phalanx.operator.ca import load_authority
from phalanx.operator.conditions import set_condition
from phalanx.operator.discovery import Discovery
from phalanx.operator.events import Aggregator, pass_error_message, record_event
from phalanx.operator.kueue_api import QueueAction, QueueClient
from phalanx.operator.metrics_token import operator_metrics_token
from phalanx.operator.observe import owned_by, ownership, pod_view, read_metadata
from phalanx.operator.reconcile import managed_here, reconcile
from phalanx.operator.supporting import supporting_names, supporting_objects
from phalanx.operator.telemetry import OperatorMetrics

log = logging.getLogger("phalanx.operator")

SUPPORTING_RECHECK_S = 300.0
"""How long a job whose supporting objects all existed is trusted to still have them before they are read
again (6 GETs). They are the job's own, deleted only with it; the operator does not watch them (a watch on
Secrets would be a read of every Secret in the cluster)."""


class Executor:
    """Observes and acts for one operator process. Passes of the same job never overlap (a lock per
    job), so an edge-triggered pass and the timer's pass never act on the same observation twice."""

    def __init__(
        self,
        *,
        api: Any,
        settings: OperatorSettings,
        metrics: OperatorMetrics | None = None,
        own_namespace: str = "phalanx-system",
    ) -> None:
        from kubernetes import client

        self.settings = settings
        self.own_namespace = own_namespace
        """The operator's namespace: where its CA and metrics token Secrets live (settings.tls_ca_secret,
        settings.metrics_token_secret)."""
        self._authority: tls.Authority | None = None
        self.metrics = metrics or OperatorMetrics()
        # Typed as Any: the operator passes plain dicts (the builders' output), which the client accepts.
        self.core: Any = client.CoreV1Api(api)
        self.metrics_token = operator_metrics_token(settings, core=self.core, namespace=own_namespace)
        """What Prometheus presents to every job's master and to the operator's own /metrics ("": none)."""
        self.rbac: Any = client.RbacAuthorizationV1Api(api)
        self.networking: Any = client.NetworkingV1Api(api)
        self.custom: Any = client.CustomObjectsApi(api)
        self.discovery = Discovery(api)
        self.queues = QueueClient(custom=self.custom, scheduling=client.SchedulingV1Api(api))
        self._events = Aggregator()
        self._locks: dict[tuple[str, str], threading.Lock] = {}
        self._dirty: set[tuple[str, str]] = set()
        self._guard = threading.Lock()
        self.jobs: Any = None  # kopf's watches, remembered (phalanx.operator.memory): see use_caches()
        self.pods: Any = None
        self.may_act: Callable[[], bool] = lambda: True
        """Whether this replica may write now (leader election: phalanx.operator.leader); checked before
        every action, so a replica that lost its Lease does nothing more."""
        self._supporting_seen: dict[str, float] = {}  # job uid -> when all its supporting objects existed

    def use_caches(self, *, jobs: Any, pods: Any) -> None:
        """Reads jobs and Pods from these memories of kopf's watches instead of a GET and a LIST per pass."""
        self.jobs, self.pods = jobs, pods

    def reconcile_job(self, *, namespace: str, name: str) -> None:
        """Runs a reconciliation pass of job ``namespace/name`` now, or makes the pass already running
        for it go round once more. Bursts of triggers (200 Pods turning Running) coalesce into a few
        passes instead of one pass each."""
        key = (namespace, name)
        with self._guard:
            self._dirty.add(key)
            lock = self._locks.setdefault(key, threading.Lock())
        if not lock.acquire(blocking=False):
            return  # the running pass sees the flag and goes again
        try:
            while True:
                with self._guard:
                    if key not in self._dirty:
                        return
                    self._dirty.discard(key)
                try:
                    self.run_pass(namespace=namespace, name=name)
                except Exception as exc:  # one job's bad object never stops the others' passes
                    log.exception("%s/%s: reconciliation pass failed", namespace, name)
                    self._record_pass_error(namespace, name, exc)
        finally:
            lock.release()

    def _record_pass_error(self, namespace: str, name: str, exc: Exception) -> None:
        """Records a failed pass on its job: the ReconcileError condition (False again after the next pass
        that succeeds) and a Warning Event, so `kubectl describe ej` says why the job does not move. The
        timer tries again; the other jobs' passes never wait for this one."""
        from kubernetes.client.exceptions import ApiException

        if not self.may_act():  # a replica that is not the leader writes nothing
            return
        job: Mapping[str, Any] | None = self.jobs.get(namespace, name) if self.jobs is not None else None
        try:
            if job is None:
                job = self.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
            assert job is not None
            message = pass_error_message(exc)
            meta, status = job["metadata"], job.get("status") or {}
            conditions = set_condition(
                status.get("conditions") or [], kind="ReconcileError", status=True, reason=type(exc).__name__,
                message=message, now=time.time(), generation=int(meta.get("generation", 1)),
            )  # fmt: skip
            self.custom.patch_namespaced_custom_object_status(
                GROUP, VERSION, namespace, PLURAL, name, {"status": {"conditions": conditions}}
            )
            self._event(job, Event("Warning", "ReconcileError", message))
        except (ApiException, KubernetesError, KeyError, TypeError, AssertionError) as again:
            log.warning("%s/%s: cannot record the failed pass: %s", namespace, name, again)

    def run_pass(self, *, namespace: str, name: str) -> list[Action]:
        """One reconciliation pass: observe, decide, act. Returns the actions carried out."""
        started = time.perf_counter()
        try:
            observed = self.observe(namespace=namespace, name=name)
            if observed is None:
                self.metrics.job_phase(namespace, name, None)
                return []
            actions = reconcile(
                observed,
                now=time.time(),
                settings=self.settings,
                new_token=secrets.token_urlsafe(32),
                metrics_token=self.metrics_token,
                issue_tls=lambda: self._issue_tls(observed.job),
            )
            self.apply(observed.job, actions)
            if not any(isinstance(a, DeleteJob) for a in actions):
                self._publish_scheduled(observed)
        except Exception:
            self.metrics.passes.labels(result="error").inc()
            raise
        finally:
            self.metrics.duration.observe(time.perf_counter() - started)
        self.metrics.passes.labels(result="ok").inc()
        phases = [a.status["phase"] for a in actions if isinstance(a, PatchStatus) and "phase" in a.status]
        said = phases[-1] if phases else (observed.job.get("status") or {}).get("phase")
        self.metrics.job_phase(namespace, name, elasticjob.phase_of(said))
        return actions

    def _publish_scheduled(self, observed: Observed) -> None:
        """Tells the master how many worker Pods have started (annotation ``phalanx.dev/scheduled-workers``,
        which it reads with the spec): its min-nodes timeout runs only once min_nodes of them could join, so
        a job waiting in a queue, for an autoscaler or for its image to be pulled is not failed for nodes
        that never had a machine or a process. Written only when the count changes."""
        meta = observed.job["metadata"]
        if (observed.job.get("status") or {}).get("phase") in FINISHED_PHASES or not self.may_act():
            return
        started = sum(1 for p in observed.pods if p.role == "worker" and p.started)
        if (meta.get("annotations") or {}).get(SCHEDULED_ANNOTATION) == str(started):
            return
        body = {"metadata": {"annotations": {SCHEDULED_ANNOTATION: str(started)}}}
        patched = self.custom.patch_namespaced_custom_object(
            GROUP, VERSION, meta["namespace"], PLURAL, meta["name"], body
        )
        if self.jobs is not None:
            self.jobs.put(patched)

    def observe(self, *, namespace: str, name: str) -> Observed | None:
        """The job and its objects: from the watches' memory when the operator runs them, else read fresh."""
        from kubernetes.client.exceptions import ApiException

        if self.jobs is not None:
            # The memory is current to within the watch's latency, and the executor writes what it
            # changed through to it, so no pass acts on its own stale state.
            cached = self.jobs.get(namespace, name)
            if cached is None:
                return None
            job = copy.deepcopy(cached)
        else:
            try:
                job = self.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
            except ApiException as exc:
                if exc.status == 404:
                    return None
                raise KubernetesError(f"cannot read ElasticJob {namespace}/{name}: {exc.reason}") from exc
        if job["metadata"].get("deletionTimestamp") or not managed_here(job):
            return None  # being deleted, or another controller's (spec.managedBy): nothing to do here
        if self.pods is not None:
            pods = self.pods.by_index((namespace, name))
        else:
            selector = f"{names.JOB_LABEL}={name}"
            pods = self.core.list_namespaced_pod(namespace, label_selector=selector).items
        owned = [p for p in pods if owned_by(p.metadata.owner_references, job["metadata"]["uid"])]
        group, serves, api = None, True, gang.APIS[gang.scheduler_of(job.get("spec") or {})]
        if gang.enabled(job.get("spec") or {}):
            serves = self.discovery.serves_pod_groups(api)
            group = self._pod_group(namespace, name, api) if serves else None
        existing, foreign = self._existing(namespace, name, job["metadata"]["uid"])
        if group is not None and not any(
            r.get("uid") == job["metadata"]["uid"] for r in group["metadata"].get("ownerReferences") or []
        ):  # a PodGroup of the job's name that is not the job's: never adopted, read or patched
            foreign, group = foreign | {("PodGroup", elasticjob.pod_group(name))}, None
        asks = privileged.requests(job.get("spec") or {})
        policy = not asks or self.discovery.admission_policy_found(self.settings.admission_policy)
        return Observed(
            job=job,
            pods=[pod_view(p) for p in owned],
            existing=existing,
            foreign=foreign,
            pod_group=group,
            pod_group_api=serves,
            admission_policy=policy,
            queue=self.queues.observe(job) if kueue.queue_name(job) else None,
        )

    def _pod_group(self, namespace: str, name: str, api: gang.GangApi) -> Mapping[str, Any] | None:
        from kubernetes.client.exceptions import ApiException

        group = elasticjob.pod_group(name)
        try:
            found: Mapping[str, Any] = self.custom.get_namespaced_custom_object(
                api.group, api.version, namespace, api.plural, group
            )
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise KubernetesError(f"cannot read PodGroup {namespace}/{group}: {exc.reason}") from exc
        return found

    def _existing(
        self, namespace: str, name: str, uid: str = ""
    ) -> tuple[frozenset[tuple[str, str]], frozenset[tuple[str, str]]]:
        """(the job's supporting objects that exist and are its own, those of their names that exist but
        are not: no ownerReference with the job's uid), read again every SUPPORTING_RECHECK_S at most."""
        reads = {
            "Secret": self.core.read_namespaced_secret,
            "ConfigMap": self.core.read_namespaced_config_map,
            "ServiceAccount": self.core.read_namespaced_service_account,
            "Role": self.rbac.read_namespaced_role,
            "RoleBinding": self.rbac.read_namespaced_role_binding,
            "Service": self.core.read_namespaced_service,
            "NetworkPolicy": self.networking.read_namespaced_network_policy,
        }
        wanted = [(kind, obj_name) for kind, obj_name in self._supporting_names(name) if kind in reads]
        everything = frozenset(wanted)
        seen = self._supporting_seen.get(uid)
        if self.jobs is not None and seen is not None and time.monotonic() - seen < SUPPORTING_RECHECK_S:
            return everything, frozenset()

        found, foreign = ownership(reads, wanted, namespace=namespace, uid=uid)
        if found == everything and uid:
            self._supporting_seen[uid] = time.monotonic()
        else:
            self._supporting_seen.pop(uid, None)
        return frozenset(found), frozenset(foreign)

    def _issue_tls(self, job: Mapping[str, Any]) -> Mapping[str, str]:
        """The job's master certificate, signed by the operator's CA."""
        meta = job["metadata"]
        now = datetime.now(UTC)
        return tls.master_certificate(meta["name"], meta["namespace"], authority=self.authority(), now=now)

    def authority(self) -> tls.Authority:
        """The CA that signs the masters' certificates (:func:`phalanx.operator.ca.load_authority`), read
        once per process."""
        if self._authority is None:
            self._authority = load_authority(
                self.core,
                name=self.settings.tls_ca_secret,
                namespace=self.own_namespace,
                may_act=self.may_act,
            )
        return self._authority

    def _supporting_names(self, name: str) -> list[tuple[str, str]]:
        """(kind, name) of the job's supporting objects under this operator's settings (no job needed: the
        names follow from the job's name)."""
        stub = {"metadata": {"name": name, "namespace": "", "uid": ""}}
        objects = supporting_objects(
            stub,
            settings=self.settings,
            token="-",  # noqa: S106 -- a placeholder: only the objects' names are used
            metrics_token=self.metrics_token,
        )
        return supporting_names(objects)

    def apply(self, job: Mapping[str, Any], actions: Sequence[Action]) -> None:
        """Carries out the actions in order. A create the API server refuses (Forbidden, Invalid, quota) is
        recorded in the job's status (:mod:`phalanx.operator.refusals`), and the Events that would have
        reported that object's creation are dropped."""
        from kubernetes.client.exceptions import ApiException

        ns, name = job["metadata"]["namespace"], job["metadata"]["name"]
        refused: list[refusals.Refusal] = []
        for action in actions:
            if isinstance(action, Event) and any(r.kind == "Pod" and r.name == action.about for r in refused):
                continue
            kind = type(action).__name__
            if not self.may_act():
                log.warning("%s/%s: not the leader any more; dropping %s and what follows", ns, name, kind)
                return
            self.metrics.actions.labels(action=kind).inc()
            try:
                self._apply_one(job, action)
            except ApiException as exc:
                self.metrics.action_failures.labels(action=kind).inc()
                log.warning("%s/%s: %s failed: %s %s", ns, name, kind, exc.status, exc.reason)
                if isinstance(action, Create):
                    what, obj_name = action.obj["kind"], action.obj["metadata"]["name"]
                    message = refusals.api_message(exc.body, fallback=str(exc.reason))
                    if refusals.is_refusal(exc.status):
                        refused.append(refusals.Refusal(what, obj_name, int(exc.status), message))
                    else:  # the API server may recover: the next pass tries again
                        self._event(job, Event("Warning", "CreateFailed", f"cannot create {what}: {message}"))
        if refused:
            self._record_refusals(job, actions, refused)

    def _record_refusals(
        self, job: Mapping[str, Any], actions: Sequence[Action], refused: Sequence[refusals.Refusal]
    ) -> None:
        """Sets the ReplicaFailure condition and status.refusedPods on the status as this pass left it, and
        records one (aggregated) Warning Event per refusal."""
        from kubernetes.client.exceptions import ApiException

        meta = job["metadata"]
        status = dict(job.get("status") or {})
        for action in actions:
            if isinstance(action, PatchStatus):
                status.update(action.status)
        patch = refusals.refused_status(
            status, refused, now=time.time(), generation=int(meta.get("generation", 1))
        )
        try:
            self._apply_one(job, PatchStatus(patch))
        except ApiException as exc:
            log.warning(
                "%s/%s: cannot record refused creates: %s", meta["namespace"], meta["name"], exc.reason
            )
        for r in refused:
            self._event(job, Event("Warning", refusals.REASON, r.text))

    def _apply_one(self, job: Mapping[str, Any], action: Action) -> None:
        from kubernetes.client.exceptions import ApiException

        ns = job["metadata"]["namespace"]
        if isinstance(action, Create):
            try:
                created = self._create(ns, action.obj)
                if action.obj["kind"] == "Pod" and self.pods is not None:
                    self.pods.put(created)  # write-through: the next pass counts it at once
            except ApiException as exc:
                if exc.status != 409:  # 409: it exists already (a previous pass or operator made it)
                    raise
                if action.obj["kind"] == "Pod":
                    self._foreign_pod(job, action.obj["metadata"]["name"])
        elif isinstance(action, DeletePod):
            try:
                deleted = self.core.delete_namespaced_pod(
                    action.name,
                    ns,
                    grace_period_seconds=action.grace_period_s,
                    propagation_policy="Background",
                )
                if self.pods is not None and getattr(deleted, "metadata", None) is not None:
                    self.pods.put(deleted)  # terminating (or gone: the watch's DELETED follows)
            except ApiException as exc:
                if exc.status != 404:
                    raise
        elif isinstance(action, PatchPodGroup):
            api = gang.APIS[action.scheduler]
            body = {
                "spec": gang.group_spec(gang.Gang(min_nodes=action.min_count, scheduler=action.scheduler))
            }
            self.custom.patch_namespaced_custom_object(
                api.group, api.version, ns, api.plural, action.name, body
            )
        elif isinstance(action, PatchStatus):
            patched = self.custom.patch_namespaced_custom_object_status(
                GROUP, VERSION, ns, PLURAL, job["metadata"]["name"], {"status": action.status}
            )
            if self.jobs is not None:
                self.jobs.put(patched)
        elif isinstance(action, Event):
            self._event(job, action)
        elif isinstance(action, CordonNode):
            self._cordon(action)
        elif isinstance(action, DeleteJob):
            self._delete_job(job, action)
        elif isinstance(action, QueueAction):
            patched = self.queues.apply(job, action)
            if patched is not None and self.jobs is not None:
                self.jobs.put(patched)

    def _foreign_pod(self, job: Mapping[str, Any], name: str) -> None:
        """A Pod of the name the job's Pod should have exists: normally the job's own (made by an earlier
        pass, not yet seen); one that is not the job's is never adopted nor deleted, and the job says so."""
        meta = read_metadata(self.core.read_namespaced_pod, name, job["metadata"]["namespace"])
        refs = (meta or {}).get("ownerReferences") or []
        if meta is None or any(
            isinstance(r, Mapping) and r.get("uid") == job["metadata"]["uid"] for r in refs
        ):
            return
        ns, uid = job["metadata"]["namespace"], job["metadata"]["uid"]
        message = (
            f"Pod {ns}/{name} already exists and is not this job's (no ownerReference with uid {uid}): the "
            "operator never uses or deletes it; delete or rename it"
        )
        self._event(job, Event("Warning", "ForeignObject", message))

    def _create(self, ns: str, obj: dict[str, Any]) -> Any:
        if obj["kind"] == "Workload":
            return self.queues.create(ns, obj)
        if obj["kind"] == "PodGroup":
            group, version = obj["apiVersion"].split("/")
            return self.custom.create_namespaced_custom_object(group, version, ns, "podgroups", obj)
        if obj["kind"] not in _CREATES:
            raise KubernetesError(f"the operator does not create {obj['kind']} objects")
        api, method = _CREATES[obj["kind"]]
        return getattr(getattr(self, api), method)(ns, obj)

    def _delete_job(self, job: Mapping[str, Any], action: DeleteJob) -> None:
        """Deletes the ElasticJob with foreground propagation, as batch/v1's TTL controller does: it stays,
        terminating, until the objects it owns are gone, so a new job of the same name never meets the old
        one's Pods, Secret or state ConfigMap (their names are deterministic). The uid precondition keeps
        a job re-created under the name meanwhile; that one (409) or one already gone (404) is done."""
        from kubernetes.client.exceptions import ApiException

        meta = job["metadata"]
        log.info("%s/%s: %s", meta["namespace"], meta["name"], action.message)
        try:
            self.custom.delete_namespaced_custom_object(
                GROUP, VERSION, meta["namespace"], PLURAL, meta["name"],
                propagation_policy="Foreground", body={"preconditions": {"uid": meta["uid"]}},
            )  # fmt: skip
        except ApiException as exc:
            if exc.status not in (404, 409):
                raise

    def _cordon(self, action: CordonNode) -> None:
        node = self.core.read_node(action.node)
        taints = with_bad_node_taint([t.to_dict() for t in (node.spec.taints or [])])
        self.core.patch_node(action.node, {"spec": {"unschedulable": True, "taints": taints}})

    def _event(self, job: Mapping[str, Any], event: Event) -> None:
        record_event(self.core, self._events, job, event)


_CREATES = {
    "Pod": ("core", "create_namespaced_pod"),
    "Secret": ("core", "create_namespaced_secret"),
    "ConfigMap": ("core", "create_namespaced_config_map"),
    "ServiceAccount": ("core", "create_namespaced_service_account"),
    "Service": ("core", "create_namespaced_service"),
    "Role": ("rbac", "create_namespaced_role"),
    "RoleBinding": ("rbac", "create_namespaced_role_binding"),
    "NetworkPolicy": ("networking", "create_namespaced_network_policy"),
}
"""The Executor's API client and its create method, by kind (PodGroups are custom objects)."""
