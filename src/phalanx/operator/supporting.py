"""The objects an ElasticJob needs besides its Pods: the token Secret (and the master's metrics and TLS
Secrets), the state ConfigMap, the master's ServiceAccount, Role, RoleBinding and Service, and the
NetworkPolicies of its master and its workers. Pure builders (plain dicts, owned by the job);
:func:`supporting_objects` lists them in creation order under the operator's settings.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from phalanx.api import elasticjob
from phalanx.api.elasticjob import GROUP, PLURAL, TOKEN_KEY
from phalanx.api.errors import ConfigError
from phalanx.api.settings import OperatorSettings
from phalanx.operator import names
from phalanx.operator.meta import Obj, object_meta

METRICS_TOKEN_KEY = "token"  # noqa: S105 -- a key name, not a secret


def _secret(
    job: Mapping[str, Any], name: str, *, component: str, data: Mapping[str, str], kind: str = "Opaque"
) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": object_meta(job, name, component=component),
        "type": kind,
        "stringData": dict(data),
    }


def token_secret(job: Mapping[str, Any], *, token: str) -> Obj:
    """The job's bearer token, mounted into the master and every worker. Nothing else goes in it: a training
    script can read whatever its Pod mounts."""
    return _secret(
        job, elasticjob.token_secret(job["metadata"]["name"]), component="token", data={TOKEN_KEY: token}
    )


def metrics_secret(job: Mapping[str, Any], *, metrics_token: str) -> Obj:
    """The operator's metrics token (good for GET /metrics only, the same for every job's master, so one
    Prometheus credential scrapes them all), in a Secret of its own that only the master Pod mounts: a
    worker, which runs the job author's code, never holds a credential that opens other jobs' masters."""
    name = elasticjob.metrics_secret(job["metadata"]["name"])
    return _secret(job, name, component="master", data={METRICS_TOKEN_KEY: metrics_token})


def tls_secret(job: Mapping[str, Any], *, pems: Mapping[str, str]) -> Obj:
    """The master's certificate and key and the CA's certificate (:func:`tls.master_certificate`): the
    master Pod mounts all three, a worker Pod the CA certificate only."""
    name = elasticjob.tls_secret(job["metadata"]["name"])
    return _secret(job, name, component="master", data=pems, kind="kubernetes.io/tls")


def _ingress_policy(job: Mapping[str, Any], name: str, *, component: str, rule: Obj) -> Obj:
    """A NetworkPolicy of the job's: ingress to its ``component`` Pods by ``rule`` alone."""
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": object_meta(job, name, component=component),
        "spec": {
            "podSelector": {"matchLabels": names.selector(job["metadata"]["name"], component=component)},
            "policyTypes": ["Ingress"],
            "ingress": [rule],
        },
    }


def _the_jobs_pods(job_name: str) -> Obj:
    """The job's own Pods (same namespace, the phalanx.dev/job label, which the operator sets on every Pod
    it makes and a template cannot change)."""
    return {"podSelector": {"matchLabels": {names.JOB_LABEL: job_name}}}


def master_network_policy(job: Mapping[str, Any], *, settings: OperatorSettings) -> Obj:
    """Ingress to the master's gRPC and HTTP ports from the job's own Pods and from the Pods of
    ``settings.monitoring_namespace``; nothing else reaches the master."""
    job_name = job["metadata"]["name"]
    peers: list[Obj] = [_the_jobs_pods(job_name)]
    if monitoring := settings.monitoring_namespace:
        peers.append({"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": monitoring}}})
    ports = [settings.master_grpc_port, settings.master_http_port]
    rule = {"from": peers, "ports": [{"protocol": "TCP", "port": port} for port in ports]}
    return _ingress_policy(job, elasticjob.network_policy(job_name), component="master", rule=rule)


def workers_network_policy(job: Mapping[str, Any]) -> Obj:
    """Ingress to the job's worker Pods, on every port, from the job's own Pods only: the rendezvous and
    probe stores a rank-0 worker serves (torch's TCPStore, which authenticates nobody) and the collectives'
    ports are the job's alone. Pods on the host's network are outside any NetworkPolicy."""
    job_name = job["metadata"]["name"]
    rule = {"from": [_the_jobs_pods(job_name)]}
    return _ingress_policy(job, elasticjob.workers_network_policy(job_name), component="worker", rule=rule)


def state_config_map(job: Mapping[str, Any]) -> Obj:
    """Holds the master's durable state (written by phalanx.master.store.kube), so a new master Pod
    resumes."""
    job_name = job["metadata"]["name"]
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": object_meta(job, elasticjob.state_config_map(job_name), component="master"),
        "data": {},
    }


def master_service_account(job: Mapping[str, Any]) -> Obj:
    job_name = job["metadata"]["name"]
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": object_meta(job, elasticjob.master(job_name), component="master"),
    }


def master_role(job: Mapping[str, Any]) -> Obj:
    """The master may touch only its own ElasticJob, its state ConfigMap, and write Events."""
    job_name = job["metadata"]["name"]
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": object_meta(job, elasticjob.master(job_name), component="master"),
        "rules": [
            # Read and watch its own job (spec.suspend, the generation). The API server authorizes a list
            # or watch under resourceNames only when it names that one object (fieldSelector
            # metadata.name=<job>), so this opens no other job of the namespace.
            {
                "apiGroups": [GROUP],
                "resources": [PLURAL],
                "resourceNames": [job_name],
                "verbs": ["get", "list", "watch"],
            },
            # Publish observations and eviction requests into the status.
            {
                "apiGroups": [GROUP],
                "resources": [f"{PLURAL}/status"],
                "resourceNames": [job_name],
                "verbs": ["get", "patch", "update"],
            },
            # Its durable state, so a replacement master Pod resumes the job.
            {
                "apiGroups": [""],
                "resources": ["configmaps"],
                "resourceNames": [elasticjob.state_config_map(job_name)],
                "verbs": ["get", "update", "patch"],
            },
            # Events tell the story of the job (`kubectl describe ej`).
            {"apiGroups": ["", "events.k8s.io"], "resources": ["events"], "verbs": ["create", "patch"]},
        ],
    }


def master_role_binding(job: Mapping[str, Any]) -> Obj:
    job_name = job["metadata"]["name"]
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": object_meta(job, elasticjob.master(job_name), component="master"),
        "roleRef": {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "Role",
            "name": elasticjob.master(job_name),
        },
        "subjects": [
            {
                "kind": "ServiceAccount",
                "name": elasticjob.master(job_name),
                "namespace": job["metadata"]["namespace"],
            }
        ],
    }


def master_service(job: Mapping[str, Any], *, settings: OperatorSettings) -> Obj:
    job_name = job["metadata"]["name"]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": object_meta(job, elasticjob.master(job_name), component="master"),
        "spec": {
            "selector": names.selector(job_name, component="master"),
            "ports": [
                {"name": "grpc", "port": settings.master_grpc_port, "targetPort": settings.master_grpc_port},
                {"name": "http", "port": settings.master_http_port, "targetPort": settings.master_http_port},
            ],
        },
    }


def master_address(job: Mapping[str, Any], *, settings: OperatorSettings) -> str:
    """host:port of the master's gRPC service, by the Service's DNS name."""
    meta = job["metadata"]
    return f"{elasticjob.master(meta['name'])}.{meta['namespace']}.svc:{settings.master_grpc_port}"


def supporting_objects(
    job: Mapping[str, Any],
    *,
    settings: OperatorSettings,
    token: str,
    metrics_token: str = "",
    tls_pems: Mapping[str, str] | None = None,
) -> list[dict[str, Any]]:
    """The objects the job needs besides its Pods, in creation order (the Role before its binding).
    ``tls_pems``: the job's certificate (:mod:`phalanx.operator.tls`), needed only when its Secret is to be
    made."""
    objects = [token_secret(job, token=token)]
    if metrics_token:
        objects.append(metrics_secret(job, metrics_token=metrics_token))
    if settings.tls_ca_secret:
        objects.append(tls_secret(job, pems=tls_pems or {}))
    objects += [
        state_config_map(job),
        master_service_account(job),
        master_role(job),
        master_role_binding(job),
        master_service(job, settings=settings),
    ]
    if settings.network_policy:
        objects += [master_network_policy(job, settings=settings), workers_network_policy(job)]
    return objects


def supporting_names(objects: Sequence[Mapping[str, Any]]) -> list[tuple[str, str]]:
    """(kind, name) of each object, as :attr:`Observed.existing` lists them."""
    return [(str(o["kind"]), str(o["metadata"]["name"])) for o in objects]


def read_metrics_token(path: str) -> str:
    """The metrics token from ``path`` ("" without a path); a clear error, naming the setting, when it
    cannot be read or is not one token. Never logged."""
    if not path:
        return ""
    try:
        token = Path(path).read_text().strip()
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}", field="metrics_token_file") from exc
    if len(token) < 16 or any(c.isspace() for c in token):
        raise ConfigError(
            f"{path} must hold one token of at least 16 characters without spaces", field="metrics_token_file"
        )
    return token
