"""Deterministic names and labels of the objects that belong to an ElasticJob.

Worker Pods are ``<job>-worker-<slot>-<incarnation>``: the slot is the node's place in the job
(0..maxNodes-1), the incarnation counts its replacements. A restarted operator recomputes the same
names, so it never creates a second Pod for a slot.
"""

from __future__ import annotations

import re

JOB_LABEL = "phalanx.dev/job"
ROLE_LABEL = "phalanx.dev/role"
SLOT_LABEL = "phalanx.dev/slot"
INCARNATION_LABEL = "phalanx.dev/incarnation"
NODE_ID_LABEL = "phalanx.dev/node-id"
NODES_ANNOTATION = "phalanx.dev/nodes"
"""On the master Pod: the ``MIN:MAX`` it was started with; a spec change restarts the master."""
MANAGED_BY = "phalanx-operator"

_WORKER = re.compile(r"^(?P<job>.+)-worker-(?P<slot>\d+)-(?P<inc>\d+)$")


def master(job: str) -> str:
    """Name of the master Pod, its Service, ServiceAccount, Role and RoleBinding."""
    return f"{job}-master"


def secret(job: str) -> str:
    return f"{job}-token"


def tls_secret(job: str) -> str:
    """The master's certificate, its key and the CA certificate (operator setting tls_ca_secret)."""
    return f"{job}-tls"


def metrics_secret(job: str) -> str:
    """The master's metrics credential, mounted into the master Pod only (never into a worker)."""
    return f"{job}-metrics"


def network_policy(job: str) -> str:
    """The NetworkPolicy guarding the master's ports (operator setting network_policy)."""
    return f"{job}-master"


def state_config_map(job: str) -> str:
    return f"{job}-master-state"


def pod_group(job: str) -> str:
    """Name of the PodGroup that gang-schedules the worker Pods (``spec.gangScheduling``)."""
    return f"{job}-workers"


def worker(job: str, *, slot: int, incarnation: int) -> str:
    return f"{job}-worker-{slot}-{incarnation}"


def parse_worker(name: str) -> tuple[int, int] | None:
    """(slot, incarnation) of a worker Pod name, or None when it is not one."""
    match = _WORKER.match(name)
    return (int(match["slot"]), int(match["inc"])) if match else None


def labels(job: str, *, component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "phalanx",
        "app.kubernetes.io/instance": job,
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/managed-by": MANAGED_BY,
        JOB_LABEL: job,
        ROLE_LABEL: component,
    }


def selector(job: str, *, component: str) -> dict[str, str]:
    return {JOB_LABEL: job, ROLE_LABEL: component}


def label_selector(job: str, *, component: str) -> str:
    return ",".join(f"{k}={v}" for k, v in selector(job, component=component).items())
