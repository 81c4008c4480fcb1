"""What admission accepts of an ElasticJob: the bounds of its fields and the rules relating them.

The API server enforces these (OpenAPI bounds and enums for single fields, CEL rules in
``x-kubernetes-validations`` with a ``message`` for everything that relates two fields), so a person learns
of a mistake when applying the job, not from a failed job later. :func:`phalanx.operator.spec.parse_spec`
checks the bounds again for an object that slipped past an older CRD. The schema that carries them is built
by :mod:`phalanx.operator.crd`.
"""

from __future__ import annotations

from typing import Any

from phalanx.operator.resources import AUTO, GPU_RESOURCE, MIN_SHARED_MEMORY

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
    ("hang", "stopped"): "24h",
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

CLEAN_POD_POLICIES = ("None", "Running", "All")
MANAGED_BY = "phalanx.dev/operator"
"""``spec.managedBy`` of the jobs this operator reconciles (or none)."""

# Go-style durations: the form CEL's duration() parses and people write in YAML.
DURATION_RE = r"^([0-9]+([.][0-9]+)?(ms|s|m|h))+$"  # no backslashes: CEL string literals

_C0 = "self.template.spec.containers[0]"
_C0_LIMITS = f"{_C0}.resources.limits"
_HAS_C0_LIMITS = f"has({_C0}.resources) && has({_C0_LIMITS})"


def duration_limit(path: tuple[str, ...], *, empty_ok: bool) -> dict[str, str]:
    """The CEL rule bounding a duration; a value that is no duration passes it (the syntax rule speaks)."""
    limit = MAX_DURATIONS[path]
    empty = "self == '' || " if empty_ok else ""
    return {
        "rule": f"{empty}!self.matches('{DURATION_RE}') || duration(self) <= duration('{limit}')",
        "message": f"{'.'.join(path)} must be at most {limit}",
    }


def job_name_rules() -> list[dict[str, Any]]:
    """On the whole object: the job's name leaves room for the names derived from it."""
    return [
        {
            "rule": f"size(self.metadata.name) <= {MAX_JOB_NAME}",
            "message": f"the job name must be at most {MAX_JOB_NAME} characters, so that its Pod "
            "names stay valid",
        }
    ]


def spec_rules() -> list[dict[str, Any]]:
    """On ``spec``: the rules relating fields of different groups, and the fields fixed at creation
    (``oldSelf``). A new list each call (the YAML then has no aliases)."""
    return [
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
            "rule": "!has(self.gangScheduling.minNodes) || self.gangScheduling.minNodes <= self.nodes.max",
            "message": "gangScheduling.minNodes must not be greater than nodes.max: so many worker "
            "Pods never exist, and the gang would never be placed",
        },
        {
            "rule": "self.gangScheduling.enabled == oldSelf.gangScheduling.enabled",
            "message": "gangScheduling.enabled cannot be changed on a running job: a Pod's "
            "scheduling group is fixed when it is created; create a new job instead",
        },
        {
            "rule": "self.gangScheduling.scheduler == oldSelf.gangScheduling.scheduler && "
            "(has(self.gangScheduling.schedulerName) == has(oldSelf.gangScheduling.schedulerName)) && "
            "(!has(self.gangScheduling.schedulerName) || "
            "self.gangScheduling.schedulerName == oldSelf.gangScheduling.schedulerName)",
            "message": "gangScheduling.scheduler and schedulerName cannot be changed on a running job: its "
            "Pods' scheduler and group are fixed when they are created; create a new job instead",
        },
    ]


def nproc_rules() -> list[dict[str, Any]]:
    """On ``spec.nprocPerNode``: a count from 1 (bounded), or auto."""
    return [
        {
            "rule": f"type(self) == string ? self == '{AUTO}' : int(self) >= 1",
            "message": f"nprocPerNode must be a whole number from 1, or {AUTO}",
        },
        {
            "rule": f"type(self) == string || int(self) <= {MAX_NPROC_PER_NODE}",
            "message": f"nprocPerNode must be at most {MAX_NPROC_PER_NODE}",
        },
    ]


def shared_memory_size_rules() -> list[dict[str, Any]]:
    """On ``spec.sharedMemory.sizeLimit``: a quantity between what a container has anyway and the bound."""
    return [
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
    ]
