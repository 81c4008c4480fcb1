"""Settings: one model that CLI flags, environment variables and the ElasticJob spec all map onto.

Settings are grouped, frozen dataclasses. Every field is declared with :func:`setting`, which records a
one-line doc and the unit; that metadata is the single source for ``--help`` texts, the environment
variable names and the CRD field descriptions. Defaults live in these modules and nowhere else.

Three modules, one job each: the field table (how a field is declared, the textual parsers, the mapping of
flags, environment variables and spec fields onto fields) is :mod:`phalanx.api.settings_table`; the groups a
job's processes share (rendezvous, heartbeat, hang, restart, logs, checkpoint, stragglers, probes) are
:mod:`phalanx.api.settings_groups`; this module holds the settings of each process (master, agent, operator,
the operator's Pods) and re-exports the rest, so ``phalanx.api.settings`` is the one import for settings.

Validation happens in ``__post_init__`` and raises :class:`~phalanx.api.errors.ConfigError` naming the
field, so a bad flag, variable or spec field gets one clear sentence saying what to fix.

Environment variables are ``PHALANX_<GROUP>_<FIELD>`` in upper case, for example
``PHALANX_HEARTBEAT_TIMEOUT_S=5`` for ``MasterSettings.heartbeat.timeout_s``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from phalanx.api import limits
from phalanx.api.errors import ConfigError
from phalanx.api.settings_groups import (
    PROBE_KINDS,
    CheckpointSettings,
    HangSettings,
    HeartbeatSettings,
    LogSettings,
    ProbeSettings,
    RendezvousSettings,
    RestartSettings,
    StragglerSettings,
    parse_probe_kinds,
)
from phalanx.api.settings_table import (
    ENV_PREFIX,
    checked,
    describe,
    env_names,
    from_env,
    from_mapping,
    group,
    parse_duration,
    parse_node_range,
    positive,
    setting,
)

# The names callers import from here: the field table's functions and every group live in their own
# modules, re-exported so that ``phalanx.api.settings`` stays the one import for settings.
__all__ = [
    "DEFAULT_STATUS_PROGRESS_INTERVAL_S",
    "ENV_PREFIX",
    "PROBE_KINDS",
    "AgentSettings",
    "CheckpointSettings",
    "HangSettings",
    "HeartbeatSettings",
    "JobPodSettings",
    "LogSettings",
    "MasterSettings",
    "OperatorSettings",
    "ProbeSettings",
    "RendezvousSettings",
    "RestartSettings",
    "StragglerSettings",
    "describe",
    "env_names",
    "from_env",
    "from_mapping",
    "group",
    "parse_duration",
    "parse_node_range",
    "parse_probe_kinds",
    "setting",
]


DEFAULT_STATUS_PROGRESS_INTERVAL_S = 10.0
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
"""The step alone changes on every heartbeat while training; one status PATCH per job every 10 s keeps a
thousand jobs at about 100 writes a second to the API server."""


@checked
@dataclass(frozen=True, kw_only=True)
class MasterSettings:
    """Everything a job's master needs."""

    job_id: str = setting("", doc="Name of the job; agents must present the same id.")
    host: str = setting("127.0.0.1", doc="Address the master's servers bind to.")
    grpc_port: int = setting(0, doc="Port of the gRPC service for agents (0: pick a free one).")
    http_port: int = setting(0, doc="Port of the HTTP API and /metrics (0: pick a free one).")
    token_file: str = setting("", doc="File holding the job's bearer token.")
    metrics_token_file: str = setting(
        "",
        doc="File holding a second token, good for GET /metrics only: one Prometheus credential for every "
        "job's master. Empty, or a missing file: /metrics needs the job's token.",
    )
    tls_cert_file: str = setting(
        "",
        doc="PEM certificate (chain) the master's gRPC and HTTP servers present; with tls_key_file, both "
        "serve TLS only. Empty: plain text.",
    )
    tls_key_file: str = setting("", doc="PEM private key of tls_cert_file.")
    state_path: str = setting("", doc="Where the master keeps its durable state (a file path locally).")
    log_dir: str = setting("", doc="Directory of the append-only job log; empty: beside the state file.")
    long_poll_max_s: float = setting(
        30.0, doc="Longest time the master holds a GetRendezvous call.", unit="s"
    )
    user_error_window_s: float = setting(
        10.0, doc="A user error reported by every node within this window fails the job at once.", unit="s"
    )
    max_request_bytes: int = setting(
        limits.DEFAULT_MAX_REQUEST_BYTES, doc="Largest gRPC request the master accepts.", unit="bytes"
    )
    status_progress_interval_s: float = setting(
        DEFAULT_STATUS_PROGRESS_INTERVAL_S,
        doc="In Kubernetes, how often at most training progress alone (the step) is written into the "
        "ElasticJob status; a phase change, evictions, a new round or a committed checkpoint are written at "
        "once. 0: every change at once.",
        unit="s",
    )
    rendezvous: RendezvousSettings = group(RendezvousSettings, doc="Rendezvous rounds.")
    heartbeat: HeartbeatSettings = group(HeartbeatSettings, doc="Node liveness.")
    restart: RestartSettings = group(RestartSettings, doc="Restart and eviction budgets.")
    logs: LogSettings = group(LogSettings, doc="Log aggregation.")
    probes: ProbeSettings = group(ProbeSettings, doc="Health-probe rounds and straggler eviction.")

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[a-z0-9]([-a-z0-9.]{0,61}[a-z0-9])?", self.job_id or ""):
            raise ConfigError(
                f"must be 1-63 lower-case letters, digits, '-' or '.', starting and ending alphanumeric; "
                f"got {self.job_id!r}",
                field="job_id",
            )
        for name in ("grpc_port", "http_port"):
            port = getattr(self, name)
            if not 0 <= port <= 65535:
                raise ConfigError(f"must be a port number between 0 and 65535, got {port}", field=name)
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            missing = "tls_key_file" if self.tls_cert_file else "tls_cert_file"
            raise ConfigError("TLS needs both a certificate and its key; give both or neither", field=missing)
        positive(self.long_poll_max_s, "long_poll_max_s")
        if self.user_error_window_s < 0:
            raise ConfigError(
                f"cannot be negative, got {self.user_error_window_s}", field="user_error_window_s"
            )
        if self.status_progress_interval_s < 0:
            raise ConfigError(
                f"cannot be negative, got {self.status_progress_interval_s}",
                field="status_progress_interval_s",
            )
        if self.max_request_bytes < limits.MIN_MAX_REQUEST_BYTES:
            raise ConfigError(
                f"must be at least {limits.MIN_MAX_REQUEST_BYTES}, got {self.max_request_bytes}",
                field="max_request_bytes",
            )


@checked
@dataclass(frozen=True, kw_only=True)
class AgentSettings:
    """Everything a node agent (`phalanx-run`) reads from its flags and ``PHALANX_*`` variables: a flag wins
    over its variable, a variable over the default here (:mod:`phalanx.agent.config`)."""

    job_id: str = setting("", doc="Name of the job (torchrun's --rdzv-id).")
    node_id: str = setting("", doc="Stable name of this node within the job; empty: the host name.")
    master_addr: str = setting("", doc="host:port of the master's gRPC service (torchrun's --rdzv-endpoint).")
    token_file: str = setting("", doc="File holding the job's bearer token.")
    host: str = setting("", doc="Address the other nodes reach this node at; empty: the host name's address.")
    nproc_per_node: int = setting(1, doc="Training processes this node runs.")
    max_restarts: int = setting(
        0,
        doc="Restarts of this node's workers the agent carries out before it exits (torchrun's meaning); the "
        "job's own budget is the master's.",
    )
    monitor_interval_s: float = setting(0.1, doc="How often the agent checks its workers.", unit="s")
    grace_period_s: float = setting(
        5.0, doc="Time workers get between SIGTERM and SIGKILL when they are stopped.", unit="s"
    )
    log_dir: str = setting("", doc="Directory for per-rank log and error files; empty: a temporary one.")
    warm_spares: bool = setting(True, doc="Start workers from spares that imported torch beforehand.")
    warm_probes: bool = setting(
        True, doc="Fork each health probe from a probe server that imported torch beforehand."
    )
    checkpoint_host: bool = setting(True, doc="Run the node's flash-checkpoint host.")
    hang: HangSettings = group(HangSettings, doc="Hang detection.")
    logs: LogSettings = group(LogSettings, doc="Log shipping limits.")
    checkpoint: CheckpointSettings = group(CheckpointSettings, doc="Flash checkpoint.")

    def __post_init__(self) -> None:
        if self.nproc_per_node < 1:
            raise ConfigError(f"must be at least 1, got {self.nproc_per_node}", field="nproc_per_node")
        if self.max_restarts < 0:
            raise ConfigError(f"cannot be negative, got {self.max_restarts}", field="max_restarts")
        positive(self.monitor_interval_s, "monitor_interval_s")
        if self.grace_period_s < 0:
            raise ConfigError(f"cannot be negative, got {self.grace_period_s}", field="grace_period_s")


@checked
@dataclass(frozen=True, kw_only=True)
class JobPodSettings:
    """How the operator shapes an ElasticJob's Pods beyond its template: the defaults of
    ``spec.sharedMemory``, ``spec.terminationGracePeriod``, ``spec.createRefusedTimeout`` and
    ``spec.restart.maxDisruptions``."""

    shared_memory: bool = setting(
        True,
        doc="Mount a memory-backed emptyDir at /dev/shm in the worker containers (a container runtime's own "
        "/dev/shm is 64Mi, too small for any flash checkpoint).",
    )
    shared_memory_per_process_mib: int = setting(
        2048,
        doc="Size of /dev/shm per training process when sharedMemory.sizeLimit is not given (capped at "
        "the first container's memory limit): each rank keeps two slots of its state (x1.1), so about "
        "0.9Gi of checkpointed state per rank.",
        unit="MiB",
    )
    persist_on_exit_s: float = setting(
        130.0,
        doc="Time a terminated worker Pod gets beyond restart.gracePeriod to persist its newest in-memory "
        "snapshot and exit: the agent waits up to 120s for that write; 10s more let its checkpoint host "
        "stop.",
        unit="s",
    )
    create_refused_timeout_s: float = setting(
        600.0,
        doc="How long the API server may go on refusing to create one of the job's Pods or objects "
        "(Forbidden, Invalid, quota exceeded) before the job fails.",
        unit="s",
    )
    max_disruptions: int = setting(
        100,
        doc="Worker Pods the cluster may end (a preemption, a drain, node pressure: the Pod's "
        "DisruptionTarget condition) and the operator replace before the job fails; apart from "
        "restart.maxEvictions, which these replacements do not touch.",
    )

    def __post_init__(self) -> None:
        if self.max_disruptions < 0:
            raise ConfigError(f"cannot be negative, got {self.max_disruptions}", field="max_disruptions")
        positive(self.shared_memory_per_process_mib, "shared_memory_per_process_mib")
        positive(self.persist_on_exit_s, "persist_on_exit_s")
        positive(self.create_refused_timeout_s, "create_refused_timeout_s")


@checked
@dataclass(frozen=True, kw_only=True)
class OperatorSettings:
    """The Kubernetes operator (`phalanx operator`)."""

    namespace: str = setting(
        "",
        doc="Namespaces whose ElasticJobs the operator handles, comma-separated (each watched on its own, "
        "with a Role there); empty: all namespaces.",
    )
    image: str = setting(
        "ghcr.io/phalanx-dev/phalanx:0.1.0",
        doc="Container image of the master Pod (built from the Dockerfile).",
    )
    command_prefix: str = setting(
        "",
        doc="Prepended to the phalanx and phalanx-run commands in Pods (a bin directory ending in '/'); "
        "empty: the image's PATH.",
    )
    master_grpc_port: int = setting(29400, doc="Port of the master's gRPC service for agents.")
    master_http_port: int = setting(8080, doc="Port of the master's HTTP API and /metrics.")
    metrics_token_file: str = setting(
        "",
        doc="File holding the token Prometheus presents to every job's master, good for /metrics only; "
        "the operator copies it into each job's <job>-metrics Secret. Empty: /metrics needs each job's own "
        "token.",
    )
    metrics_token_secret: str = setting(
        "",
        doc="Instead of metrics_token_file: a Secret of the operator's own namespace that holds the metrics "
        "token under metrics_token_secret_key, read at start and made with a random token when it does not "
        "exist (the Helm chart's way: its render then holds no secret, and two renders are the same).",
    )
    metrics_token_secret_key: str = setting(
        "token", doc="The key of metrics_token_secret that holds the token."
    )
    reconcile_interval_s: float = setting(
        2.0, doc="How often each job is reconciled against its Pods, whatever the events.", unit="s"
    )
    watch_inactivity_s: float = setting(
        70.0,
        doc="A watch of jobs, Pods or Workloads that delivers nothing (not even the API server's bookmark, "
        "sent every minute) for this long has stalled: it is reopened.",
        unit="s",
    )
    http_port: int = setting(
        8081,
        doc="Port of the operator's own /healthz (liveness: its event loop answers and, on the leader, its "
        "periodic passes run) and /metrics (needs the metrics token; served only with one); 0: none.",
    )
    finish_grace_s: float = setting(
        10.0,
        doc="How long Pods still running when a job finished get to exit by themselves before cleanup.",
        unit="s",
    )
    stuck_pod_timeout_s: float = setting(
        120.0,
        doc="How long a Pod that cannot start for a cause waiting does not heal (an image that does "
        "not exist or cannot be pulled, an invalid image name, a missing Secret or ConfigMap) may hold a "
        "job back (its master's Pod, or a worker's while fewer than nodes.min run) before the job fails "
        "with that cause.",
        unit="s",
    )
    master_node_lost_s: float = setting(
        30.0,
        doc="How long the master Pod stays on a node that stopped answering (NotReady or unreachable) before "
        "Kubernetes evicts it (its tolerationSeconds of node.kubernetes.io/unreachable and not-ready; 300 s "
        "by default for other Pods); the operator then removes it at once and starts a new master elsewhere, "
        "which fences the old one off the job's state.",
        unit="s",
    )
    suspend_ack_timeout_s: float = setting(
        60.0,
        doc="How long a suspension waits for the job's master to acknowledge it before the worker Pods are "
        "deleted anyway: a master that is gone or stuck does not hold the job's nodes.",
        unit="s",
    )
    # Trust switches: what the operator may do beyond a job's own namespace, set by the cluster's
    # administrator (Helm values), never by a job. A job author controls the evidence (a training script can
    # hang its own node, and it can read the job token), so nothing a job says reaches objects it does not
    # own unless the administrator chose to trust jobs that far. All off by default.
    cordon_nodes: bool = setting(
        False,
        doc="Allow jobs with spec.cordonBadNodes to cordon and taint the Kubernetes node of a worker Pod the "
        "operator evicted (its spec.nodeName, never a name the job reports). Off: no job cordons anything, "
        "and the operator needs no permission on nodes.",
    )
    network_policy: bool = setting(
        True,
        doc="Give every job two NetworkPolicies: <job>-master (only the job's own Pods and the monitoring "
        "namespace reach its master's ports) and <job>-workers (only the job's own Pods reach its workers: "
        "their rendezvous and probe stores authenticate nobody). Enforced by the cluster's network plugin "
        "where it enforces NetworkPolicies. Off: any Pod of the cluster reaches both.",
    )
    tls_ca_secret: str = setting(
        "",
        doc="Serve every job's master over TLS: the Secret (in the operator's namespace; tls.crt, tls.key) "
        "of the CA that signs each job's master certificate, made by the operator when it does not exist. "
        "Workers get the CA certificate only. Empty: masters speak plain text.",
    )
    admission_policy: str = setting(
        "phalanx-elasticjob-templates",
        doc="The ValidatingAdmissionPolicy (and its binding of the same name) that keeps a job's templates "
        "within its author's rights. While the operator cannot find both, it fails every job whose templates "
        "ask for host access, privileges, another service account or a node. Empty: no check (every job "
        "author is trusted with the operator's rights).",
    )
    pod_admission_policy: str = setting(
        "phalanx-elasticjob-pods",
        doc="The ValidatingAdmissionPolicy (and its binding of the same name) that lets only the operator "
        "give a Pod a job's label or ownerReference. The operator takes such Pods for the job's own; "
        "without the policy, anyone who may create Pods in a job's namespace can pose as one of its "
        "members, and the operator says so in its log when it starts to lead. Empty: no check.",
    )
    monitoring_namespace: str = setting(
        "monitoring",
        doc="Namespace (its kubernetes.io/metadata.name label) whose Pods may scrape every master's /metrics "
        "through the per-job NetworkPolicy; empty: none.",
    )

    @property
    def namespaces(self) -> tuple[str, ...]:
        """The namespaces of :attr:`namespace`, each once; () for all."""
        return tuple(dict.fromkeys(n.strip() for n in self.namespace.split(",") if n.strip()))

    @property
    def metrics_token_given(self) -> bool:
        """Whether the masters get a metrics token (from metrics_token_file or metrics_token_secret)."""
        return bool(self.metrics_token_file or self.metrics_token_secret)

    def __post_init__(self) -> None:
        positive(self.reconcile_interval_s, "reconcile_interval_s")
        positive(self.watch_inactivity_s, "watch_inactivity_s")
        if self.metrics_token_file and self.metrics_token_secret:
            raise ConfigError(
                "set metrics_token_file or metrics_token_secret, not both", field="metrics_token_secret"
            )
        positive(self.suspend_ack_timeout_s, "suspend_ack_timeout_s")
        positive(self.stuck_pod_timeout_s, "stuck_pod_timeout_s")
        positive(self.master_node_lost_s, "master_node_lost_s")
        for ns in self.namespaces:
            if not _DNS_LABEL.fullmatch(ns):
                raise ConfigError(f"{ns!r} is not a namespace name (a DNS label)", field="namespace")
        if self.finish_grace_s < 0:
            raise ConfigError(f"cannot be negative, got {self.finish_grace_s}", field="finish_grace_s")
        for name in ("master_grpc_port", "master_http_port"):
            port = getattr(self, name)
            if not 0 < port <= 65535:
                raise ConfigError(f"must be a port number between 1 and 65535, got {port}", field=name)
        if not 0 <= self.http_port <= 65535:
            raise ConfigError(f"must be a port number or 0 (none), got {self.http_port}", field="http_port")
