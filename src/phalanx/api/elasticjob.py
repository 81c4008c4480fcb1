"""The ElasticJob contract: what the operator, the job's master and the CLI must agree on.

The custom resource's identity (group, version, plural, kind), the names of the objects that belong to a
job (derived from the job's name alone, so a restarted operator recomputes them and a master finds its
state without being told), and the status keys the master writes and the operator reads. The CRD's schema
(:mod:`phalanx.operator.crd`) declares these keys; everything else names them from here.

Worker Pods are ``<job>-worker-<slot>-<incarnation>``: the slot is the node's place in the job
(0..nodes.max-1), the incarnation counts its replacements, so a slot never gets a second Pod of a name.
"""

from __future__ import annotations

import re
from enum import StrEnum

# --- The custom resource ----------------------------------------------------------------------------------
GROUP = "phalanx.dev"
VERSION = "v1alpha1"
KIND = "ElasticJob"
PLURAL = "elasticjobs"
SINGULAR = "elasticjob"
# `ej` is short; `pxj` and the category stay unambiguous beside other ElasticJob kinds (DLRover's, the old
# pytorch/elastic one), whose plural is also `elasticjobs`: `kubectl get pxj`, `kubectl get phalanx`, or
# the full `kubectl get elasticjobs.phalanx.dev`.
SHORT_NAMES = ("ej", "pxj")
CATEGORIES = ("phalanx",)
CRD_NAME = f"{PLURAL}.{GROUP}"
API_VERSION = f"{GROUP}/{VERSION}"

# --- Objects of one job, by the job's name ----------------------------------------------------------------


def master(job: str) -> str:
    """The master Pod, its Service, ServiceAccount, Role and RoleBinding."""
    return f"{job}-master"


def token_secret(job: str) -> str:
    """The job token (key :data:`TOKEN_KEY`), mounted into the master and the workers."""
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


def workers_network_policy(job: str) -> str:
    """The NetworkPolicy guarding the workers' ports, their rendezvous and probe stores among them (operator
    setting network_policy)."""
    return f"{job}-workers"


def state_config_map(job: str) -> str:
    """The master's durable state (key :data:`STATE_KEY`): the operator creates it, the master writes it."""
    return f"{job}-master-state"


def pod_group(job: str) -> str:
    """The PodGroup that gang-schedules the worker Pods (``spec.gangScheduling``)."""
    return f"{job}-workers"


def worker(job: str, *, slot: int, incarnation: int) -> str:
    return f"{job}-worker-{slot}-{incarnation}"


_WORKER = re.compile(r"^(?P<job>.+)-worker-(?P<slot>\d+)-(?P<inc>\d+)$")


def parse_worker(name: str) -> tuple[int, int] | None:
    """(slot, incarnation) of a worker Pod name, or None when it is not one."""
    match = _WORKER.match(name)
    return (int(match["slot"]), int(match["inc"])) if match else None


TOKEN_KEY = "token"  # noqa: S105 -- the key of the token Secret, not a secret
STATE_KEY = "state.json"

SCHEDULED_ANNOTATION = "phalanx.dev/scheduled-workers"
"""On the ElasticJob, written by the operator and read by the master: how many of the job's worker Pods the
scheduler placed on a node (the master's min-nodes timeout runs only once min_nodes of them could be)."""

# --- Phases ----------------------------------------------------------------------------------------------


class Phase(StrEnum):
    """A job's phase: the master's (``/v1/job``, ``status.master.phase``) and the ElasticJob's
    (``status.phase``, which is CREATED from the operator's first pass until the master reports). Members are
    the strings they name, so a status read from the API server compares equal to them."""

    PENDING = "Pending"
    CREATED = "Created"
    RUNNING = "Running"
    RESTARTING = "Restarting"
    SUSPENDED = "Suspended"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"


FINISHED_PHASES = frozenset({Phase.SUCCEEDED, Phase.FAILED})


def phase_of(said: object, *, any_case: bool = False) -> Phase | None:
    """The phase a status names (``status.phase``, ``status.master.phase``); None for none, or for a word
    that is no phase. ``any_case``: as the master's verdict is compared, whatever its case."""
    word = str(said or "")
    if any_case:
        word = word.lower()
        return next((phase for phase in Phase if phase.lower() == word), None)
    try:
        return Phase(word)
    except ValueError:
        return None


MASTER_PHASES = (
    Phase.PENDING,
    Phase.RUNNING,
    Phase.RESTARTING,
    Phase.SUSPENDED,
    Phase.SUCCEEDED,
    Phase.FAILED,
)
"""The phases a master reports (never CREATED, the operator's)."""

# --- Status keys the master writes (the status subresource, a merge patch) and the operator reads ---------
STATUS_ROUND = "round"
STATUS_WORLD_SIZE = "worldSize"
STATUS_STEP = "step"
STATUS_COMMITTED_STEP = "lastCommittedCheckpointStep"
STATUS_RESTART_COUNT = "restartCount"
STATUS_EVICTIONS = "evictions"
"""A list of the nodes the master asks to evict; the operator replaces and deletes their Pods."""
STATUS_MASTER = "master"
"""The job as the master last reported it; its phase ends the job or acknowledges a suspension."""

EVICTION_NODE_ID = "nodeId"
EVICTION_MACHINE = "machine"
EVICTION_REASON = "reason"
EVICTION_REQUESTED_AT = "requestedAt"

MASTER_PHASE = "phase"
MASTER_REASON = "reason"
MASTER_MEMBERS = "members"
MASTER_OBSERVED_GENERATION = "observedGeneration"
"""The spec generation the master follows: its Suspended phase acknowledges only that generation."""
MASTER_UPDATED_AT = "updatedAt"

MASTER_STATUS_FIELDS = frozenset(
    {
        STATUS_ROUND, STATUS_WORLD_SIZE, STATUS_STEP, STATUS_COMMITTED_STEP, STATUS_RESTART_COUNT,
        STATUS_EVICTIONS, STATUS_MASTER,
    }
)  # fmt: skip
"""The top-level status fields that are the master's; the operator writes the others."""
