"""Pure builders of the Pods the operator creates for an ElasticJob: the master Pod, the worker Pods, and
the PodGroup that gang-schedules them (the other objects: :mod:`phalanx.operator.supporting`).

Each function returns a plain dict (the object as the API takes it), owned by the ElasticJob so that the
garbage collector deletes it with the job. Names are deterministic (:mod:`phalanx.api.elasticjob`), which
is what makes a restarted operator create no duplicates: a second create of the same name is refused
with 409 by the API server.

Networking: the master is reached through its Service's DNS name ``<job>-master.<ns>.svc``; processes
bind to the Pod IP (``$(POD_IP)``), which works in real clusters and in the test cluster, where every Pod
is a local process with its own loopback address.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence
from pathlib import PurePosixPath
from typing import Any

from phalanx.api import elasticjob
from phalanx.api.auth import TLS_CA_ENV
from phalanx.api.elasticjob import TOKEN_KEY
from phalanx.api.errors import ConfigError
from phalanx.api.settings import OperatorSettings, ProbeSettings
from phalanx.operator import gang, names, resources, security, supporting, tls
from phalanx.operator.meta import Obj, object_meta, owner_reference
from phalanx.operator.placement import place
from phalanx.operator.schema import format_duration as _dur
from phalanx.operator.spec import JobSpec
from phalanx.operator.supporting import METRICS_TOKEN_KEY

TOKEN_DIR = "/var/run/phalanx/token"  # noqa: S105 -- a mount path, not a secret
TOKEN_FILE = f"{TOKEN_DIR}/{TOKEN_KEY}"
METRICS_DIR = "/var/run/phalanx/metrics"
TLS_DIR = "/var/run/phalanx/tls"
METRICS_TOKEN_FILE = f"{METRICS_DIR}/{METRICS_TOKEN_KEY}"


def _tls_volume(job_name: str, *, keys: Sequence[str]) -> Obj:
    # World-readable for the same reason as the token's (no fsGroup of ours); the key file only in the
    # master's Pod, whose only process is the master.
    items = [{"key": key, "path": key} for key in keys]
    return {
        "name": "phalanx-tls",
        "secret": {"secretName": elasticjob.tls_secret(job_name), "items": items, "defaultMode": 0o444},
    }


_TLS_MOUNT = {"name": "phalanx-tls", "mountPath": TLS_DIR, "readOnly": True}


def _field_env(name: str, path: str) -> Obj:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


IMAGE_GID = 10001
"""The images' uid and gid (the Dockerfile's numeric ``USER 10001:10001``, which ``runAsNonRoot`` can check).
No Pod of a job names it: a fixed runAsUser or fsGroup is what OpenShift-style policies refuse."""
SHM_VOLUME = "phalanx-shm"
SHM_PATH = "/dev/shm"
MASTER_POD_FIELDS = ("tolerations", "nodeSelector", "affinity", "priorityClassName", "imagePullSecrets")
"""Fields of ``spec.master.template.spec`` copied onto the master Pod as they are."""


def _token_volume(job_name: str) -> Obj:
    # Secret files belong to root and the images run as uid 10001. Without an fsGroup (OpenShift's restricted
    # policy assigns its own and refuses others) only a world-readable mode lets the image's user read the
    # token; the container's users are the image's own, and the Secret's RBAC guards it outside the Pod.
    return {
        "name": "phalanx-token",
        "secret": {"secretName": elasticjob.token_secret(job_name), "defaultMode": 0o444},
    }


_TOKEN_MOUNT = {"name": "phalanx-token", "mountPath": TOKEN_DIR, "readOnly": True}


def _master_command(job: Mapping[str, Any], spec: JobSpec, *, settings: OperatorSettings) -> list[str]:
    """``phalanx master`` for the job: its state in the job's ConfigMap, the token and TLS files mounted."""
    meta = job["metadata"]
    job_name, ns = meta["name"], meta["namespace"]
    command = [
        f"{settings.command_prefix}phalanx", "master",
        "--job-id", job_name,
        "--nodes", f"{spec.min_nodes}:{spec.max_nodes}",
        "--host", "$(POD_IP)",
        "--port", str(settings.master_grpc_port),
        "--http-port", str(settings.master_http_port),
        "--token-file", TOKEN_FILE,
        "--state", f"k8s://{ns}/{job_name}",
    ]  # fmt: skip
    if settings.metrics_token_given:
        command += ["--metrics-token-file", METRICS_TOKEN_FILE]
    if settings.tls_ca_secret:
        command += [
            "--tls-cert-file",
            f"{TLS_DIR}/{tls.CERT_KEY}",
            "--tls-key-file",
            f"{TLS_DIR}/{tls.KEY_KEY}",
        ]
    return command


MASTER_LIVENESS_PERIOD_S = 20
MASTER_LIVENESS_FAILURES = 3
"""A master that has not answered for a minute is killed (its Pod fails and the operator starts another)."""


def _master_liveness(settings: OperatorSettings) -> Obj:
    """An exec probe (:mod:`phalanx.master.livez`): every master endpoint wants the job token, which a Pod's
    httpGet probe could only carry in the Pod spec, readable by anyone who may read the Pod."""
    command = [
        f"{settings.command_prefix}python", "-m", "phalanx.master.livez",
        "--port", str(settings.master_http_port), "--token-file", TOKEN_FILE,
    ]  # fmt: skip
    if settings.tls_ca_secret:
        command += ["--ca-file", f"{TLS_DIR}/{tls.CA_CERT_KEY}", "--server-name", tls.SCRAPE_NAME]
    return {
        "exec": {"command": command},
        "periodSeconds": MASTER_LIVENESS_PERIOD_S,
        "timeoutSeconds": 10,
        "failureThreshold": MASTER_LIVENESS_FAILURES,
    }


def master_pod(job: Mapping[str, Any], spec: JobSpec, *, settings: OperatorSettings) -> Obj:
    """The job's master: rendezvous, membership, failure policy; state in the job's ConfigMap.

    ``spec.master.template`` places and dresses it (tolerations, nodeSelector, affinity, priorityClassName,
    imagePullSecrets, the Pod's and the container's securityContext, resources); the command, image, ports
    and volumes stay the operator's. Security fields the template leaves out get the restricted defaults.
    """
    job_name = job["metadata"]["name"]
    template = spec.master_template
    template_spec: Mapping[str, Any] = template.get("spec") or {}
    given: Mapping[str, Any] = next(iter(template_spec.get("containers") or []), {})
    container: Obj = {
        "name": "master",
        "image": settings.image,
        "command": _master_command(job, spec, settings=settings),
        "env": [_field_env("POD_IP", "status.podIP"), *_settings_env(spec, master=True)],
        "ports": [
            {"name": "grpc", "containerPort": settings.master_grpc_port},
            {"name": "http", "containerPort": settings.master_http_port},
        ],
        "volumeMounts": [dict(_TOKEN_MOUNT)],
    }
    volumes = [_token_volume(job_name)]
    if settings.metrics_token_given:
        container["volumeMounts"].append(
            {"name": "phalanx-metrics", "mountPath": METRICS_DIR, "readOnly": True}
        )
        volumes.append(
            {
                "name": "phalanx-metrics",
                "secret": {"secretName": elasticjob.metrics_secret(job_name), "defaultMode": 0o444},
            }
        )
    if settings.tls_ca_secret:
        container["volumeMounts"].append(dict(_TLS_MOUNT))
        volumes.append(_tls_volume(job_name, keys=(tls.CERT_KEY, tls.KEY_KEY, tls.CA_CERT_KEY)))
    container["livenessProbe"] = _master_liveness(settings)
    if resources_ := (given.get("resources") or spec.master_resources):
        container["resources"] = copy.deepcopy(dict(resources_))
    if given.get("securityContext"):
        container["securityContext"] = copy.deepcopy(dict(given["securityContext"]))
    pod_meta = object_meta(job, elasticjob.master(job_name), component="master")
    given_meta: Mapping[str, Any] = template.get("metadata") or {}
    pod_meta["labels"] = {**(given_meta.get("labels") or {}), **pod_meta["labels"]}
    pod_meta["annotations"] = {
        **(given_meta.get("annotations") or {}),
        names.NODES_ANNOTATION: f"{spec.min_nodes}:{spec.max_nodes}",
    }
    pod_spec: Obj = {
        "serviceAccountName": elasticjob.master(job_name),
        "restartPolicy": "Never",
        "containers": [container],
        "volumes": volumes,
    }
    for key in MASTER_POD_FIELDS:
        if template_spec.get(key):
            pod_spec[key] = copy.deepcopy(template_spec[key])
    if template_spec.get("securityContext"):
        pod_spec["securityContext"] = copy.deepcopy(dict(template_spec["securityContext"]))
    pod_spec["tolerations"] = _node_lost(pod_spec.get("tolerations") or [], settings.master_node_lost_s)
    security.pod_defaults(pod_spec)
    place(pod_spec, spec.placement.get("master"))
    return {"apiVersion": "v1", "kind": "Pod", "metadata": pod_meta, "spec": pod_spec}


NODE_LOST_TAINTS = ("node.kubernetes.io/unreachable", "node.kubernetes.io/not-ready")


def _node_lost(tolerations: list[Obj], seconds: float) -> list[Obj]:
    """The master's tolerations with a bound on how long it stays on a node that stopped answering (the
    taints the node controller puts on it): after that Kubernetes evicts it, and the operator starts a new
    master elsewhere. A bound the template gives for one of those taints is kept."""
    kept = list(tolerations)
    for key in NODE_LOST_TAINTS:
        if not any(t.get("key") == key and t.get("effect") in (None, "", "NoExecute") for t in kept):
            kept.append({"key": key, "operator": "Exists", "effect": "NoExecute",
                         "tolerationSeconds": max(1, round(seconds))})  # fmt: skip
    return kept


def _settings_env(spec: JobSpec, *, master: bool) -> list[Obj]:
    """PHALANX_* variables for settings that have no command-line flag."""
    env = {
        "PHALANX_CHECKPOINT_MEMORY_INTERVAL_STEPS": str(spec.checkpoint.memory_interval_steps),
        "PHALANX_CHECKPOINT_PERSIST_INTERVAL_STEPS": str(spec.checkpoint.persist_interval_steps),
        "PHALANX_CHECKPOINT_STORAGE_PATH": spec.checkpoint.storage_path,
        "PHALANX_CHECKPOINT_KEEP_LAST": str(spec.checkpoint.keep_last),
        "PHALANX_TENSOR_PARALLEL": str(spec.tensor),
        "PHALANX_PIPELINE_PARALLEL": str(spec.pipeline),
    }
    if master:
        env = {
            "PHALANX_RENDEZVOUS_UNIT": str(spec.rendezvous.unit),
            "PHALANX_RENDEZVOUS_LAST_CALL_S": str(spec.rendezvous.last_call_s),
            "PHALANX_RENDEZVOUS_MIN_NODES_TIMEOUT_S": str(spec.rendezvous.min_nodes_timeout_s),
            "PHALANX_HEARTBEAT_INTERVAL_S": str(spec.heartbeat.interval_s),
            "PHALANX_HEARTBEAT_TIMEOUT_S": str(spec.heartbeat.timeout_s),
            "PHALANX_RESTART_MAX_RESTARTS": str(spec.restart.max_restarts),
            "PHALANX_RESTART_MAX_EVICTIONS": str(spec.restart.max_evictions),
            "PHALANX_STATUS_PROGRESS_INTERVAL_S": str(spec.status_progress_interval_s),
            **_probe_env(spec.probes),
        }
    return [{"name": k, "value": v} for k, v in env.items()]


def _probe_env(probes: ProbeSettings) -> dict[str, str]:
    """``spec.healthChecks`` for the master (``MasterSettings.probes``); the straggler thresholds keep
    their defaults (they are relative to the job's own median), the CRD exposes only ``confirmRounds`` and
    the policy ``evictSlowNodes``."""
    return {
        "PHALANX_PROBES_ENABLED": str(probes.enabled).lower(),
        "PHALANX_PROBES_ON_ROUND_COMPLETE": str(probes.on_round_complete).lower(),
        "PHALANX_PROBES_INTERVAL_S": str(probes.interval_s),
        "PHALANX_PROBES_TIMEOUT_S": str(probes.timeout_s),
        "PHALANX_PROBES_KINDS": ",".join(probes.kind_names),
        "PHALANX_PROBES_STRAGGLERS_CONFIRM_ROUNDS": str(probes.stragglers.confirm_rounds),
        "PHALANX_PROBES_STRAGGLERS_EVICT_SLOW_NODES": str(probes.stragglers.evict_slow_nodes).lower(),
    }


_PYTHONS = ("python", "python3")


def training_entry(container: Mapping[str, Any]) -> list[str]:
    """phalanx-run's arguments for the template container's command and args.

    ``python script.py a b`` -> ``script.py a b``; ``python -m pkg.mod`` -> ``-m pkg.mod``; any other
    executable runs with ``--no-python``.
    """
    argv = [str(a) for a in [*(container.get("command") or []), *(container.get("args") or [])]]
    if not argv:
        raise ConfigError(
            "the first container of the worker template needs a command (the training script)",
            field="spec.template.spec.containers[0].command",
        )
    program = PurePosixPath(argv[0]).name
    if program in _PYTHONS or (program.startswith("python3.") and program[8:].isdigit()):
        rest = argv[1:]
        if not rest:
            raise ConfigError("python needs a script or -m module", field="spec.template.spec.containers[0]")
        return rest if rest[0] != "-m" else ["-m", *rest[1:]]
    return ["--no-python", *argv]


def _agent_command(
    job: Mapping[str, Any],
    spec: JobSpec,
    container: Mapping[str, Any],
    *,
    node_id: str,
    settings: OperatorSettings,
) -> list[str]:
    """The worker container's command: ``phalanx-run`` with the job's settings, then the training entry."""
    job_name = job["metadata"]["name"]
    r = spec.restart
    return [
        f"{settings.command_prefix}phalanx-run",
        "--nnodes", f"{spec.min_nodes}:{spec.max_nodes}",
        "--nproc-per-node", str(spec.nproc_per_node),
        "--rdzv-endpoint", supporting.master_address(job, settings=settings),
        "--rdzv-id", job_name,
        "--node-id", node_id,
        "--token-file", TOKEN_FILE,
        "--local-addr", "$(POD_IP)",
        "--max-restarts", str(r.max_restarts),
        "--grace-period", _dur(r.grace_period_s),
        "--hang-floor", _dur(spec.hang.floor_s),
        "--hang-idle-floor", _dur(spec.hang.idle_floor_s),
        "--hang-stopped", _dur(spec.hang.stopped_s),
        "--hang-factor", f"{spec.hang.factor:g}",
        "--hang-startup", _dur(spec.hang.startup_s),
        *(["--no-hang-detection"] if not spec.hang.enabled else []),
        *(["--no-instrument"] if not spec.hang.instrument else []),
        *training_entry(container),
    ]  # fmt: skip


def _worker_env(
    job: Mapping[str, Any], spec: JobSpec, *, node_id: str, settings: OperatorSettings
) -> list[Obj]:
    """Environment of the worker container besides the template's: where the agent and its node are."""
    job_name = job["metadata"]["name"]
    return [
        _field_env("POD_IP", "status.podIP"),
        _field_env("PHALANX_HOST", "status.podIP"),
        _field_env("PHALANX_MACHINE", "spec.nodeName"),
        {"name": "PHALANX_NODE_ID", "value": node_id},
        {"name": "PHALANX_JOB_ID", "value": job_name},
        # Two jobs of one name in two namespaces, or a job and a deleted one of its name, are two jobs to the
        # flash checkpoint: their files on a node and their claims on storage differ.
        _field_env("PHALANX_NAMESPACE", "metadata.namespace"),
        *([{"name": "PHALANX_JOB_UID", "value": uid}] if (uid := job["metadata"].get("uid")) else []),
        {"name": "PHALANX_TOKEN_FILE", "value": TOKEN_FILE},
        {"name": "PHALANX_MASTER_ADDR", "value": supporting.master_address(job, settings=settings)},
        *_settings_env(spec, master=False),
    ]


def worker_pod(
    job: Mapping[str, Any],
    spec: JobSpec,
    *,
    slot: int,
    incarnation: int,
    settings: OperatorSettings,
    excluded_machines: Sequence[str] = (),
) -> Obj:
    """One node of the job: the template's Pod, its first container wrapped in ``phalanx-run``."""
    meta = job["metadata"]
    job_name = meta["name"]
    name = elasticjob.worker(job_name, slot=slot, incarnation=incarnation)
    template = copy.deepcopy(dict(spec.template))
    pod_meta = template.get("metadata") or {}
    pod_spec: Obj = template["spec"]
    labels = {
        **(pod_meta.get("labels") or {}),
        **names.labels(job_name, component="worker"),
        names.SLOT_LABEL: str(slot),
        names.INCARNATION_LABEL: str(incarnation),
        names.NODE_ID_LABEL: name,
    }
    container = pod_spec["containers"][0]
    container["command"] = _agent_command(job, spec, container, node_id=name, settings=settings)
    container.pop("args", None)
    container["env"] = [
        *(container.get("env") or []),
        *_worker_env(job, spec, node_id=name, settings=settings),
    ]
    container["volumeMounts"] = [*(container.get("volumeMounts") or []), dict(_TOKEN_MOUNT)]
    # Readable whatever user the training image runs as: an fsGroup of ours would re-own the user's volumes.
    pod_spec["volumes"] = [*(pod_spec.get("volumes") or []), _token_volume(job_name)]
    if settings.tls_ca_secret:  # the CA certificate only: a worker runs the job author's code
        container["env"].append({"name": TLS_CA_ENV, "value": f"{TLS_DIR}/{tls.CA_CERT_KEY}"})
        container["volumeMounts"].append(dict(_TLS_MOUNT))
        pod_spec["volumes"].append(_tls_volume(job_name, keys=(tls.CA_CERT_KEY,)))
    if spec.shared_memory is not None:
        _shared_memory(pod_spec, spec.shared_memory)
    pod_spec["restartPolicy"] = "Never"  # a failed node is replaced by a new Pod, never restarted in place
    pod_spec.setdefault("automountServiceAccountToken", False)  # workers never call the Kubernetes API
    if pod_spec.get("hostNetwork") is True:
        # On the host's network a Pod gets the node's resolv.conf, which cannot resolve the master's
        # Service name (<job>-master.<ns>.svc): ClusterFirstWithHostNet keeps the cluster DNS.
        pod_spec.setdefault("dnsPolicy", "ClusterFirstWithHostNet")
    # A SIGTERMed agent stops its workers (up to gracePeriod), then persists its newest in-memory snapshot
    # (save at breakpoint) before it exits: spec.terminationGracePeriod covers both. The template's own
    # terminationGracePeriodSeconds still wins.
    pod_spec.setdefault("terminationGracePeriodSeconds", math.ceil(spec.termination_grace_s))
    security.pod_defaults(pod_spec)
    if excluded_machines:
        _keep_off(pod_spec, sorted(set(excluded_machines)))
    place(pod_spec, spec.placement.get("workers"))
    pod: Obj = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            **{k: v for k, v in pod_meta.items() if k in ("annotations",)},
            "name": name,
            "namespace": meta["namespace"],
            "labels": labels,
            "ownerReferences": [owner_reference(job)],
        },
        "spec": pod_spec,
    }
    if spec.gang is not None:
        gang.join(pod, elasticjob.pod_group(job_name), spec.gang)
    return pod


def _shared_memory(pod_spec: Obj, size: int) -> None:
    """A memory-backed emptyDir of ``size`` bytes at /dev/shm in every container that does not mount
    something there itself: the flash checkpoint's slots (two per rank), NCCL's shared-memory transport and
    DataLoader workers live there, and a container runtime's own /dev/shm is 64Mi. Its pages count against
    the memory limit of the container that writes them."""
    containers = [c for c in pod_spec["containers"] if not _mounts(c, SHM_PATH)]
    if not containers:
        return
    volume = {"name": SHM_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": resources.format_mib(size)}}
    pod_spec["volumes"] = [*pod_spec["volumes"], volume]
    for c in containers:
        c["volumeMounts"] = [*(c.get("volumeMounts") or []), {"name": SHM_VOLUME, "mountPath": SHM_PATH}]


def _mounts(container: Mapping[str, Any], path: str) -> bool:
    return any(str(m.get("mountPath", "")).rstrip("/") == path for m in container.get("volumeMounts") or [])


def pod_group(job: Mapping[str, Any], spec: JobSpec) -> Obj:
    """The PodGroup that gang-schedules the worker Pods (``spec.gangScheduling``): the scheduler binds none
    of them until ``minCount`` fit at once. Once placed, a group takes its members' replacements one by one
    (the scheduled ones count towards minCount). The master Pod is not a member: it holds no accelerator,
    and it must run for the job to report why it waits."""
    assert spec.gang is not None
    priority = str((spec.template.get("spec") or {}).get("priorityClassName") or "")
    return {
        "apiVersion": gang.APIS[spec.gang.scheduler].api_version,
        "kind": "PodGroup",
        "metadata": object_meta(job, elasticjob.pod_group(job["metadata"]["name"]), component="worker"),
        "spec": gang.group_spec(spec.gang, priority_class=priority),
    }


def _keep_off(pod_spec: Obj, machines: list[str]) -> None:
    """Adds a required node-affinity term keeping the Pod off the given Kubernetes nodes."""
    expr = {"key": "kubernetes.io/hostname", "operator": "NotIn", "values": machines}
    affinity = pod_spec.setdefault("affinity", {})
    node_aff = affinity.setdefault("nodeAffinity", {})
    required = node_aff.setdefault(
        "requiredDuringSchedulingIgnoredDuringExecution", {"nodeSelectorTerms": []}
    )
    terms = required.setdefault("nodeSelectorTerms", [])
    if not terms:
        terms.append({"matchExpressions": []})
    for term in terms:  # terms are ORed: every one of them must exclude the machines
        term.setdefault("matchExpressions", []).append(copy.deepcopy(expr))


def bad_node_taint() -> Obj:
    """Taint put on the Kubernetes node of an evicted worker when spec.cordonBadNodes is set."""
    return {"key": "phalanx.dev/bad-node", "value": "evicted", "effect": "NoSchedule"}


def with_bad_node_taint(taints: Sequence[Mapping[str, Any]]) -> list[Obj]:
    """A node's taints with :func:`bad_node_taint` added once (and the unset fields of each left out)."""
    taint = bad_node_taint()
    merged = [dict(t) for t in taints]
    if not any(t.get("key") == taint["key"] for t in merged):
        merged.append(taint)
    return [{k: v for k, v in t.items() if v is not None} for t in merged]
