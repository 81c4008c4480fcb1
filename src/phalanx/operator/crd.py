"""The ElasticJob CustomResourceDefinition, built from one source of truth.

:func:`build_crd` returns the CRD as a plain dict; ``scripts/gen-crd`` writes it to
``crds/elasticjobs.phalanx.dev.yaml`` and ``--check`` fails when the file drifted. Spec fields that map
onto a :mod:`phalanx.api.settings` field take their description and default from that field
(:data:`SETTINGS_FIELDS`), so ``--help``, environment variables and the CRD never disagree.

Validation a person can act on happens at admission, in the API server: OpenAPI bounds and enums for
single fields, CEL rules (``x-kubernetes-validations``) with a ``message`` for everything that relates
two fields (min/max nodes, parallelism against processes per node, duration syntax, timeouts).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from phalanx.api import settings as s
from phalanx.operator.resources import AUTO, GPU_RESOURCE, MIN_SHARED_MEMORY

GROUP = "phalanx.dev"
VERSION = "v1alpha1"
KIND = "ElasticJob"
PLURAL = "elasticjobs"
SINGULAR = "elasticjob"
SHORT_NAMES = ["ej"]
CRD_NAME = f"{PLURAL}.{GROUP}"
API_VERSION = f"{GROUP}/{VERSION}"

MAX_JOB_NAME = 40
"""Longest job name: worker Pod names append ``-worker-<slot>-<incarnation>`` and must stay DNS labels."""

# --- Bounds of every count, size and duration of the spec -----------------------------------------------
# Admission refuses a value above these (OpenAPI ``maximum``, CEL for durations and quantities), and
# :func:`phalanx.operator.spec.parse_spec` checks them again for an object that slipped past an older CRD:
# the operator's memory and API calls grow with them (a pass walks every worker slot), so one job asking
# for 2**31 nodes must fail alone, never take the operator down with it.
MAX_NODES = 5000
"""nodes.min, nodes.max, nodes.unit and gangScheduling.minNodes: Kubernetes' own tested limit is 5000 nodes
per cluster, and a job has one worker Pod per node."""
MAX_NPROC_PER_NODE = 128
"""nprocPerNode: processes (ranks) per worker Pod; the largest machines have 8 to 16 accelerators, CPU
training rarely runs more than one process per core pair."""
MAX_PARALLEL_DEGREE = 4096
"""parallelism.tensor and parallelism.pipeline (each divides nprocPerNode x nodes.unit anyway)."""
MAX_RESTART_BUDGET = 10000
"""restart.maxRestarts and restart.maxEvictions."""
MAX_INTERVAL_STEPS = 1_000_000_000
"""checkpoint.memoryIntervalSteps and checkpoint.persistIntervalSteps."""
MAX_KEEP_LAST = 1000
"""checkpoint.keepLast: committed steps kept on storage."""
MAX_HANG_FACTOR = 1000
"""hang.factor."""
MAX_SHARED_MEMORY = "4Ti"
"""sharedMemory.sizeLimit: more than the memory of the largest machines sold today."""
MAX_DURATIONS: dict[tuple[str, ...], str] = {
    ("nodes", "lastCall"): "1h",
    ("nodes", "minNodesTimeout"): "168h",
    ("heartbeat", "interval"): "1m",
    ("heartbeat", "timeout"): "1h",
    ("hang", "floor"): "24h",
    ("hang", "idleFloor"): "24h",
    ("hang", "startup"): "24h",
    ("restart", "gracePeriod"): "1h",
    ("healthChecks", "interval"): "24h",
    ("healthChecks", "timeout"): "1h",
    ("terminationGracePeriod",): "2h",
    ("createRefusedTimeout",): "24h",
    ("master", "statusProgressInterval"): "1h",
    ("activeDeadline",): "8760h",
    ("ttlAfterFinished",): "8760h",
}
"""Longest value of every duration of the spec (8760h: a year)."""

CONDITION_TYPES = (
    "Created", "MasterReady", "GangScheduled", "ReplicaFailure", "Running", "Restarting", "Suspended",
    "Succeeded", "Failed", "ReconcileError",
)  # fmt: skip
PHASES = ("Pending", "Created", "Running", "Restarting", "Suspended", "Succeeded", "Failed")
CLEAN_POD_POLICIES = ("None", "Running", "All")
MANAGED_BY = "phalanx.dev/operator"
"""``spec.managedBy`` of the jobs this operator reconciles (or none)."""

# Go-style durations: the form CEL's duration() parses and people write in YAML.
DURATION_RE = r"^([0-9]+([.][0-9]+)?(ms|s|m|h))+$"  # no backslashes: CEL string literals

SETTINGS_FIELDS: dict[tuple[str, ...], tuple[type, str]] = {
    ("nodes", "min"): (s.RendezvousSettings, "min_nodes"),
    ("nodes", "max"): (s.RendezvousSettings, "max_nodes"),
    ("nodes", "unit"): (s.RendezvousSettings, "unit"),
    ("nodes", "lastCall"): (s.RendezvousSettings, "last_call_s"),
    ("nodes", "minNodesTimeout"): (s.RendezvousSettings, "min_nodes_timeout_s"),
    ("nprocPerNode",): (s.AgentSettings, "nproc_per_node"),
    ("restart", "maxRestarts"): (s.RestartSettings, "max_restarts"),
    ("restart", "maxEvictions"): (s.RestartSettings, "max_evictions"),
    ("restart", "gracePeriod"): (s.RestartSettings, "grace_period_s"),
    ("heartbeat", "interval"): (s.HeartbeatSettings, "interval_s"),
    ("heartbeat", "timeout"): (s.HeartbeatSettings, "timeout_s"),
    ("hang", "enabled"): (s.HangSettings, "enabled"),
    ("hang", "floor"): (s.HangSettings, "floor_s"),
    ("hang", "idleFloor"): (s.HangSettings, "idle_floor_s"),
    ("hang", "factor"): (s.HangSettings, "factor"),
    ("hang", "startup"): (s.HangSettings, "startup_s"),
    ("checkpoint", "memoryIntervalSteps"): (s.CheckpointSettings, "memory_interval_steps"),
    ("checkpoint", "persistIntervalSteps"): (s.CheckpointSettings, "persist_interval_steps"),
    ("checkpoint", "storagePath"): (s.CheckpointSettings, "storage_path"),
    ("checkpoint", "keepLast"): (s.CheckpointSettings, "keep_last"),
    ("healthChecks", "interval"): (s.ProbeSettings, "interval_s"),
    ("healthChecks", "timeout"): (s.ProbeSettings, "timeout_s"),
    ("healthChecks", "confirmRounds"): (s.StragglerSettings, "confirm_rounds"),
    ("healthChecks", "evictSlowNodes"): (s.StragglerSettings, "evict_slow_nodes"),
    ("sharedMemory", "enabled"): (s.JobPodSettings, "shared_memory"),
    ("createRefusedTimeout",): (s.JobPodSettings, "create_refused_timeout_s"),
    ("master", "statusProgressInterval"): (s.MasterSettings, "status_progress_interval_s"),
}
"""CRD spec path -> (settings class, field). The single mapping between the spec and the settings."""


_C0 = "self.template.spec.containers[0]"
_C0_LIMITS = f"{_C0}.resources.limits"
_HAS_C0_LIMITS = f"has({_C0}.resources) && has({_C0_LIMITS})"


def _quantity() -> dict[str, Any]:
    """A Kubernetes quantity (``8``, ``"16Gi"``), a new dict each time (the YAML then has no aliases)."""
    return {"x-kubernetes-int-or-string": True, "anyOf": [{"type": "integer"}, {"type": "string"}]}


def _field(cls: type, name: str) -> dataclasses.Field[Any]:
    for f in dataclasses.fields(cls):
        if f.name == name:
            return f
    raise KeyError(f"{cls.__name__} has no field {name}")


def format_duration(seconds: float) -> str:
    """Formats seconds in the Go duration form the CRD uses (``"10s"``, ``"500ms"``, ``"10m"``)."""
    if seconds and seconds < 1:
        return f"{round(seconds * 1000)}ms"
    if seconds >= 60 and seconds % 60 == 0:
        minutes = int(seconds // 60)
        return f"{minutes // 60}h" if minutes % 60 == 0 else f"{minutes}m"
    return f"{seconds:g}s"


def _setting_prop(path: tuple[str, ...], **extra: Any) -> dict[str, Any]:
    """A schema property for a spec field that maps onto a settings field."""
    cls, name = SETTINGS_FIELDS[path]
    f = _field(cls, name)
    doc = str(f.metadata.get("doc", ""))
    prop: dict[str, Any]
    if name.endswith("_s"):
        prop = _duration(doc, path=path)
        prop["default"] = format_duration(float(f.default))  # type: ignore[arg-type]
    elif isinstance(f.default, bool):
        prop = {"type": "boolean", "description": doc, "default": f.default}
    elif isinstance(f.default, int):
        prop = {"type": "integer", "format": "int32", "description": doc, "default": f.default}
    elif isinstance(f.default, float):
        prop = {"type": "number", "description": doc, "default": f.default}
    else:
        prop = {"type": "string", "description": doc, "default": f.default}
    unit = f.metadata.get("unit")
    if unit and unit != "s":
        prop["description"] += f" Unit: {unit}."
    prop.update(extra)
    return prop


def _duration(doc: str, *, path: tuple[str, ...]) -> dict[str, Any]:
    limit = MAX_DURATIONS[path]
    return {
        "type": "string",
        "description": f"{doc} A duration such as 500ms, 30s, 2m or 1h; at most {limit}.",
        "maxLength": 32,
        "x-kubernetes-validations": [
            {
                "rule": f"self.matches('{DURATION_RE}')",
                "message": "must be a duration such as 500ms, 30s, 2m or 1h",
            },
            _duration_limit(path, empty_ok=False),
        ],
    }


def _duration_limit(path: tuple[str, ...], *, empty_ok: bool) -> dict[str, str]:
    """The CEL rule bounding a duration; a value that is no duration passes it (the syntax rule speaks)."""
    limit = MAX_DURATIONS[path]
    empty = "self == '' || " if empty_ok else ""
    return {
        "rule": f"{empty}!self.matches('{DURATION_RE}') || duration(self) <= duration('{limit}')",
        "message": f"{'.'.join(path)} must be at most {limit}",
    }


def _optional_duration(doc: str, *, path: tuple[str, ...], positive: bool = False) -> dict[str, Any]:
    """A run-policy duration without a default: absent or "" means not set. The syntax rule is the one of
    every duration; the rule for > 0 passes a value that is no duration (CEL's ``||`` is true when either
    side is, even if the other errs), so such a value gets the syntax message only."""
    prop = _duration(doc, path=path)
    prop["x-kubernetes-validations"] = [
        {
            "rule": f"self == '' || self.matches('{DURATION_RE}')",
            "message": "must be a duration such as 500ms, 30s, 2m or 1h",
        },
        _duration_limit(path, empty_ok=True),
    ]
    if positive:
        prop["x-kubernetes-validations"].append(
            {
                "rule": f"self == '' || !self.matches('{DURATION_RE}') || duration(self) > duration('0s')",
                "message": "must be greater than 0; leave it out for no deadline",
            }
        )
    return prop


def _obj(description: str, properties: dict[str, Any], **extra: Any) -> dict[str, Any]:
    obj = {"type": "object", "description": description, "properties": properties, **extra}
    if obj.get("default") == {}:
        # The API server validates a default as given (nested defaults are not applied to it), so an
        # omitted group defaults to the full set of its fields' defaults.
        obj["default"] = {k: v["default"] for k, v in properties.items() if "default" in v}
    return obj


def _int(
    description: str, *, default: int | None = None, minimum: int | None = None, maximum: int | None = None
) -> dict[str, Any]:
    prop: dict[str, Any] = {"type": "integer", "format": "int32", "description": description}
    if default is not None:
        prop["default"] = default
    if minimum is not None:
        prop["minimum"] = minimum
    if maximum is not None:
        prop["maximum"] = maximum
    return prop


def _kept(description: str, kind: str = "object") -> dict[str, Any]:
    """A Kubernetes type kept as given (the API server validates it when the Pod is created)."""
    if kind == "array":
        items = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
        return {"type": "array", "description": description, "items": items}
    return {"type": "object", "description": description, "x-kubernetes-preserve-unknown-fields": True}


def _strings() -> dict[str, Any]:
    return {"type": "object", "additionalProperties": {"type": "string"}}


def _master_template() -> dict[str, Any]:
    """``spec.master.template``: a Pod template like the workers', of which the operator takes the fields a
    platform needs to place and admit the master. Anything else is refused (the schema has no place for
    it), since the master's command, image, ports and volumes are the operator's."""
    container = _obj(
        "The master container: only its resources and securityContext are taken.",
        {
            "name": {"type": "string", "enum": ["master"]},
            "resources": _obj(
                "Resources of the master container.",
                {
                    "requests": {"type": "object", "additionalProperties": _quantity()},
                    "limits": {"type": "object", "additionalProperties": _quantity()},
                },
            ),
            "securityContext": _kept(
                "Container securityContext; fields left out get the restricted Pod Security defaults."
            ),
        },
    )
    return _obj(
        "Pod template of the master Pod. Security fields left out get the defaults of the restricted Pod "
        "Security level (runAsNonRoot, seccompProfile RuntimeDefault, allowPrivilegeEscalation false, "
        "capabilities drop ALL); no runAsUser or fsGroup is fixed.",
        {
            "metadata": _obj(
                "Labels and annotations added to the master Pod (the operator's own win).",
                {"labels": _strings(), "annotations": _strings()},
            ),
            "spec": _obj(
                "The master Pod's scheduling, pull secrets and security.",
                {
                    "tolerations": _kept("Tolerations of the master Pod.", "array"),
                    "nodeSelector": {**_strings(), "description": "Node selector of the master Pod."},
                    "affinity": _kept("Affinity of the master Pod."),
                    "priorityClassName": {
                        "type": "string",
                        "description": "Priority class of the master Pod.",
                    },
                    "imagePullSecrets": {
                        "type": "array",
                        "description": "Secrets to pull the master image (the operator's image) with.",
                        "items": _obj(
                            "A Secret in the job's namespace.",
                            {"name": {"type": "string"}},
                            required=["name"],
                        ),
                    },
                    "securityContext": _kept(
                        "Pod securityContext; fields left out get the restricted Pod Security defaults."
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


def _spec_schema() -> dict[str, Any]:
    nodes = _obj(
        "How many nodes (worker Pods, one agent each) the job runs.",
        {
            "min": _setting_prop(("nodes", "min"), minimum=1, maximum=MAX_NODES),
            "max": _setting_prop(("nodes", "max"), minimum=1, maximum=MAX_NODES),
            "unit": _setting_prop(("nodes", "unit"), minimum=1, maximum=MAX_NODES),
            "lastCall": _setting_prop(("nodes", "lastCall")),
            "minNodesTimeout": _setting_prop(("nodes", "minNodesTimeout")),
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
    parallelism = _obj(
        "Model-parallel degrees, fixed for the life of the job; the data-parallel degree follows membership.",
        {
            "tensor": _int("Tensor-parallel degree.", default=1, minimum=1, maximum=MAX_PARALLEL_DEGREE),
            "pipeline": _int("Pipeline-parallel degree.", default=1, minimum=1, maximum=MAX_PARALLEL_DEGREE),
        },
        default={},
    )
    restart = _obj(
        "Restart and eviction budgets.",
        {
            "maxRestarts": _setting_prop(("restart", "maxRestarts"), minimum=0, maximum=MAX_RESTART_BUDGET),
            "maxEvictions": _setting_prop(("restart", "maxEvictions"), minimum=0, maximum=MAX_RESTART_BUDGET),
            "gracePeriod": _setting_prop(("restart", "gracePeriod")),
        },
        default={},
    )
    heartbeat = _obj(
        "Node liveness.",
        {
            "interval": _setting_prop(("heartbeat", "interval")),
            "timeout": _setting_prop(("heartbeat", "timeout")),
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
    hang = _obj(
        "Hang detection from progress beacons.",
        {
            "enabled": _setting_prop(("hang", "enabled")),
            "floor": _setting_prop(("hang", "floor")),
            "idleFloor": _setting_prop(("hang", "idleFloor")),
            "factor": _setting_prop(("hang", "factor"), minimum=1, maximum=MAX_HANG_FACTOR),
            "startup": _setting_prop(("hang", "startup")),
        },
        default={},
    )
    health = _obj(
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
            "interval": _setting_prop(("healthChecks", "interval")),
            "timeout": _setting_prop(("healthChecks", "timeout")),
            "confirmRounds": _setting_prop(("healthChecks", "confirmRounds"), minimum=1, maximum=10),
            "evictSlowNodes": _setting_prop(("healthChecks", "evictSlowNodes")),
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
    checkpoint = _obj(
        "Flash checkpoint: in-memory snapshots every few steps, persisted to storage in the background.",
        {
            "memoryIntervalSteps": _setting_prop(
                ("checkpoint", "memoryIntervalSteps"), minimum=1, maximum=MAX_INTERVAL_STEPS
            ),
            "persistIntervalSteps": _setting_prop(
                ("checkpoint", "persistIntervalSteps"), minimum=0, maximum=MAX_INTERVAL_STEPS
            ),
            "storagePath": _setting_prop(("checkpoint", "storagePath"), maxLength=1024),
            "keepLast": _setting_prop(("checkpoint", "keepLast"), minimum=1, maximum=MAX_KEEP_LAST),
        },
        default={},
    )
    template = {
        "type": "object",
        "description": "Pod template of the worker Pods; the first container runs phalanx-run and the "
        "training script (its command and args).",
        "x-kubernetes-preserve-unknown-fields": True,
        "required": ["spec"],
        "properties": {
            "spec": {
                "type": "object",
                "x-kubernetes-preserve-unknown-fields": True,
                "required": ["containers"],
                "properties": {
                    "containers": {
                        "type": "array",
                        "minItems": 1,
                        "items": {
                            "type": "object",
                            "x-kubernetes-preserve-unknown-fields": True,
                            # Declared (and still kept whole) so that the CEL rules can read the limits.
                            "properties": {
                                "resources": {
                                    "type": "object",
                                    "x-kubernetes-preserve-unknown-fields": True,
                                    "properties": {
                                        "limits": {"type": "object", "additionalProperties": _quantity()}
                                    },
                                }
                            },
                        },
                    }
                },
            }
        },
    }
    gang = _obj(
        "All-or-nothing placement of the worker Pods by the Kubernetes scheduler: none of them is bound to a "
        "node until minNodes of them fit at once, so a job that cannot start holds no GPU while it waits. "
        "Needs the PodGroup API (scheduling.k8s.io/v1beta1, Kubernetes 1.37 or later with the "
        "GenericWorkload feature gate on in kube-apiserver and kube-scheduler); a job asking for it on a "
        "cluster without that API fails with reason GangSchedulingUnavailable.",
        {
            "enabled": {
                "type": "boolean",
                "description": "Gang-schedule the worker Pods (through a PodGroup <job>-workers that the "
                "operator creates and keeps). Fixed when the job is created.",
                "default": False,
            },
            "minNodes": _int(
                "Worker Pods that must fit at once before any is bound. Default: nodes.min (and it follows "
                "nodes.min when that changes). Replacements of lost nodes join the running gang one by one.",
                minimum=1,
                maximum=MAX_NODES,
            ),
        },
        default={},
    )
    master = _obj(
        "The job's master Pod (one per job: no GPU, about 100Mi of memory).",
        {
            "resources": _obj(
                "Resources of the master container (or in template.spec.containers[0].resources).",
                {
                    "requests": {"type": "object", "additionalProperties": _quantity()},
                    "limits": {"type": "object", "additionalProperties": _quantity()},
                },
            ),
            "template": _master_template(),
            "statusProgressInterval": _setting_prop(("master", "statusProgressInterval")),
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
    shared_memory = _obj(
        "A memory-backed emptyDir mounted at /dev/shm in the worker containers. A container runtime gives a "
        "container 64Mi of /dev/shm, and the flash checkpoint keeps two slots of every rank's state there "
        "(each allocated 1.1x the state), beside NCCL's shared-memory transport and DataLoader workers. Its "
        "pages count against the memory limit of the container that writes them.",
        {
            "enabled": _setting_prop(("sharedMemory", "enabled")),
            "sizeLimit": {
                **_quantity(),
                "description": "Size of /dev/shm, a quantity such as 16Gi; at least "
                f"{MIN_SHARED_MEMORY}. Default: "
                f"{s.JobPodSettings().shared_memory_per_process_mib // 1024}Gi per process (nprocPerNode), "
                "never more than the first container's memory limit. Size it as nprocPerNode x 2 x 1.1 x the "
                "checkpointed state of one rank, plus room for NCCL and DataLoader workers. A save that "
                "does not fit fails the job with reason SharedMemoryExhausted.",
                "x-kubernetes-validations": [
                    {
                        "rule": "isQuantity(string(self))",
                        "message": "sharedMemory.sizeLimit must be a quantity such as 16Gi",
                    },
                    {
                        "rule": "!isQuantity(string(self)) || "
                        f"quantity(string(self)).compareTo(quantity('{MAX_SHARED_MEMORY}')) <= 0",
                        "message": f"sharedMemory.sizeLimit must be at most {MAX_SHARED_MEMORY}",
                    },
                    {
                        "rule": "!isQuantity(string(self)) || "
                        f"quantity(string(self)).compareTo(quantity('{MIN_SHARED_MEMORY}')) >= 0",
                        "message": f"sharedMemory.sizeLimit must be at least {MIN_SHARED_MEMORY}: a "
                        "container has that much /dev/shm without the volume; leave sizeLimit out for the "
                        "default, or set sharedMemory.enabled to false for no volume",
                    },
                ],
            },
        },
        default={},
    )
    grace = s.JobPodSettings().persist_on_exit_s
    termination_grace = _optional_duration(
        path=("terminationGracePeriod",),
        doc="terminationGracePeriodSeconds of the worker Pods: a deleted, evicted or suspended worker's "
        "agent stops its workers (up to restart.gracePeriod), then persists the newest in-memory snapshot to "
        "storage before it exits. Must be longer than restart.gracePeriod. Default: restart.gracePeriod "
        f"+ {format_duration(grace)} (the agent waits up to 2m for that write, and 10s more for its "
        "checkpoint host to stop). A template's own terminationGracePeriodSeconds wins.",
    )
    refused = _setting_prop(("createRefusedTimeout",))
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
    nproc = _setting_prop(("nprocPerNode",))
    for key in ("type", "format"):
        nproc.pop(key)
    nproc.update(_quantity())
    nproc["description"] += (
        f" Or {AUTO}: the first container's {GPU_RESOURCE} limit, 1 without one. A number above that limit "
        "is refused: every process needs a GPU of its own."
    )
    nproc["x-kubernetes-validations"] = [
        {
            "rule": f"type(self) == string ? self == '{AUTO}' : int(self) >= 1",
            "message": f"nprocPerNode must be a whole number from 1, or {AUTO}",
        },
        {
            "rule": f"type(self) == string || int(self) <= {MAX_NPROC_PER_NODE}",
            "message": f"nprocPerNode must be at most {MAX_NPROC_PER_NODE}",
        },
    ]
    return _obj(
        "Desired state of an elastic training job.",
        {
            "nodes": nodes,
            "nprocPerNode": nproc,
            "parallelism": parallelism,
            "restart": restart,
            "heartbeat": heartbeat,
            "hang": hang,
            "healthChecks": health,
            "checkpoint": checkpoint,
            "template": template,
            "master": master,
            "sharedMemory": shared_memory,
            "terminationGracePeriod": termination_grace,
            "createRefusedTimeout": refused,
            "gangScheduling": gang,
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
                f"spec.managedBy. Absent or {MANAGED_BY!r}: the phalanx operator; anything else: the "
                "phalanx operator leaves the job alone (e.g. MultiKueue dispatching it to a worker cluster, "
                "whose operator runs it). Set at creation; cannot be changed.",
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
            "activeDeadline": _optional_duration(
                path=("activeDeadline",),
                doc="How long the job may be active before the operator fails it (reason DeadlineExceeded; "
                "its Pods are then cleaned up per cleanPodPolicy), like a batch/v1 Job's "
                "activeDeadlineSeconds. Counted from status.startTime: the job's start, and again from "
                "each resume after a suspension; a suspended job is never failed by it. Raising it on a "
                "running job before it expires extends the deadline. Absent or empty: no deadline.",
                positive=True,
            ),
            "ttlAfterFinished": _optional_duration(
                path=("ttlAfterFinished",),
                doc="How long the job is kept once it Succeeded or Failed; then the operator deletes it, and "
                "its Pods, Secret, ConfigMap and master RBAC with it (they are owned by the job), like a "
                "batch/v1 Job's ttlSecondsAfterFinished. 0s: as soon as it finished. Absent or empty: kept "
                "until deleted by hand.",
            ),
        },
        required=["nodes", "template"],
        **{
            "x-kubernetes-validations": [
                {
                    # With auto the operator checks it once it knows the number (reason InvalidSpec).
                    "rule": "type(self.nprocPerNode) == string || "
                    "(int(self.nprocPerNode) * self.nodes.unit) % "
                    "(self.parallelism.tensor * self.parallelism.pipeline) == 0",
                    "message": "parallelism.tensor x parallelism.pipeline must divide "
                    "nprocPerNode x nodes.unit, "
                    "so that every model replica fits in one unit of nodes",
                },
                {
                    "rule": f"type(self.nprocPerNode) == string || !({_HAS_C0_LIMITS}) || "
                    f"!('{GPU_RESOURCE}' in {_C0_LIMITS}) || "
                    f"!string({_C0_LIMITS}['{GPU_RESOURCE}']).matches('^[0-9]+$') || "
                    f"int(self.nprocPerNode) <= int(string({_C0_LIMITS}['{GPU_RESOURCE}']))",
                    "message": f"nprocPerNode must not be greater than the first container's {GPU_RESOURCE} "
                    f"limit: every process needs a GPU of its own; lower it, or set it to {AUTO}",
                },
                {
                    "rule": f"!has(self.sharedMemory.sizeLimit) || !({_HAS_C0_LIMITS}) || "
                    f"!('memory' in {_C0_LIMITS}) || !isQuantity(string(self.sharedMemory.sizeLimit)) || "
                    f"!isQuantity(string({_C0_LIMITS}['memory'])) || "
                    "quantity(string(self.sharedMemory.sizeLimit)).compareTo("
                    f"quantity(string({_C0_LIMITS}['memory']))) <= 0",
                    "message": "sharedMemory.sizeLimit must not be more than the first container's memory "
                    "limit: pages in /dev/shm count against it, so the container would be OOM-killed before "
                    "/dev/shm is full; raise the limit or lower sizeLimit",
                },
                {
                    "rule": "!has(self.terminationGracePeriod) || self.terminationGracePeriod == '' || "
                    f"!self.terminationGracePeriod.matches('{DURATION_RE}') || "
                    "duration(self.terminationGracePeriod) > duration(self.restart.gracePeriod)",
                    "message": "terminationGracePeriod must be longer than restart.gracePeriod: an agent "
                    "first stops its workers (up to gracePeriod), then persists the newest in-memory "
                    "snapshot in the time left",
                },
                {
                    "rule": "has(self.managedBy) == has(oldSelf.managedBy) && "
                    "(!has(self.managedBy) || self.managedBy == oldSelf.managedBy)",
                    "message": "managedBy cannot be changed: it names the controller that owns the job "
                    "from its creation",
                },
                {
                    "rule": "self.nprocPerNode == oldSelf.nprocPerNode",
                    "message": "nprocPerNode cannot be changed on a running job",
                },
                {
                    "rule": "self.parallelism == oldSelf.parallelism",
                    "message": "parallelism cannot be changed on a running job",
                },
                {
                    "rule": "!has(self.gangScheduling.minNodes) || "
                    "self.gangScheduling.minNodes <= self.nodes.max",
                    "message": "gangScheduling.minNodes must not be greater than nodes.max: so many worker "
                    "Pods never exist, and the gang would never be placed",
                },
                {
                    "rule": "self.gangScheduling.enabled == oldSelf.gangScheduling.enabled",
                    "message": "gangScheduling.enabled cannot be changed on a running job: a Pod's "
                    "scheduling group is fixed when it is created; create a new job instead",
                },
            ]
        },
    )


def _condition_schema() -> dict[str, Any]:
    return _obj(
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


def _status_schema() -> dict[str, Any]:
    eviction = _obj(
        "A node the master asked to evict and replace.",
        {
            "nodeId": {"type": "string", "description": "Node id (the worker Pod's name)."},
            "machine": {"type": "string", "description": "Kubernetes node the worker ran on."},
            "reason": {"type": "string"},
            "requestedAt": {"type": "string", "description": "When the master asked (RFC 3339)."},
        },
        required=["nodeId"],
    )
    return _obj(
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
            "nodes": _int("Worker Pods running."),
            "selector": {
                "type": "string",
                "description": "Label selector of the worker Pods (scale subresource, autoscalers).",
            },
            "worldSize": _int("Training processes in the current rendezvous round."),
            "round": {"type": "integer", "format": "int64", "description": "Current rendezvous round."},
            "step": {
                "type": "integer",
                "format": "int64",
                "description": "Newest step reported by any rank.",
            },
            "lastCommittedCheckpointStep": {
                "type": "integer",
                "format": "int64",
                "description": "Newest checkpoint step committed to storage by every shard.",
            },
            "restartCount": _int("Worker restarts the master counted."),
            "evictions": {
                "type": "array",
                "items": eviction,
                "description": "Evictions requested by the master.",
            },
            "replacements": _int("Worker Pods the operator replaced (failed, lost or evicted)."),
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
            "master": _obj(
                "The job as its master last reported it.",
                {
                    "phase": {"type": "string"},
                    "reason": {"type": "string", "maxLength": 32768},
                    "members": {"type": "array", "items": {"type": "string"}},
                    "observedGeneration": {
                        "type": "integer",
                        "format": "int64",
                        "description": "The generation of the spec the master follows (spec.suspend); its "
                        "Suspended phase acknowledges a suspension only at the job's current generation.",
                    },
                    "updatedAt": {"type": "string"},
                },
            ),
        },
    )


def build_crd() -> dict[str, Any]:
    """The CustomResourceDefinition of ElasticJob as a plain dict (JSON/YAML ready)."""
    schema = _obj(
        "An elastic PyTorch training job kept alive through failures by phalanx.",
        {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": _spec_schema(),
            "status": _status_schema(),
        },
        required=["spec"],
        **{
            "x-kubernetes-validations": [
                {
                    "rule": f"size(self.metadata.name) <= {MAX_JOB_NAME}",
                    "message": f"the job name must be at most {MAX_JOB_NAME} characters, so that its Pod "
                    "names stay valid",
                }
            ]
        },
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
                "shortNames": SHORT_NAMES,
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
