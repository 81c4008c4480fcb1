"""The master's Kubernetes side: durable state in a ConfigMap, the job status in the ElasticJob.

``phalanx master --state k8s://NAMESPACE/NAME`` uses:

* :func:`state_store` -- the durable state as JSON under ``state.json`` in the ConfigMap
  ``<NAME>-master-state``, which the operator creates (owned by the job) before the master Pod. One PATCH
  per save, so a save is atomic: a master killed mid-save leaves the previous state. A replacement master
  Pod loads it and resumes the job, and from then on holds it: the master it replaced is fenced
  (:class:`ConfigMapStateStore`).
* :func:`status_sink` -- maps the master's ``/v1/job`` JSON onto the ElasticJob's status subresource
  (round, worldSize, step, lastCommittedCheckpointStep, restartCount, evictions and ``status.master``).
  The operator reads ``status.evictions`` and carries them out, and ends the job on
  ``status.master.phase``. A change of anything but the step is patched at once; the step alone at most
  every ``status_progress_interval_s`` (10 s; :func:`publish_decision`), so a training job costs a few
  PATCHes a minute instead of one per heartbeat.
* the sink follows ``spec.suspend``, the job's generation and the operator's scheduled-workers annotation
  through a watch of the one ElasticJob (:class:`phalanx.master.store.kube_watch.JobWatch`: a LIST and a WATCH
  with the field selector ``metadata.name=<job>``, resumed from the last resourceVersion, listed again on
  ``410 Gone``), so a spec change reaches the master within a second and an idle job costs no reads. A
  suspended master publishes phase ``Suspended`` and the generation it follows
  (``status.master.observedGeneration``), which together tell the operator it may delete the worker Pods.
  While the watch is down, or refused (a Role made by an older operator), the spec is read by a GET every
  :data:`SPEC_POLL_S` instead.

The master's RBAC (built by the operator) allows exactly this: get/list/watch of its own ElasticJob (list
and watch only with the field selector on its name), get/patch of its status and of its own ConfigMap (by
resourceName), and Events. Credentials come from the Pod's service account (in-cluster config); outside a
Pod, from ``$KUBECONFIG``.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import secrets
import threading
import time
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from phalanx.api import elasticjob as ej
from phalanx.api import views
from phalanx.api.elasticjob import GROUP, PLURAL, SCHEDULED_ANNOTATION, STATE_KEY, VERSION
from phalanx.api.errors import KubernetesError, MasterFenced, StateStoreError
from phalanx.master.store.kube_watch import SPEC_POLL_S, JobWatch
from phalanx.master.store.stores import SpecView

log = logging.getLogger("phalanx.master")

_MAX_TEXT = 32000  # CRD maxLength of status.master.reason is 32768
STATE_REQUEST_TIMEOUT_S = 10.0
"""A read or write of the state ConfigMap that takes longer fails (a master cut off from the API server must
notice, not wait on a dead connection)."""
HOLDER_ANNOTATION = "phalanx.dev/master-holder"
"""On the state ConfigMap: the id of the master that holds the job's state (:class:`ConfigMapStateStore`)."""
CLAIM_ATTEMPTS = 5
RETRY_PUBLISH_S = 1.0  # a failed PATCH is retried this long after (on the publisher's next spec() call)

__all__ = [
    "ConfigMapStateStore",
    "ElasticJobStatusSink",
    "parse_state_url",
    "publish_decision",
    "state_store",
    "status_sink",
]


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
    """The master's durable state in the ConfigMap ``<job>-master-state``, held by one master at a time.

    A master that starts *claims* the state: it writes its own random id into the ConfigMap's annotation
    :data:`HOLDER_ANNOTATION`, and every save it makes is conditional on the ConfigMap being as it last wrote
    it (its resourceVersion). A replacement master (started while the old one's node stopped answering, the
    old process perhaps still running) claims it in turn: from then on each of the old master's saves fails
    with a conflict, and on the re-read it finds another holder and raises :class:`MasterFenced`, as its
    periodic :meth:`holds` does; it stops without writing anything more
    (:mod:`phalanx.master.serve.runtime`)."""

    def __init__(self, *, namespace: str, name: str, api: Any | None = None, holder: str = "") -> None:
        from kubernetes import client

        self.namespace = namespace
        self.config_map = ej.state_config_map(name)
        self.holder = holder or secrets.token_hex(8)
        self._core = client.CoreV1Api(api or _api_client())
        self._version = ""

    def _read(self) -> Any:
        from kubernetes.client.exceptions import ApiException

        try:
            return self._core.read_namespaced_config_map(
                self.config_map, self.namespace, _request_timeout=STATE_REQUEST_TIMEOUT_S
            )
        except ApiException as exc:
            _fenced_if_revoked(exc)
            if exc.status == 404:
                raise StateStoreError(
                    f"the state ConfigMap {self.namespace}/{self.config_map} does not exist; "
                    "the operator creates it before the master Pod"
                ) from exc
            raise StateStoreError(f"cannot read {self.namespace}/{self.config_map}: {exc.reason}") from exc

    def load(self) -> dict[str, Any] | None:
        """The saved state, after claiming it for this master."""
        cm = self._claim()
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

    def _claim(self) -> Any:
        """Writes this master's id as the holder, on the ConfigMap as read (a newer master always wins)."""
        for _ in range(CLAIM_ATTEMPTS):
            cm = self._read()
            body = {"metadata": {"resourceVersion": cm.metadata.resource_version,
                                 "annotations": {HOLDER_ANNOTATION: self.holder}}}  # fmt: skip
            if (claimed := self._patch(body)) is not None:
                log.info("holds the job's state as %s", self.holder)
                return claimed
        raise StateStoreError(f"cannot claim {self.namespace}/{self.config_map}: it changes under each claim")

    def _patch(self, body: dict[str, Any]) -> Any:
        """Patches the ConfigMap, conditional on the resourceVersion in ``body``; None on a conflict."""
        from kubernetes.client.exceptions import ApiException

        try:
            patched: Any = self._core.patch_namespaced_config_map(
                self.config_map, self.namespace, body, _request_timeout=STATE_REQUEST_TIMEOUT_S
            )
        except ApiException as exc:
            _fenced_if_revoked(exc)
            if exc.status == 409:
                return None
            raise StateStoreError(f"cannot write {self.namespace}/{self.config_map}: {exc.reason}") from exc
        self._version = str(patched.metadata.resource_version)
        return patched

    def save(self, state: Mapping[str, Any]) -> None:
        data = {STATE_KEY: json.dumps(state, separators=(",", ":"), sort_keys=True)}
        for _ in range(CLAIM_ATTEMPTS):
            if self._patch({"metadata": {"resourceVersion": self._version}, "data": data}) is not None:
                return
            cm = self._read()  # changed since this master's last write: by another master, or by someone else
            self._fenced_unless_held(cm)
            self._version = str(cm.metadata.resource_version)
        raise StateStoreError(f"cannot write {self.namespace}/{self.config_map}: it changes under every save")

    def holds(self) -> bool:
        cm = self._read()
        return _holder(cm) == self.holder

    def _fenced_unless_held(self, cm: Any) -> None:
        if (holder := _holder(cm)) != self.holder:
            raise MasterFenced(
                f"master {holder or '(none)'} took over {self.namespace}/{self.config_map} from this one "
                f"({self.holder})"
            )


def _fenced_if_revoked(exc: Any) -> None:
    """A master's credentials are its Pod's ServiceAccount token, bound to that Pod: the API server refuses
    it (401) once the Pod is deleted, which is how a master on a node that stopped answering is replaced
    (force-deleted, then created anew). Such a master can no longer read who holds the state; it has been
    replaced, and stops as if it had read so."""
    if exc.status == 401:
        raise MasterFenced(
            "the API server no longer accepts this master's credentials (401 Unauthorized): its Pod was "
            "deleted, and a replacement holds the job's state"
        ) from exc


def _holder(cm: Any) -> str:
    return str((cm.metadata.annotations or {}).get(HOLDER_ANNOTATION) or "")


def scheduled_workers(meta: Mapping[str, Any]) -> int | None:
    """The operator's count of the job's worker Pods placed on a node (None: not said, or not a count)."""
    value = (meta.get("annotations") or {}).get(SCHEDULED_ANNOTATION)
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def job_status_patch(status: views.JobView) -> dict[str, Any]:
    """Maps the master's ``/v1/job`` view onto ElasticJob status fields (pure; unit-tested)."""
    evictions = [
        {
            ej.EVICTION_NODE_ID: e.node_id,
            ej.EVICTION_MACHINE: e.machine,
            ej.EVICTION_REASON: e.reason[:_MAX_TEXT],
            ej.EVICTION_REQUESTED_AT: _rfc3339(e.requested_at),
        }
        for e in status.evictions
        if e.node_id
    ]
    patch: dict[str, Any] = {
        ej.STATUS_ROUND: status.round,
        ej.STATUS_WORLD_SIZE: status.world_size,
        ej.STATUS_RESTART_COUNT: status.restart_count,
        ej.STATUS_EVICTIONS: evictions,
        ej.STATUS_MASTER: {
            ej.MASTER_PHASE: str(status.phase),
            ej.MASTER_REASON: status.reason[:_MAX_TEXT],
            ej.MASTER_MEMBERS: list(status.members),
            ej.MASTER_OBSERVED_GENERATION: status.spec_generation,
            ej.MASTER_UPDATED_AT: _rfc3339(datetime.now(tz=UTC).timestamp()),
        },
    }
    if status.max_step >= 0:
        patch[ej.STATUS_STEP] = status.max_step
    if status.committed_checkpoint_step >= 0:
        patch[ej.STATUS_COMMITTED_STEP] = status.committed_checkpoint_step
    return patch


PROGRESS_FIELDS = frozenset({ej.STATUS_STEP})
"""Status fields that only tell how far training got: coalesced to one PATCH per progress interval."""


def _urgent_part(patch: Mapping[str, Any]) -> dict[str, Any]:
    """The patch without progress and without ``master.updatedAt`` (which changes on every patch)."""
    out = {k: v for k, v in patch.items() if k not in PROGRESS_FIELDS}
    if isinstance(master := out.get(ej.STATUS_MASTER), Mapping):
        out[ej.STATUS_MASTER] = {k: v for k, v in master.items() if k != ej.MASTER_UPDATED_AT}
    return out


def publish_decision(
    published: Mapping[str, Any] | None,
    patch: Mapping[str, Any],
    *,
    elapsed_s: float,
    progress_interval_s: float,
) -> str:
    """Whether ``patch`` goes out ``"now"``, ``"later"`` (progress only, within the interval) or is
    ``"unchanged"`` against the last patch the API server accepted, ``elapsed_s`` ago (pure).

    Everything but progress publishes at once: the operator acts on ``status.evictions`` (it deletes the
    Pod), on ``master.phase`` (it ends the job) and on ``master.observedGeneration`` with phase Suspended
    (the suspend handshake: only then does it delete the worker Pods), and a new round or a committed
    checkpoint is what a user watching the job waits for. Holding any of them back would slow a recovery
    or a suspension by up to the interval; the step alone can wait."""
    if published is None or _urgent_part(published) != _urgent_part(patch):
        return "now"
    if all(published.get(k) == patch.get(k) for k in PROGRESS_FIELDS):
        return "unchanged"
    return "now" if elapsed_s >= progress_interval_s else "later"


def newer(version: str, than: str) -> bool:
    """True when resourceVersion ``version`` is newer than ``than``. Versions are opaque to clients, but
    the API server (etcd's revision) issues increasing integers; anything else counts as newer."""
    try:
        return int(version) > int(than)
    except ValueError:
        return True


class ElasticJobStatusSink:
    """Publishes the master's view into the ElasticJob's status subresource (a merge patch), coalescing
    progress (see :func:`publish_decision`), and follows the job's spec through a :class:`JobWatch`."""

    def __init__(
        self,
        *,
        namespace: str,
        name: str,
        api: Any | None = None,
        progress_interval_s: float = 10.0,
        watch: bool = True,
        resume_from: str = "",
    ) -> None:
        from kubernetes import client

        self.namespace = namespace
        self.name = name
        self.progress_interval_s = progress_interval_s
        self._custom = client.CustomObjectsApi(api or _api_client())
        self._lock = threading.Lock()
        self._view: SpecView | None = None
        self._view_version = ""
        self._read_at = float("-inf")
        self._published: dict[str, Any] | None = None
        self._published_at = float("-inf")
        self._pending: dict[str, Any] | None = None
        self._retry_at = float("-inf")
        self.patches = 0
        self.gets = 0
        self.watch: JobWatch | None = None
        if watch:
            self.watch = JobWatch(
                self._custom,
                namespace=namespace,
                name=name,
                on_object=self._saw,
                resource_version=resume_from,
            ).start()

    def close(self) -> None:
        if self.watch is not None:
            self.watch.stop()

    def _saw(self, job: Any) -> None:
        """Takes the spec from a version of the job (a watch event, a PATCH's answer, a GET), unless an
        newer version was seen already (a PATCH's answer can arrive after a later watch event)."""
        spec = job.get("spec") if isinstance(job, Mapping) else None
        meta = job.get("metadata") if isinstance(job, Mapping) else None
        if not (isinstance(spec, Mapping) and isinstance(meta, Mapping)):
            return
        version = str(meta.get("resourceVersion") or "")
        with self._lock:
            if version and self._view_version and not newer(version, self._view_version):
                return
            self._view = SpecView(
                suspend=bool(spec.get("suspend", False)),
                generation=int(meta["generation"]),
                scheduled_workers=scheduled_workers(meta),
            )
            self._view_version = version
            self._read_at = time.monotonic()

    def publish(self, status: views.JobView) -> None:
        patch = job_status_patch(status)
        with self._lock:
            decision = publish_decision(
                self._published,
                patch,
                elapsed_s=time.monotonic() - self._published_at,
                progress_interval_s=self.progress_interval_s,
            )
            if decision == "later":
                self._pending = patch  # sent by spec() once the interval is over
                return
            self._pending = None  # superseded: this patch holds everything a held-back one had
            if decision == "unchanged":
                return
        self._send(patch)

    def _send(self, patch: dict[str, Any]) -> None:
        from kubernetes.client.exceptions import ApiException

        try:
            job = self._custom.patch_namespaced_custom_object_status(
                GROUP, VERSION, self.namespace, PLURAL, self.name, {"status": patch}, _request_timeout=30
            )
        except ApiException as exc:
            with self._lock:  # kept: retried after RETRY_PUBLISH_S, also when nothing changes meanwhile
                self._pending, self._retry_at = patch, time.monotonic() + RETRY_PUBLISH_S
            raise KubernetesError(
                f"cannot publish the status of ElasticJob {self.namespace}/{self.name}: {exc.reason}"
            ) from exc
        with self._lock:
            self.patches += 1
            self._published, self._published_at = patch, time.monotonic()
            if self._pending is patch:
                self._pending = None
        self._saw(job)

    def flush_due(self) -> None:
        """Sends the held-back progress once the interval is over (and a failed PATCH once its retry is
        due). The master's publisher calls :meth:`spec` every half second, which calls this, so the last
        step of a stretch without other changes is never held back longer than the interval."""
        now = time.monotonic()
        with self._lock:
            pending = self._pending
            due = (
                pending is not None
                and now >= self._retry_at
                and (
                    now - self._published_at >= self.progress_interval_s
                    or self._published is None
                    or _urgent_part(self._published) != _urgent_part(pending)
                )
            )
        if due and pending is not None:
            try:
                self._send(pending)
            except KubernetesError as exc:
                log.warning("%s; retrying in %.0fs", exc, RETRY_PUBLISH_S)

    def flush_pending(self) -> None:
        """Sends held-back progress now, whatever the interval: at the master's exit, so a stopped master
        leaves its last step in the status."""
        with self._lock:
            pending = self._pending
        if pending is not None:
            try:
                self._send(pending)
            except KubernetesError as exc:
                log.warning("%s (at exit)", exc)

    def spec(self) -> SpecView | None:
        """The spec as the watch last saw it (spec changes arrive within a second). While the watch is
        down, or not allowed, a GET every :data:`SPEC_POLL_S` keeps it at most that stale."""
        from kubernetes.client.exceptions import ApiException

        self.flush_due()
        watching = self.watch is not None and self.watch.connected and self._view is not None
        if not watching and time.monotonic() - self._read_at >= SPEC_POLL_S:
            self._read_at = time.monotonic()  # a failing GET is retried at the same pace, not on every call
            try:
                job = self._custom.get_namespaced_custom_object(
                    GROUP, VERSION, self.namespace, PLURAL, self.name
                )
                self.gets += 1
                self._saw(job)
            except ApiException as exc:
                raise KubernetesError(
                    f"cannot read the spec of ElasticJob {self.namespace}/{self.name}: {exc.reason}"
                ) from exc
        return self._view


def state_store(*, namespace: str, name: str) -> ConfigMapStateStore:
    """The StateStore of job ``namespace/name`` (see phalanx.master.store.stores.StateStore)."""
    return ConfigMapStateStore(namespace=namespace, name=name)


def status_sink(*, namespace: str, name: str, progress_interval_s: float = 10.0) -> ElasticJobStatusSink:
    """The StatusSink of job ``namespace/name`` (see phalanx.master.store.stores.StatusSink), for this
    process:
    progress it still holds back is sent when the process exits."""
    sink = ElasticJobStatusSink(namespace=namespace, name=name, progress_interval_s=progress_interval_s)
    atexit.register(sink.flush_pending)
    return sink


def in_cluster() -> bool:
    """True inside a Pod (the API server's address is in the environment)."""
    return bool(os.environ.get("KUBERNETES_SERVICE_HOST"))
