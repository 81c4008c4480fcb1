"""What a job's templates ask for beyond an ordinary Pod: the fields the operator refuses while it cannot find
its admission policy.

The operator creates a job's Pods with its own rights. The ValidatingAdmissionPolicy
``phalanx-elasticjob-templates`` (``deploy/elasticjob-admission.yaml``) keeps a template within its author's
rights: without it (not installed, or the chart's policy off below Kubernetes 1.30), anyone allowed to create
an ElasticJob would get a privileged Pod, a node's filesystem or another service account's rights through the
operator. So the operator fails closed: while it cannot find the policy and its binding, a job whose templates
ask for any of :func:`requests` fails (reason ``AdmissionPolicyMissing``) with what it asked and what to do.
The policy also checks the right to read each Secret, ConfigMap and claim a Pod mounts; those are not
privileges of the node, and are not refused here. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

REASON = "AdmissionPolicyMissing"

HOST_NAMESPACES = ("hostNetwork", "hostPID", "hostIPC")
ORDINARY_VOLUMES = frozenset(
    {"configMap", "secret", "emptyDir", "downwardAPI", "projected", "persistentVolumeClaim", "ephemeral"}
)
"""Volume types that give a Pod nothing of its node (the policy checks the right to read what they name)."""
ORDINARY_CAPABILITIES = frozenset({"NET_BIND_SERVICE"})
ORDINARY_SERVICE_ACCOUNTS = frozenset({"", "default"})


UNCONFINED = "Unconfined"
APPARMOR_ANNOTATION = "container.apparmor.security.beta.kubernetes.io/"
SECCOMP_ANNOTATIONS = (
    "seccomp.security.alpha.kubernetes.io/pod",
    "container.seccomp.security.alpha.kubernetes.io/",
)


def requests(spec: Mapping[str, Any]) -> list[str]:
    """The fields of an ElasticJob's templates that ask for host access, privileges, an unconfined profile,
    another service account, a chosen node, a runtime class or a system priority, each as its path
    (``spec.template.spec.volumes[1].hostPath``); [] for none."""
    found = list(_pod("spec.template", spec.get("template")))
    master = spec.get("master")
    if isinstance(master, Mapping):
        found += _pod("spec.master.template", master.get("template"))
    return found


def refusal(found: list[str], *, policy: str) -> str:
    """The job's Failed message."""
    shown = ", ".join(found[:5]) + (f" and {len(found) - 5} more" if len(found) > 5 else "")
    return (
        f"the templates ask for {shown}, and the operator cannot find its admission policy {policy} (and its "
        "binding), which would check that the job's author may have that: refused. The cluster's "
        "administrator installs deploy/elasticjob-admission.yaml (or the chart's admission.policy)"
    )


def _pod(where: str, template: Any) -> Iterator[str]:
    if not isinstance(template, Mapping) or not isinstance(template.get("spec"), Mapping):
        return
    yield from _annotations(f"{where}.metadata.annotations", template.get("metadata"))
    pod = template["spec"]
    where = f"{where}.spec"
    for key in HOST_NAMESPACES:
        if pod.get(key) is True:
            yield f"{where}.{key}"
    for key in ("serviceAccountName", "serviceAccount"):
        if str(pod.get(key) or "") not in ORDINARY_SERVICE_ACCOUNTS:
            yield f"{where}.{key}"
    for key in ("nodeName", "runtimeClassName"):
        if pod.get(key):
            yield f"{where}.{key}"
    if str(pod.get("priorityClassName") or "").startswith("system-"):
        yield f"{where}.priorityClassName"
    yield from _unconfined(f"{where}.securityContext", pod.get("securityContext"))
    for i, volume in enumerate(_list(pod.get("volumes"))):
        for kind in sorted(set(volume) - {"name"} - ORDINARY_VOLUMES):
            yield f"{where}.volumes[{i}].{kind}"
    for group in ("initContainers", "containers", "ephemeralContainers"):
        for i, container in enumerate(_list(pod.get(group))):
            yield from _container(f"{where}.{group}[{i}]", container)


def _container(where: str, container: Mapping[str, Any]) -> Iterator[str]:
    security = container.get("securityContext")
    if isinstance(security, Mapping):
        if security.get("privileged") is True:
            yield f"{where}.securityContext.privileged"
        capabilities = security.get("capabilities")
        added = capabilities.get("add") if isinstance(capabilities, Mapping) else None
        if any(str(c) not in ORDINARY_CAPABILITIES for c in _plain_list(added)):
            yield f"{where}.securityContext.capabilities.add"
        yield from _unconfined(f"{where}.securityContext", security)
        windows = security.get("windowsOptions")
        if isinstance(windows, Mapping) and windows.get("hostProcess") is True:
            yield f"{where}.securityContext.windowsOptions.hostProcess"
    for j, port in enumerate(_list(container.get("ports"))):
        if port.get("hostPort"):
            yield f"{where}.ports[{j}].hostPort"


def _unconfined(where: str, security: Any) -> Iterator[str]:
    if not isinstance(security, Mapping):
        return
    for key in ("seccompProfile", "appArmorProfile"):
        profile = security.get(key)
        if isinstance(profile, Mapping) and profile.get("type") == UNCONFINED:
            yield f"{where}.{key}"


def _annotations(where: str, metadata: Any) -> Iterator[str]:
    annotations = metadata.get("annotations") if isinstance(metadata, Mapping) else None
    if not isinstance(annotations, Mapping):
        return
    for given_key, given_value in annotations.items():
        key, value = str(given_key), str(given_value)
        apparmor = key.startswith(APPARMOR_ANNOTATION) and not (
            value == "runtime/default" or value.startswith("localhost/")
        )
        seccomp = key.startswith(SECCOMP_ANNOTATIONS) and value == "unconfined"
        if apparmor or seccomp:
            yield f"{where}[{key}]"


def _list(value: Any) -> list[Mapping[str, Any]]:
    return [v for v in value if isinstance(v, Mapping)] if isinstance(value, list) else []


def _plain_list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, list) else []
