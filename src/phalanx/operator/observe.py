"""The decision's view of what the API server holds (:class:`phalanx.operator.actions.PodView`), and reading
an object's metadata without its data (a Secret's never reaches the operator)."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from phalanx.api.errors import KubernetesError
from phalanx.operator import names
from phalanx.operator.actions import POD_PHASES, PodPhase, PodView


def pod_view(pod: Any) -> PodView:
    """The decision's view of a kubernetes.client V1Pod."""
    labels = pod.metadata.labels or {}
    exit_code: int | None = None
    reason = ""
    for cs in (pod.status.container_statuses or []) if pod.status else []:
        term = cs.state.terminated if cs.state else None
        if term is not None:
            exit_code, reason = term.exit_code, term.reason or ""
            break
    return PodView(
        name=pod.metadata.name,
        role=labels.get(names.ROLE_LABEL, ""),
        phase=pod_phase(pod.status.phase if pod.status else None),
        node_name=pod.spec.node_name or "",
        terminating=pod.metadata.deletion_timestamp is not None,
        exit_code=exit_code,
        reason=reason,
        nodes=(pod.metadata.annotations or {}).get(names.NODES_ANNOTATION, ""),
        disruption=disruption(pod),
        stuck=stuck(pod),
        unready=unready(pod),
    )


def pod_from_dict(raw: Mapping[str, Any], api: Any) -> Any:
    """A kubernetes.client V1Pod from a Pod as the API server sends it (kopf's index holds those), made by
    ``api`` (a client API object, e.g. CoreV1Api) as the Kubernetes client makes one of every answer.

    Through the client's one private method that every version has: its public ``deserialize`` takes a
    response object up to kubernetes 33 and the response's text and content type since (and would parse the
    JSON again)."""
    return api.api_client._ApiClient__deserialize(dict(raw), "V1Pod")


def pod_phase(value: str | None) -> PodPhase:
    """The Pod's phase; none yet is Pending, a word this operator does not know is Unknown."""
    if value is None or value == "":
        return "Pending"
    return next((p for p in POD_PHASES if p == value), "Unknown")


def unready(pod: Any) -> bool:
    """A running Pod whose Ready condition is False (:attr:`PodView.unready`)."""
    status = pod.status
    if status is None or status.phase != "Running":
        return False
    return any(c.type == "Ready" and c.status == "False" for c in status.conditions or [])


STUCK_WAITING = frozenset({
    "ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull",
    "CreateContainerConfigError", "CreateContainerError", "RunContainerError", "CrashLoopBackOff",
    "PreCreateHookError", "PreStartHookError",
})  # fmt: skip
"""Waiting reasons of a container the kubelet cannot start, or keeps restarting (``ContainerCreating`` and
``PodInitializing`` are a normal start)."""


FIXES = (
    (
        "image will run as root",
        "the image runs as root, and phalanx's restricted default gives the Pod runAsNonRoot: set "
        "spec.template.spec.securityContext.runAsUser (and fsGroup) to a uid the image can run as, or "
        "runAsNonRoot: false where the namespace's Pod Security level allows root",
    ),
    (
        "image has non-numeric user",
        "the image names its user, which runAsNonRoot cannot check: set "
        "spec.template.spec.securityContext.runAsUser to that user's uid",
    ),
)
"""What to do about a kubelet's message that names no fix: (words in the message, the fix). Vendor training
images (NGC's among them) run as root, which the restricted level's ``runAsNonRoot`` refuses at start."""


def _with_fix(message: str) -> str:
    return next((f"{message}; {fix}" for words, fix in FIXES if words in message), message)


def stuck(pod: Any) -> tuple[str, str]:
    """Why ``pod`` does not run (:attr:`PodView.stuck`): the scheduler's Unschedulable, else the first init or
    main container waiting for a reason of :data:`STUCK_WAITING`."""
    status = pod.status
    if status is None or status.phase not in (None, "Pending", "Running"):
        return "", ""
    for c in status.conditions or []:
        if c.type == "PodScheduled" and c.status == "False" and c.reason == "Unschedulable":
            return "Unschedulable", str(c.message or "no node fits the Pod")
    for cs in [*(status.init_container_statuses or []), *(status.container_statuses or [])]:
        waiting = cs.state.waiting if cs.state else None
        if waiting is not None and waiting.reason in STUCK_WAITING:
            return str(waiting.reason), _with_fix(f"container {cs.name}: {waiting.message or waiting.reason}")
    return "", ""


DISRUPTION_CONDITION = "DisruptionTarget"
"""The condition Kubernetes puts on a Pod it is about to end for its own reasons (a preemption, a drain's
eviction, node pressure or shutdown, a taint), before it deletes or fails it."""
KUBELET_EVICTED = "Evicted"
"""``status.reason`` of a Pod the kubelet failed for node pressure (it carries no condition on older
clusters)."""


def disruption(pod: Any) -> str:
    """Why the cluster ended ``pod`` (:attr:`PodView.disruption`), or ""."""
    status = pod.status
    if status is None:
        return ""
    for c in status.conditions or []:
        if c.type == DISRUPTION_CONDITION and c.status == "True":
            return str(c.reason or DISRUPTION_CONDITION)
    return KUBELET_EVICTED if status.phase == "Failed" and status.reason == KUBELET_EVICTED else ""


METADATA_ONLY = "application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1"
"""The Accept header that makes the API server send an object's metadata without its data or spec."""
METADATA_LIST = "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1"
"""The same for a LIST: the objects' metadata only."""


def read_metadata(read: Callable[..., Any], name: str, namespace: str) -> Mapping[str, Any] | None:
    """The metadata of one object through a kubernetes.client ``read_namespaced_*`` method (None: it does
    not exist). A Secret's data never reaches the operator: it only needs to know whose the object is."""
    from kubernetes.client.exceptions import ApiException

    try:
        response = read(name, namespace, _preload_content=False, _headers={"Accept": METADATA_ONLY})
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise
    body = json.loads(response.data or b"{}")
    meta = body.get("metadata") if isinstance(body, Mapping) else None
    return meta if isinstance(meta, Mapping) else {}


def owned_by(refs: Sequence[Any] | None, uid: str) -> bool:
    return any(r.uid == uid for r in refs or [])


def ownership(
    reads: Mapping[str, Callable[..., Any]], wanted: Sequence[tuple[str, str]], *, namespace: str, uid: str
) -> tuple[set[tuple[str, str]], set[tuple[str, str]]]:
    """Of the (kind, name) objects ``wanted``: (those that exist and are the job's, those that exist but are
    not: no ownerReference with the job's ``uid``). ``reads``: the kubernetes.client ``read_namespaced_*``
    method of each kind. Read as metadata only: the operator never holds a Secret's data, and a foreign
    object is never adopted."""
    from kubernetes.client.exceptions import ApiException

    found, foreign = set(), set()
    for kind, obj_name in wanted:
        try:
            meta = read_metadata(reads[kind], obj_name, namespace)
        except ApiException as exc:
            raise KubernetesError(f"cannot read {kind} {namespace}/{obj_name}: {exc.reason}") from exc
        if meta is None:
            continue
        refs = meta.get("ownerReferences") or []
        if uid and not any(isinstance(r, Mapping) and r.get("uid") == uid for r in refs):
            foreign.add((kind, obj_name))
        else:
            found.add((kind, obj_name))
    return found, foreign
