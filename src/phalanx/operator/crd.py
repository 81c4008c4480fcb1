"""The ElasticJob CustomResourceDefinition, built from one source of truth.

:func:`build_crd` returns the CRD as a plain dict; ``scripts/gen-crd`` writes it to
``crds/elasticjobs.phalanx.dev.yaml`` and ``--check`` fails when the file drifted. The resource's identity
and the status keys are the contract's (:mod:`phalanx.api.elasticjob`); the spec's schema is
:mod:`phalanx.operator.crd_spec`'s, its bounds and CEL rules :mod:`phalanx.operator.admission`'s, the
building blocks (and the mapping of spec fields onto settings) :mod:`phalanx.operator.schema`'s.
"""

from __future__ import annotations

from typing import Any

from phalanx.api import elasticjob as ej
from phalanx.api.elasticjob import CATEGORIES, CRD_NAME, GROUP, KIND, PLURAL, SHORT_NAMES, SINGULAR, VERSION
from phalanx.operator.admission import job_name_rules
from phalanx.operator.conditions import CONDITION_TYPES
from phalanx.operator.crd_spec import spec_schema
from phalanx.operator.schema import int_prop, object_prop

PHASES = tuple(phase.value for phase in ej.Phase)


def _condition_schema() -> dict[str, Any]:
    return object_prop(
        "One aspect of the job's state.",
        {
            "type": {"type": "string", "enum": list(CONDITION_TYPES)},
            "status": {"type": "string", "enum": ["True", "False", "Unknown"]},
            "reason": {"type": "string", "maxLength": 1024},
            "message": {"type": "string", "maxLength": 32768},
            "lastTransitionTime": {"type": "string", "format": "date-time"},
            "observedGeneration": {"type": "integer", "format": "int64", "minimum": 0},
        },
        required=["type", "status"],
    )


def _eviction_schema() -> dict[str, Any]:
    return object_prop(
        "A node the master asked to evict and replace.",
        {
            ej.EVICTION_NODE_ID: {"type": "string", "description": "Node id (the worker Pod's name)."},
            ej.EVICTION_MACHINE: {"type": "string", "description": "Kubernetes node the worker ran on."},
            ej.EVICTION_REASON: {"type": "string"},
            ej.EVICTION_REQUESTED_AT: {"type": "string", "description": "When the master asked (RFC 3339)."},
        },
        required=[ej.EVICTION_NODE_ID],
    )


def _master_schema() -> dict[str, Any]:
    return object_prop(
        "The job as its master last reported it.",
        {
            ej.MASTER_PHASE: {"type": "string"},
            ej.MASTER_REASON: {"type": "string", "maxLength": 32768},
            ej.MASTER_MEMBERS: {"type": "array", "items": {"type": "string"}},
            ej.MASTER_OBSERVED_GENERATION: {
                "type": "integer",
                "format": "int64",
                "description": "The generation of the spec the master follows (spec.suspend); its "
                "Suspended phase acknowledges a suspension only at the job's current generation.",
            },
            ej.MASTER_UPDATED_AT: {"type": "string"},
        },
    )


def _status_schema() -> dict[str, Any]:
    """``status``: the fields of :data:`phalanx.api.elasticjob.MASTER_STATUS_FIELDS` are the master's, the
    others the operator's."""
    return object_prop(
        "Observed state of the job, written by the operator and the job's master.",
        {
            "phase": {"type": "string", "enum": list(PHASES)},
            "conditions": {
                "type": "array",
                "items": _condition_schema(),
                "x-kubernetes-list-type": "map",
                "x-kubernetes-list-map-keys": ["type"],
            },
            "observedGeneration": {"type": "integer", "format": "int64"},
            "startTime": {
                "type": "string",
                "format": "date-time",
                "description": "When the job started, or was last resumed after a suspension: the start "
                "of spec.activeDeadline.",
            },
            "suspendingSince": {
                "type": "string",
                "format": "date-time",
                "description": "When the operator began waiting for the master to acknowledge a suspension; "
                "the worker Pods go without it once the operator's suspend_ack_timeout_s has passed.",
            },
            "stuckSince": {
                "type": "string",
                "format": "date-time",
                "description": "Since when a Pod that cannot start (a missing image or Secret) has held the "
                "job back; the job fails with that cause once the operator's stuck_pod_timeout_s has passed.",
            },
            "nodes": int_prop("Worker Pods running."),
            "selector": {
                "type": "string",
                "description": "Label selector of the worker Pods (scale subresource, autoscalers).",
            },
            ej.STATUS_WORLD_SIZE: int_prop("Training processes in the current rendezvous round."),
            ej.STATUS_ROUND: {
                "type": "integer",
                "format": "int64",
                "description": "Current rendezvous round.",
            },
            ej.STATUS_STEP: {
                "type": "integer",
                "format": "int64",
                "description": "Newest step reported by any rank.",
            },
            ej.STATUS_COMMITTED_STEP: {
                "type": "integer",
                "format": "int64",
                "description": "Newest checkpoint step committed to storage by every shard.",
            },
            ej.STATUS_RESTART_COUNT: int_prop("Worker restarts the master counted."),
            ej.STATUS_EVICTIONS: {
                "type": "array",
                "items": _eviction_schema(),
                "description": "Evictions requested by the master.",
            },
            "replacements": int_prop(
                "Worker Pods the operator replaced (failed, lost or evicted by the master); "
                "restart.maxEvictions bounds them."
            ),
            "disruptions": int_prop(
                "Worker Pods the cluster ended (preemption, drain, node pressure) and the operator replaced; "
                "restart.maxDisruptions bounds them."
            ),
            "refusedPods": {
                "type": "array",
                "items": {"type": "string"},
                "description": "Pods the API server refused to create (see the ReplicaFailure condition); "
                "they are asked for again under the same names, and count as no replacement.",
            },
            "excludedMachines": {
                "type": "array",
                "items": {"type": "string"},
                "description": "Kubernetes nodes evicted workers ran on; replacements are kept off them.",
            },
            "workerIncarnations": {
                "type": "array",
                "items": {"type": "integer", "format": "int32"},
                "description": "Newest Pod incarnation per worker slot.",
            },
            "masterEndpoint": {"type": "string", "description": "host:port of the master's gRPC service."},
            ej.STATUS_MASTER: _master_schema(),
        },
    )


def build_crd() -> dict[str, Any]:
    """The CustomResourceDefinition of ElasticJob as a plain dict (JSON/YAML ready)."""
    schema = object_prop(
        "An elastic PyTorch training job kept alive through failures by phalanx.",
        {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": spec_schema(),
            "status": _status_schema(),
        },
        required=["spec"],
        **{"x-kubernetes-validations": job_name_rules()},
    )
    columns = [
        {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
        {"name": "Nodes", "type": "integer", "jsonPath": ".status.nodes"},
        {"name": "World", "type": "integer", "jsonPath": ".status.worldSize"},
        {"name": "Step", "type": "integer", "jsonPath": ".status.step"},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
        # The desired state, shown with -o wide: while suspending, PHASE still reads Running.
        {"name": "Suspend", "type": "boolean", "jsonPath": ".spec.suspend", "priority": 1},
    ]
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": CRD_NAME},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": KIND,
                "plural": PLURAL,
                "singular": SINGULAR,
                "shortNames": list(SHORT_NAMES),
                "categories": list(CATEGORIES),
                "listKind": f"{KIND}List",
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    # `kubectl scale ej NAME --replicas N` (and a HorizontalPodAutoscaler) sets nodes.max: the
                    # number of worker Pods; the CEL rules still hold (a scale below nodes.min is refused).
                    "subresources": {
                        "status": {},
                        "scale": {
                            "specReplicasPath": ".spec.nodes.max",
                            "statusReplicasPath": ".status.nodes",
                            "labelSelectorPath": ".status.selector",
                        },
                    },
                    "additionalPrinterColumns": columns,
                    "schema": {"openAPIV3Schema": schema},
                }
            ],
        },
    }


def render_crd_yaml() -> str:
    """The CRD as the YAML text committed under ``crds/``."""
    import yaml

    header = "# Generated by scripts/gen-crd from src/phalanx/operator/crd.py. Do not edit.\n"
    return header + yaml.safe_dump(build_crd(), sort_keys=False, width=110)
