"""Security defaults of the job's Pods: what the Pod Security ``restricted`` level asks, filled in where the
user's template says nothing, so that a namespace enforcing that level accepts the master and the workers.

The level (Kubernetes' Pod Security Standards) wants ``runAsNonRoot``,
``allowPrivilegeEscalation: false``, ``capabilities.drop: [ALL]`` and a ``RuntimeDefault`` (or Localhost)
seccomp profile. Nothing here fixes a ``runAsUser`` or an ``fsGroup``: OpenShift's restricted policy assigns
both from the namespace's range and refuses a Pod that names others. The project's images run as uid 10001
(their ``USER``), which ``runAsNonRoot`` accepts as it stands; a training image that runs as root needs
``runAsUser`` in its template (or ``runAsNonRoot: false`` where the namespace allows it).

A value the template sets is kept, also where it breaks the level: the namespace then refuses the Pod,
and the job says so (the ``ReplicaFailure`` condition carries the API server's message).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

Obj = dict[str, Any]

_ROOT_CAPS = ("SYS_ADMIN", "CAP_SYS_ADMIN")
"""Added capabilities the API server refuses beside ``allowPrivilegeEscalation: false``."""


def container_defaults(container: Obj) -> None:
    """Fills the restricted level's container fields the container does not set. A privileged container,
    or one adding CAP_SYS_ADMIN, keeps privilege escalation: the API server refuses the combination."""
    sc = container.setdefault("securityContext", {})
    caps = sc.setdefault("capabilities", {})
    caps.setdefault("drop", ["ALL"])
    escalates = sc.get("privileged") is True or any(c in _ROOT_CAPS for c in caps.get("add") or [])
    if not escalates:
        sc.setdefault("allowPrivilegeEscalation", False)


def _runs_as_root(pod_spec: Mapping[str, Any]) -> bool:
    """Whether the template asks for uid 0 somewhere: ``runAsNonRoot: true`` would stop that container."""
    contexts = [pod_spec.get("securityContext") or {}]
    for key in ("initContainers", "containers"):
        contexts += [c.get("securityContext") or {} for c in pod_spec.get(key) or []]
    return any(sc.get("runAsUser") == 0 for sc in contexts)


def pod_defaults(pod_spec: Obj) -> None:
    """Fills the restricted level's Pod and container fields the Pod spec does not set (in place)."""
    sc = pod_spec.setdefault("securityContext", {})
    if not _runs_as_root(pod_spec):
        sc.setdefault("runAsNonRoot", True)
    if (pod_spec.get("os") or {}).get("name") != "windows":  # the level exempts Windows Pods from seccomp
        sc.setdefault("seccompProfile", {"type": "RuntimeDefault"})
    for key in ("initContainers", "containers"):
        for container in pod_spec.get(key) or []:
            container_defaults(container)
