"""The labels and annotations the operator puts on the objects of an ElasticJob.

The objects' names are the contract's (:mod:`phalanx.api.elasticjob`): the master and the CLI derive
them too.
"""

from __future__ import annotations

JOB_LABEL = "phalanx.dev/job"
ROLE_LABEL = "phalanx.dev/role"
SLOT_LABEL = "phalanx.dev/slot"
INCARNATION_LABEL = "phalanx.dev/incarnation"
NODE_ID_LABEL = "phalanx.dev/node-id"
NODES_ANNOTATION = "phalanx.dev/nodes"
"""On the master Pod: the ``MIN:MAX`` it was started with; a spec change restarts the master."""
MANAGED_BY = "phalanx-operator"


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
