"""The master's Kubernetes side: durable state in a ConfigMap, the job status in the ElasticJob.

``phalanx master --state k8s://NAMESPACE/NAME`` uses:

* :func:`state_store` -- the durable state as JSON under ``state.json`` in the ConfigMap
  ``<NAME>-master-state``, which the operator creates (owned by the job) before the master Pod. One PATCH
  per save, so a save is atomic: a master killed mid-save leaves the previous state. A replacement master
  Pod loads it and resumes the job.
* :func:`status_sink` -- maps the master's ``/v1/job`` JSON onto the ElasticJob's status subresource
  (round, worldSize, step, lastCommittedCheckpointStep, restartCount, evictions and ``status.master``).
  The operator reads ``status.evictions`` and carries them out, and ends the job on
  ``status.master.phase``. It also reads back ``spec.suspend`` and the job's generation (from each
  PATCH's answer, else by a GET every :data:`SPEC_POLL_S`): a suspended master publishes phase
  ``Suspended`` and the generation it follows (``status.master.observedGeneration``), which together tell
  the operator it may delete the worker Pods.

The master's RBAC (built by the operator) allows exactly this: get/patch of its own ElasticJob status and
its own ConfigMap (by resourceName), and Events. Credentials come from the Pod's service account
(in-cluster config); outside a Pod, from ``$KUBECONFIG``.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from phalanx.api.errors import KubernetesError, StateStoreError
from phalanx.master.state import SpecView

GROUP = "phalanx.dev"
VERSION = "v1alpha1"
PLURAL = "elasticjobs"
STATE_KEY = "state.json"
_MAX_TEXT = 32000  # CRD maxLength of status.master.reason is 32768
SPEC_POLL_S = 2.0  # how stale the spec's suspend may be when no status was published meanwhile

__all__ = ["ConfigMapStateStore", "ElasticJobStatusSink", "parse_state_url", "state_store", "status_sink"]


def parse_state_url(url: str) -> tuple[str, str]:
    """``k8s://NAMESPACE/NAME`` -> (namespace, name)."""
    rest = url.removeprefix("k8s://")
    namespace, _, name = rest.partition("/")
    if not url.startswith("k8s://") or not namespace or not name or "/" in name:
        raise StateStoreError(f"expected --state k8s://NAMESPACE/NAME, got {url!r}")
    return namespace, name


def _api_client() -> Any:
    from kubernetes import client, config

    try:
        config.load_incluster_config()  # type: ignore[no-untyped-call]
    except config.ConfigException:
        try:
            config.load_kube_config()  # type: ignore[no-untyped-call]
        except (config.ConfigException, OSError) as exc:
            raise KubernetesError(
                "no Kubernetes credentials: not in a Pod with a service account, and no usable $KUBECONFIG"
            ) from exc
    return client.ApiClient()


def _rfc3339(value: Any) -> str:
    if isinstance(value, int | float):
        return datetime.fromtimestamp(float(value), tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return str(value or "")


class ConfigMapStateStore:
    """The master's durable state in the ConfigMap ``<job>-master-state``."""

    def __init__(self, *, namespace: str, name: str, api: Any | None = None) -> None:
        from kubernetes import client

        self.namespace = namespace
        self.config_map = f"{name}-master-state"
        self._core = client.CoreV1Api(api or _api_client())

    def load(self) -> dict[str, Any] | None:
        from kubernetes.client.exceptions import ApiException

        try:
            cm = self._core.read_namespaced_config_map(self.config_map, self.namespace)
        except ApiException as exc:
            if exc.status == 404:
                raise StateStoreError(
                    f"the state ConfigMap {self.namespace}/{self.config_map} does not exist; "
                    "the operator creates it before the master Pod"
                ) from exc
            raise StateStoreError(f"cannot read {self.namespace}/{self.config_map}: {exc.reason}") from exc
        text = (cm.data or {}).get(STATE_KEY)
        if not text:
            return None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise StateStoreError(f"{self.namespace}/{self.config_map} holds invalid JSON") from exc
        if not isinstance(data, dict):
            raise StateStoreError(f"{self.namespace}/{self.config_map} does not hold a JSON object")
        return data

    def save(self, state: Mapping[str, Any]) -> None:
        from kubernetes.client.exceptions import ApiException

        body = {"data": {STATE_KEY: json.dumps(state, separators=(",", ":"), sort_keys=True)}}
        try:
            self._core.patch_namespaced_config_map(self.config_map, self.namespace, body)
        except ApiException as exc:
            raise StateStoreError(f"cannot write {self.namespace}/{self.config_map}: {exc.reason}") from exc


SCHEDULED_ANNOTATION = "phalanx.dev/scheduled-workers"


def scheduled_workers(meta: Mapping[str, Any]) -> int | None:
    """The operator's count of the job's worker Pods placed on a node (None: not said, or not a count)."""
    value = (meta.get("annotations") or {}).get(SCHEDULED_ANNOTATION)
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def job_status_patch(status: Mapping[str, Any]) -> dict[str, Any]:
    """Maps the master's ``/v1/job`` JSON onto ElasticJob status fields (pure; unit-tested)."""
    evictions = [
        {
            "nodeId": str(e.get("node_id", "")),
            "machine": str(e.get("machine", "") or ""),
            "reason": str(e.get("reason", ""))[:_MAX_TEXT],
            "requestedAt": _rfc3339(e.get("requested_at")),
        }
        for e in status.get("evictions") or []
        if isinstance(e, Mapping) and e.get("node_id")
    ]
    patch: dict[str, Any] = {
        "round": int(status.get("round") or 0),
        "worldSize": int(status.get("world_size") or 0),
        "restartCount": int(status.get("restart_count") or 0),
        "evictions": evictions,
        "master": {
            "phase": str(status.get("phase", "")),
            "reason": str(status.get("reason") or "")[:_MAX_TEXT],
            "members": [str(m) for m in status.get("members") or []],
            "observedGeneration": int(status.get("spec_generation") or 0),
            "updatedAt": _rfc3339(datetime.now(tz=UTC).timestamp()),
        },
    }
    step = status.get("max_step")
    if isinstance(step, int) and step >= 0:
        patch["step"] = step
    committed = status.get("committed_checkpoint_step")
    if isinstance(committed, int) and committed >= 0:
        patch["lastCommittedCheckpointStep"] = committed
    return patch


class ElasticJobStatusSink:
    """Publishes the master's view into the ElasticJob's status subresource (a merge patch)."""

    def __init__(self, *, namespace: str, name: str, api: Any | None = None) -> None:
        from kubernetes import client

        self.namespace = namespace
        self.name = name
        self._custom = client.CustomObjectsApi(api or _api_client())
        self._view: SpecView | None = None
        self._read_at = float("-inf")

    def _saw(self, job: Any) -> None:
        spec = job.get("spec") if isinstance(job, Mapping) else None
        meta = job.get("metadata") if isinstance(job, Mapping) else None
        if isinstance(spec, Mapping) and isinstance(meta, Mapping):
            self._view = SpecView(
                suspend=bool(spec.get("suspend", False)),
                generation=int(meta["generation"]),
                scheduled_workers=scheduled_workers(meta),
            )
            self._read_at = time.monotonic()

    def publish(self, status: Mapping[str, Any]) -> None:
        from kubernetes.client.exceptions import ApiException

        body = {"status": job_status_patch(status)}
        try:
            job = self._custom.patch_namespaced_custom_object_status(
                GROUP, VERSION, self.namespace, PLURAL, self.name, body
            )
        except ApiException as exc:
            raise KubernetesError(
                f"cannot publish the status of ElasticJob {self.namespace}/{self.name}: {exc.reason}"
            ) from exc
        self._saw(job)

    def spec(self) -> SpecView | None:
        """The spec as of at most :data:`SPEC_POLL_S` ago (a GET when no publish read it since)."""
        from kubernetes.client.exceptions import ApiException

        if time.monotonic() - self._read_at >= SPEC_POLL_S:
            self._read_at = time.monotonic()  # a failing GET is retried at the same pace, not on every call
            try:
                self._saw(self._custom.get_namespaced_custom_object(
                    GROUP, VERSION, self.namespace, PLURAL, self.name
                ))  # fmt: skip
            except ApiException as exc:
                raise KubernetesError(
                    f"cannot read the spec of ElasticJob {self.namespace}/{self.name}: {exc.reason}"
                ) from exc
        return self._view


def state_store(*, namespace: str, name: str) -> ConfigMapStateStore:
    """The StateStore of job ``namespace/name`` (see phalanx.master.state.StateStore)."""
    return ConfigMapStateStore(namespace=namespace, name=name)


def status_sink(*, namespace: str, name: str) -> ElasticJobStatusSink:
    """The StatusSink of job ``namespace/name`` (see phalanx.master.state.StatusSink)."""
    return ElasticJobStatusSink(namespace=namespace, name=name)


def in_cluster() -> bool:
    """True inside a Pod (the API server's address is in the environment)."""
    return bool(os.environ.get("KUBERNETES_SERVICE_HOST"))
