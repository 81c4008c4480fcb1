"""The ``spec`` part of the ElasticJob's schema: one function per group of fields.

Bounds and the rules relating fields are admission's (:mod:`phalanx.operator.admission`); the building
blocks and the mapping onto the settings are :mod:`phalanx.operator.schema`'s.
"""

from __future__ import annotations

from typing import Any

from phalanx.api import settings as s
from phalanx.operator import pod_schema
from phalanx.operator.admission import (
    CLEAN_POD_POLICIES,
    DURATION_RE,
    MANAGED_BY,
    MAX_HANG_FACTOR,
    MAX_INTERVAL_STEPS,
    MAX_KEEP_LAST,
    MAX_NODES,
    MAX_PARALLEL_DEGREE,
    MAX_RESTART_BUDGET,
    nproc_rules,
    shared_memory_size_rules,
    spec_rules,
)
from phalanx.operator.gang import COSCHEDULING, DEFAULT_SCHEDULER_NAMES, KUBERNETES, SCHEDULERS
from phalanx.operator.resources import AUTO, GPU_RESOURCE, MIN_SHARED_MEMORY
from phalanx.operator.schema import (
    format_duration,
    int_prop,
    object_prop,
    optional_duration,
    quantity,
    setting_prop,
    string_map,
)


def _described(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {**schema, "description": description}


def _master_template() -> dict[str, Any]:
    """``spec.master.template``: a Pod template like the workers', of which the operator takes the fields a
    platform needs to place and admit the master. Anything else is refused (the schema has no place for
    it), since the master's command, image, ports and volumes are the operator's."""
    container = object_prop(
        "The master container: only its resources and securityContext are taken.",
        {
            "name": {"type": "string", "enum": ["master"]},
            "resources": object_prop(
                "Resources of the master container.",
                {
                    "requests": {"type": "object", "additionalProperties": quantity()},
                    "limits": {"type": "object", "additionalProperties": quantity()},
                },
            ),
            "securityContext": _described(
                pod_schema.field("containers", "items", "securityContext"),
                "Container securityContext; fields left out get the restricted Pod Security defaults.",
            ),
        },
    )
    return object_prop(
        "Pod template of the master Pod. Security fields left out get the defaults of the restricted Pod "
        "Security level (runAsNonRoot, seccompProfile RuntimeDefault, allowPrivilegeEscalation false, "
        "capabilities drop ALL); no runAsUser or fsGroup is fixed.",
        {
            "metadata": object_prop(
                "Labels and annotations added to the master Pod (the operator's own win).",
                {"labels": string_map(), "annotations": string_map()},
            ),
            "spec": object_prop(
                "The master Pod's scheduling, pull secrets and security.",
                {
                    "tolerations": _described(
                        pod_schema.field("tolerations"), "Tolerations of the master Pod."
                    ),
                    "nodeSelector": {**string_map(), "description": "Node selector of the master Pod."},
                    "affinity": _described(pod_schema.field("affinity"), "Affinity of the master Pod."),
                    "priorityClassName": {
                        "type": "string",
                        "description": "Priority class of the master Pod.",
                    },
                    "imagePullSecrets": {
                        "type": "array",
                        "description": "Secrets to pull the master image (the operator's image) with.",
                        "items": object_prop(
                            "A Secret in the job's namespace.",
                            {"name": {"type": "string"}},
                            required=["name"],
                        ),
                    },
                    "securityContext": _described(
                        pod_schema.field("securityContext"),
                        "Pod securityContext; fields left out get the restricted Pod Security defaults.",
                    ),
                    "containers": {
                        "type": "array",
                        "description": "At most one: the master container's resources and securityContext.",
                        "maxItems": 1,
                        "items": container,
                    },
                },
            ),
        },
    )


def _nodes() -> dict[str, Any]:
    return object_prop(
        "How many nodes (worker Pods, one agent each) the job runs.",
        {
            "min": setting_prop(("nodes", "min"), minimum=1, maximum=MAX_NODES),
            "max": setting_prop(("nodes", "max"), minimum=1, maximum=MAX_NODES),
            "unit": setting_prop(("nodes", "unit"), minimum=1, maximum=MAX_NODES),
            "lastCall": setting_prop(("nodes", "lastCall")),
            "minNodesTimeout": setting_prop(("nodes", "minNodesTimeout")),
        },
        required=["min", "max"],
        **{
            "x-kubernetes-validations": [
                {
                    "rule": "self.min <= self.max",
                    "message": "nodes.min must not be greater than nodes.max",
                },
                {
                    "rule": "self.max / self.unit * self.unit >= self.min",
                    "message": "no multiple of nodes.unit lies between nodes.min and nodes.max; "
                    "change one of them",
                },
            ]
        },
    )


def _parallelism() -> dict[str, Any]:
    return object_prop(
        "Model-parallel degrees, fixed for the life of the job; the data-parallel degree follows membership.",
        {
            "tensor": int_prop("Tensor-parallel degree.", default=1, minimum=1, maximum=MAX_PARALLEL_DEGREE),
            "pipeline": int_prop(
                "Pipeline-parallel degree.", default=1, minimum=1, maximum=MAX_PARALLEL_DEGREE
            ),
        },
        default={},
    )


def _restart() -> dict[str, Any]:
    return object_prop(
        "Restart and eviction budgets.",
        {
            "maxRestarts": setting_prop(("restart", "maxRestarts"), minimum=0, maximum=MAX_RESTART_BUDGET),
            "maxEvictions": setting_prop(("restart", "maxEvictions"), minimum=0, maximum=MAX_RESTART_BUDGET),
            "maxDisruptions": setting_prop(
                ("restart", "maxDisruptions"), minimum=0, maximum=MAX_RESTART_BUDGET
            ),
            "gracePeriod": setting_prop(("restart", "gracePeriod")),
        },
        default={},
    )


def _heartbeat() -> dict[str, Any]:
    return object_prop(
        "Node liveness.",
        {
            "interval": setting_prop(("heartbeat", "interval")),
            "timeout": setting_prop(("heartbeat", "timeout")),
        },
        default={},
        **{
            "x-kubernetes-validations": [
                {
                    "rule": "duration(self.timeout) >= duration('2s')",
                    "message": "heartbeat.timeout must be at least 2s",
                },
                {
                    "rule": "duration(self.timeout).getMilliseconds() >= "
                    "2 * duration(self.interval).getMilliseconds()",
                    "message": "heartbeat.timeout must be at least twice heartbeat.interval",
                },
                {
                    "rule": "duration(self.interval).getMilliseconds() > 0",
                    "message": "heartbeat.interval must be greater than 0",
                },
            ]
        },
    )


def _hang() -> dict[str, Any]:
    return object_prop(
        "Hang detection from progress beacons.",
        {
            "enabled": setting_prop(("hang", "enabled")),
            "instrument": setting_prop(("hang", "instrument")),
            "floor": setting_prop(("hang", "floor")),
            "idleFloor": setting_prop(("hang", "idleFloor")),
            "stopped": setting_prop(("hang", "stopped")),
            "factor": setting_prop(("hang", "factor"), minimum=1, maximum=MAX_HANG_FACTOR),
            "startup": setting_prop(("hang", "startup")),
        },
        default={},
    )


def _health() -> dict[str, Any]:
    return object_prop(
        "Health probes run on the nodes as training starts or resumes and during training; the master "
        "evicts and replaces the nodes that fail them or straggle behind their peers.",
        {
            "enabled": {
                "type": "boolean",
                "description": "Run a probe round right after every rendezvous round completes (as training "
                "starts or resumes), every interval during training, and on demand (POST /v1/probe).",
                "default": False,
            },
            "probes": {
                "type": "array",
                "description": "Probes every node runs: matmul (compute of each device), allgather "
                "(bandwidth between nodes; runs only with two or more nodes).",
                "items": {"type": "string", "enum": list(s.PROBE_KINDS)},
                "minItems": 1,
                "maxItems": len(s.PROBE_KINDS),
                "x-kubernetes-list-type": "set",
                "default": list(s.ProbeSettings().kind_names),
            },
            "interval": setting_prop(("healthChecks", "interval")),
            "timeout": setting_prop(("healthChecks", "timeout")),
            "confirmRounds": setting_prop(("healthChecks", "confirmRounds"), minimum=1, maximum=10),
            "evictSlowNodes": setting_prop(("healthChecks", "evictSlowNodes")),
        },
        default={},
        **{
            "x-kubernetes-validations": [
                {
                    "rule": "duration(self.timeout) > duration('0s')",
                    "message": "healthChecks.timeout must be greater than 0",
                },
            ]
        },
    )


def _checkpoint() -> dict[str, Any]:
    return object_prop(
        "Flash checkpoint: in-memory snapshots every few steps, persisted to storage in the background.",
        {
            "memoryIntervalSteps": setting_prop(
                ("checkpoint", "memoryIntervalSteps"), minimum=1, maximum=MAX_INTERVAL_STEPS
            ),
            "persistIntervalSteps": setting_prop(
                ("checkpoint", "persistIntervalSteps"), minimum=0, maximum=MAX_INTERVAL_STEPS
            ),
            "storagePath": setting_prop(("checkpoint", "storagePath"), maxLength=1024),
            "keepLast": setting_prop(("checkpoint", "keepLast"), minimum=1, maximum=MAX_KEEP_LAST),
        },
        default={},
    )


def _gang() -> dict[str, Any]:
    return object_prop(
        "All-or-nothing placement of the worker Pods: none of them is bound to a node until minNodes of "
        "them fit at once, so a job that cannot start holds no GPU while it waits. A job asking for it on a "
        "cluster without the scheduler's PodGroup API fails with reason GangSchedulingUnavailable.",
        {
            "enabled": {
                "type": "boolean",
                "description": "Gang-schedule the worker Pods (through a PodGroup <job>-workers that the "
                "operator creates and keeps). Fixed when the job is created.",
                "default": False,
            },
            "minNodes": int_prop(
                "Worker Pods that must fit at once before any is bound. Default: nodes.min (and it follows "
                "nodes.min when that changes). Replacements of lost nodes join the running gang one by one.",
                minimum=1,
                maximum=MAX_NODES,
            ),
            "scheduler": {
                "type": "string",
                "description": "Who places the gang. kubernetes: the in-tree PodGroup (scheduling.k8s.io/"
                "v1beta1, Kubernetes 1.37 or later with the GenericWorkload feature gate on in "
                "kube-apiserver and kube-scheduler). coscheduling: scheduler-plugins' Coscheduling plugin "
                "(its PodGroup scheduling.x-k8s.io/v1alpha1, its scheduler named by schedulerName). Fixed "
                "when the job is created.",
                "enum": list(SCHEDULERS),
                "default": KUBERNETES,
            },
            "schedulerName": {
                "type": "string",
                "description": "The worker Pods' schedulerName. Default: the template's for kubernetes, "
                f"{DEFAULT_SCHEDULER_NAMES[COSCHEDULING]} (scheduler-plugins' own) for coscheduling.",
                "maxLength": 253,
            },
        },
        default={},
    )


def _master() -> dict[str, Any]:
    return object_prop(
        "The job's master Pod (one per job: no GPU, about 100Mi of memory).",
        {
            "resources": object_prop(
                "Resources of the master container (or in template.spec.containers[0].resources).",
                {
                    "requests": {"type": "object", "additionalProperties": quantity()},
                    "limits": {"type": "object", "additionalProperties": quantity()},
                },
            ),
            "template": _master_template(),
            "statusProgressInterval": setting_prop(("master", "statusProgressInterval")),
        },
        default={},
        **{
            "x-kubernetes-validations": [
                {
                    "rule": "!has(self.resources) || !has(self.template) || !has(self.template.spec) || "
                    "!has(self.template.spec.containers) || size(self.template.spec.containers) == 0 || "
                    "!has(self.template.spec.containers[0].resources)",
                    "message": "give the master's resources in master.resources or in "
                    "master.template.spec.containers[0].resources, not both",
                }
            ]
        },
    )


def _shared_memory() -> dict[str, Any]:
    return object_prop(
        "A memory-backed emptyDir mounted at /dev/shm in the worker containers. A container runtime gives a "
        "container 64Mi of /dev/shm, and the flash checkpoint keeps two slots of every rank's state there "
        "(each allocated 1.1x the state), beside NCCL's shared-memory transport and DataLoader workers. Its "
        "pages count against the memory limit of the container that writes them.",
        {
            "enabled": setting_prop(("sharedMemory", "enabled")),
            "sizeLimit": {
                **quantity(),
                "description": "Size of /dev/shm, a quantity such as 16Gi; at least "
                f"{MIN_SHARED_MEMORY}. Default: "
                f"{s.JobPodSettings().shared_memory_per_process_mib // 1024}Gi per process (nprocPerNode), "
                "never more than the first container's memory limit. Size it as nprocPerNode x 2 x 1.1 x the "
                "checkpointed state of one rank, plus room for NCCL and DataLoader workers. A save that "
                "does not fit fails the job with reason SharedMemoryExhausted.",
                "x-kubernetes-validations": shared_memory_size_rules(),
            },
        },
        default={},
    )


def _termination_grace() -> dict[str, Any]:
    grace = s.JobPodSettings().persist_on_exit_s
    termination_grace = optional_duration(
        path=("terminationGracePeriod",),
        doc="terminationGracePeriodSeconds of the worker Pods: a deleted, evicted or suspended worker's "
        "agent stops its workers (up to restart.gracePeriod), then persists the newest in-memory snapshot to "
        "storage before it exits. Must be longer than restart.gracePeriod. Default: restart.gracePeriod "
        f"+ {format_duration(grace)} (the agent waits up to 2m for that write, and 10s more for its "
        "checkpoint host to stop). A template's own terminationGracePeriodSeconds wins.",
    )
    return termination_grace


def _refused() -> dict[str, Any]:
    refused = setting_prop(("createRefusedTimeout",))
    refused["description"] += (
        " The job's ReplicaFailure condition carries the API server's own message meanwhile; then the job "
        "fails with reason FailedCreate. Errors the API server may recover from (timeouts, 5xx, 429) never "
        "count."
    )
    refused["x-kubernetes-validations"].append(
        {
            "rule": f"!self.matches('{DURATION_RE}') || duration(self) > duration('0s')",
            "message": "createRefusedTimeout must be greater than 0",
        }
    )
    return refused


def _nproc() -> dict[str, Any]:
    nproc = setting_prop(("nprocPerNode",))
    for key in ("type", "format"):
        nproc.pop(key)
    nproc.update(quantity())
    nproc["description"] += (
        f" Or {AUTO}: the first container's {GPU_RESOURCE} limit, 1 without one. A number above that limit "
        "is refused: every process needs a GPU of its own."
    )
    nproc["x-kubernetes-validations"] = nproc_rules()
    return nproc


def spec_schema() -> dict[str, Any]:
    """``spec`` of an ElasticJob: one group of fields per function above, the run policy inline."""
    return object_prop(
        "Desired state of an elastic training job.",
        {
            "nodes": _nodes(),
            "nprocPerNode": _nproc(),
            "parallelism": _parallelism(),
            "restart": _restart(),
            "heartbeat": _heartbeat(),
            "hang": _hang(),
            "healthChecks": _health(),
            "checkpoint": _checkpoint(),
            "template": pod_schema.worker_template(),
            "master": _master(),
            "sharedMemory": _shared_memory(),
            "terminationGracePeriod": _termination_grace(),
            "createRefusedTimeout": _refused(),
            "gangScheduling": _gang(),
            "cordonBadNodes": {
                "type": "boolean",
                "description": "Cordon and taint the Kubernetes node of an evicted worker (the node its Pod "
                "ran on, as the operator saw it), so nothing else lands on a bad machine. Only where the "
                "operator's administrator allows it (its cordon_nodes setting, Helm operator.cordonNodes; "
                "off by default): otherwise a NodeNotCordoned Event says so, and the job's own replacements "
                "still avoid that node.",
                "default": False,
            },
            "cleanPodPolicy": {
                "type": "string",
                "description": "Which Pods to delete when the job finished: None, Running (those still "
                "running) or All.",
                "enum": list(CLEAN_POD_POLICIES),
                "default": "Running",
            },
            "managedBy": {
                "type": "string",
                "description": "The controller that reconciles this job, like a batch/v1 Job's or a JobSet's "
                f"spec.managedBy. Absent or {MANAGED_BY!r}: the phalanx operator; "
                "'kueue.x-k8s.io/multikueue' (with the kueue.x-k8s.io/queue-name label): Kueue's MultiKueue "
                "runs the job in a worker cluster, this cluster's operator only queues it and shows the "
                "worker's status; anything else: the phalanx operator leaves the job alone. Set at "
                "creation; cannot be changed.",
                "maxLength": 63,
            },
            "suspend": {
                "type": "boolean",
                "description": "Pause the job and free its worker nodes. Once the master acknowledged (it "
                "then forgets departing nodes instead of evicting them), the worker Pods are deleted "
                "gracefully, each persisting its newest in-memory checkpoint before it exits; the master "
                "Pod stays and keeps the job's state. Setting it back to false creates new worker Pods, "
                "which resume from the last committed checkpoint. Suspended time counts against no budget "
                "or timeout. Ignored once the job finished.",
                "default": False,
            },
            "activeDeadline": optional_duration(
                path=("activeDeadline",),
                doc="How long the job may be active before the operator fails it (reason DeadlineExceeded; "
                "its Pods are then cleaned up per cleanPodPolicy), like a batch/v1 Job's "
                "activeDeadlineSeconds. Counted from status.startTime: the job's start, and again from "
                "each resume after a suspension; a suspended job is never failed by it. Raising it on a "
                "running job before it expires extends the deadline. Absent or empty: no deadline.",
                positive=True,
            ),
            "ttlAfterFinished": optional_duration(
                path=("ttlAfterFinished",),
                doc="How long the job is kept once it Succeeded or Failed; then the operator deletes it, and "
                "its Pods, Secret, ConfigMap and master RBAC with it (they are owned by the job), like a "
                "batch/v1 Job's ttlSecondsAfterFinished. 0s: as soon as it finished. Absent or empty: kept "
                "until deleted by hand.",
            ),
        },
        required=["nodes", "template"],
        **{"x-kubernetes-validations": spec_rules()},
    )
