"""When to reconcile, on kopf: kopf lists and watches the ElasticJobs, the operator's Pods and, where Kueue
serves them, the jobs' Workloads, keeps each kind in an index, and calls an event handler on every change.
A handler only asks for a pass of the executor; the decision is
:func:`phalanx.operator.reconcile.reconcile`, and the state it sees is kopf's indices with the operator's own
writes laid over them (:mod:`phalanx.operator.memory`).

Level based: every job is reconciled every ``reconcile_interval_s`` whatever events were missed (an
operator restarted mid-job, or a new leader, simply continues); a change of a job or of one of its Pods
triggers a pass at once. A pass reads memory only, so the periodic passes cost the API server nothing.

What kopf is asked for, and what it is not (docs/operator.md says why):

- **Indices and event handlers only.** They store nothing on the objects: no annotation, no finalizer
  (kopf's timers and daemons would put a finalizer on every job; the periodic round here needs none).
  Deleting an ElasticJob never waits for a live operator: what it owns carries an ownerReference, and
  Kubernetes' garbage collector removes it. The finalizer older versions put on jobs is taken off.
- **No pass before everything is listed.** kopf calls no handler before every index is filled; the periodic
  round starts at the first handler call of each kopf run (:attr:`Reconciler.listed`).
- **The Pods by label, on the server** (``settings.watching.label_selectors``): never every Pod of the
  cluster.
- **A silent watch is reopened** (``settings.watching.inactivity_timeout``: the API server sends a bookmark
  every minute, so a stream silent for longer has stalled).
- **Ghosts**: an object deleted while a watch was broken, and missing from kopf's re-list after ``410 Gone``,
  stays in kopf's index. A LIST of metadata made after a re-list is seen (and every
  :data:`GHOST_SWEEP_S` whatever was seen) takes such objects out of the memory.
- **kopf runs on the leader only** and standalone (no peering: a Lease with fencing, :mod:`.leader`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable, Hashable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

import kopf

from phalanx.api.elasticjob import GROUP, PLURAL, VERSION
from phalanx.api.settings import OperatorSettings
from phalanx.operator import kueue, names
from phalanx.operator.executor import Executor
from phalanx.operator.memory import Ident, KindMemory, ident_of, version_of
from phalanx.operator.observe import METADATA_LIST, pod_from_dict

log = logging.getLogger("phalanx.operator")

LEGACY_FINALIZER = f"{GROUP}/operator"
"""The finalizer kopf kept on every job in older versions (their timers needed it); the first pass that sees
it takes it off."""
PASS_WORKERS = 8
GHOST_SWEEP_S = 300.0
"""The longest a ghost (see above) stays in memory when no re-list was seen."""
SWEEP_DELAY_S = 2.0
"""How long after a re-list is seen its sweep runs: the re-list's other objects arrive meanwhile."""
WATCH_TIMEOUT_S = 300
"""The server ends each watch after this long; kopf reconnects from where it was (no LIST)."""

MANAGED = {"app.kubernetes.io/managed-by": names.MANAGED_BY}
MANAGED_SELECTOR = f"app.kubernetes.io/managed-by={names.MANAGED_BY}"
Resource = tuple[str, str] | tuple[str, str, str]
"""What kopf's decorators take: (group, version, plural), or ("v1", plural) for the core API."""
JOBS = (GROUP, VERSION, PLURAL)
PODS = ("v1", "pods")
WORKLOADS = (kueue.GROUP, kueue.VERSION, kueue.WORKLOADS)


def pod_key(meta: dict[str, Any]) -> Hashable | None:
    job = meta["labels"].get(names.JOB_LABEL)
    return (meta["namespace"], job) if job else None


def job_key(meta: dict[str, Any]) -> Hashable | None:
    return (meta["namespace"], meta["name"])


class Kind:
    """One kind kopf watches: its resource, its memory and, for Pods and Workloads, the label that makes an
    object the operator's (on the server) and the label that names the job (in the handlers)."""

    def __init__(self, resource: Resource, memory: KindMemory, *, selector: str = "") -> None:
        self.resource, self.memory, self.selector = resource, memory, selector
        self.index_id = f"phalanx_{memory.kind}"
        self.labels: dict[str, Any] = {**MANAGED, names.JOB_LABEL: kopf.PRESENT} if selector else {}

    def job_of(self, raw: Mapping[str, Any]) -> Ident | None:
        meta = raw.get("metadata") or {}
        if not self.selector:
            return (meta.get("namespace", ""), meta.get("name", ""))
        job = (meta.get("labels") or {}).get(names.JOB_LABEL)
        return (meta.get("namespace", ""), job) if job else None


class Reconciler:
    """Runs kopf (on the leader) and the passes: on changes, and for every job every interval."""

    def __init__(self, *, executor: Executor, settings: OperatorSettings) -> None:
        self.executor = executor
        self.settings = settings
        self.interval_s = settings.reconcile_interval_s
        self.jobs = KindMemory(PLURAL, key=job_key)
        self.pods = KindMemory("pods", key=pod_key, model=lambda raw: pod_from_dict(raw, executor.core))
        self.workloads = KindMemory(kueue.WORKLOADS, key=job_key)
        executor.use_caches(jobs=self.jobs, pods=self.pods)
        self._pool = ThreadPoolExecutor(max_workers=PASS_WORKERS, thread_name_prefix="pass")
        self._stop = threading.Event()
        self.listed = threading.Event()
        """Set at the first handler call of a kopf run: kopf calls none before every index is filled, so no
        pass runs before the jobs and their Pods are both listed (see :meth:`trigger`)."""
        self._kinds: list[Kind] = []
        self._restart: asyncio.Event | None = None
        self._sweeps: dict[str, asyncio.Task[None]] = {}
        self._last_tick = time.monotonic()

    # --- running kopf --------------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        """Runs kopf and the periodic passes until ``stop`` (or a signal kopf received). kopf watches what
        it found when it started: once Kueue starts serving Workloads, it is started again with them."""
        rounds = asyncio.create_task(self._rounds(stop), name="phalanx periodic passes")
        try:
            while not stop.is_set():
                self._kinds = self.kinds(workloads=await self._kueue_serves_workloads())
                self._restart = restart = asyncio.Event()
                self.listed.clear()
                kopf_stop = asyncio.Event()
                operator = asyncio.create_task(self._kopf(kopf_stop), name="kopf")
                waits = [asyncio.create_task(e.wait()) for e in (stop, restart)]
                await asyncio.wait([operator, *waits], return_when=asyncio.FIRST_COMPLETED)
                for w in waits:
                    w.cancel()
                kopf_stop.set()
                await operator  # kopf's own errors end the process: the Deployment restarts it
                if not restart.is_set():
                    stop.set()  # kopf stopped on a signal (it takes SIGTERM over while it runs)
                else:
                    log.info("Kueue serves Workloads now: watching them too")
        finally:
            self._stop.set()
            rounds.cancel()
            self._pool.shutdown(wait=False, cancel_futures=True)

    def kinds(self, *, workloads: bool) -> list[Kind]:
        kinds = [Kind(JOBS, self.jobs), Kind(PODS, self.pods, selector=MANAGED_SELECTOR)]
        if workloads:
            kinds.append(Kind(WORKLOADS, self.workloads, selector=MANAGED_SELECTOR))
        return kinds

    async def _kopf(self, stop: asyncio.Event) -> None:
        namespaces = list(self.settings.namespaces)
        await kopf.operator(
            registry=self.registry(self._kinds),
            settings=self.kopf_settings(self._kinds),
            standalone=True,  # leader election is the Lease's (fencing, a handover within seconds)
            clusterwide=not namespaces,
            namespaces=namespaces,
            stop_flag=stop,
        )

    def kopf_settings(self, kinds: list[Kind]) -> kopf.OperatorSettings:
        settings = kopf.OperatorSettings()
        settings.scanning.disabled = True  # no cluster-wide watch of CRDs and namespaces: a Role suffices
        settings.posting.enabled = False  # the executor writes the Events a person reads, no handler logs
        settings.watching.server_timeout = WATCH_TIMEOUT_S
        settings.watching.inactivity_timeout = self.settings.watch_inactivity_s
        for kind in kinds:
            if kind.selector:
                settings.watching.label_selectors[kind.resource] = kind.selector
        return settings

    def registry(self, kinds: list[Kind]) -> kopf.OperatorRegistry:
        """An index and an event handler per kind, and the login: nothing that writes to an object."""
        registry = kopf.OperatorRegistry()
        kopf.on.login(registry=registry)(self._login)
        for kind in kinds:
            kopf.index(*kind.resource, id=kind.index_id, labels=kind.labels, registry=registry)(
                _indexer(kind)
            )
            kopf.on.event(*kind.resource, id=f"{kind.index_id}_event", labels=kind.labels, registry=registry)(
                self._handler(kind)
            )
        return registry

    def _login(self, **_: Any) -> kopf.ConnectionInfo:
        """kopf connects as the executor does: the same configuration, loaded once (kopf's own login would
        load it again, from the environment)."""
        return connection_info(self.executor.core.api_client.configuration)

    def _handler(self, kind: Kind) -> Callable[..., Any]:
        async def changed(type: str | None, body: kopf.Body, **kwargs: Any) -> None:
            self._attach(kwargs)
            raw = cast(Mapping[str, Any], body)
            if type == "DELETED":
                kind.memory.forget(ident_of(raw), version_of(raw))
            elif kind.memory.seen(raw, listed=type is None):
                self._sweep_soon(kind, SWEEP_DELAY_S)  # an object delivered again by a LIST: kopf re-listed
            if (job := kind.job_of(raw)) is not None:
                self.trigger(*job)

        return changed

    def _attach(self, indices: Mapping[str, Any]) -> None:
        """The first handler call of a kopf run: every index is filled; the memories read them from now."""
        if self.listed.is_set():
            return
        loop = asyncio.get_running_loop()
        for kind in self._kinds:
            kind.memory.attach(indices[kind.index_id], loop)
            self._sweep_soon(kind, GHOST_SWEEP_S)
        if any(kind.memory is self.workloads for kind in self._kinds):
            self.executor.queues.use_cache(self.workloads)
        self.listed.set()

    # --- passes --------------------------------------------------------------------------------------
    def trigger(self, namespace: str, name: str) -> None:
        """Asks for a pass of the job, unless kopf has not listed everything yet (a pass then could see a
        job without its Pods and replace every one of them). Nothing is lost: the first periodic round after
        the listing passes every job."""
        if self.listed.is_set() and not self._stop.is_set():
            self._pool.submit(self._pass, namespace, name)

    async def _rounds(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self._last_tick = time.monotonic()
            if self.listed.is_set():
                for namespace, name in self.jobs.idents():
                    self.trigger(namespace, name)
            await self._watch_workloads_once_served()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.interval_s)

    async def _watch_workloads_once_served(self) -> None:
        """Kueue installed after the operator started: kopf is started again to watch its Workloads. Until
        then a queued job's pass reads its Workload with a GET."""
        if self._restart is None or any(kind.memory is self.workloads for kind in self._kinds):
            return
        if await self._kueue_serves_workloads():
            self._restart.set()

    async def _kueue_serves_workloads(self) -> bool:
        try:
            return await asyncio.to_thread(self.executor.queues.serves_workloads)
        except Exception:  # the API server's hiccup: asked again at the next round
            log.exception("cannot ask whether Kueue serves Workloads")
            return False

    def healthy(self) -> bool:
        """Whether the periodic passes are still being scheduled (a wedged operator is restarted)."""
        return time.monotonic() - self._last_tick < max(30.0, 10 * self.interval_s)

    def _pass(self, namespace: str, name: str) -> None:
        try:
            self._drop_legacy_finalizer(namespace, name)
            self.executor.reconcile_job(namespace=namespace, name=name)
        except Exception:  # logged and counted; the next periodic pass tries again
            log.exception("%s/%s: reconciliation pass failed", namespace, name)

    def _drop_legacy_finalizer(self, namespace: str, name: str) -> None:
        job = self.jobs.get(namespace, name)
        finalizers = list(((job or {}).get("metadata") or {}).get("finalizers") or [])
        if LEGACY_FINALIZER not in finalizers or not self.executor.may_act():
            return
        meta = job["metadata"]  # type: ignore[index]
        kept = [f for f in finalizers if f != LEGACY_FINALIZER]
        body = {"metadata": {"finalizers": kept or None, "resourceVersion": meta["resourceVersion"]}}
        self.jobs.put(
            self.executor.custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name, body)
        )
        log.info("%s/%s: removed the finalizer %s", namespace, name, LEGACY_FINALIZER)

    # --- ghosts --------------------------------------------------------------------------------------
    def _sweep_soon(self, kind: Kind, delay_s: float) -> None:
        """A sweep of ``kind`` in ``delay_s`` (or sooner, if one is already due), then every
        :data:`GHOST_SWEEP_S`."""
        due = self._sweeps.get(kind.memory.kind)
        if due is not None and not due.done():
            if delay_s >= GHOST_SWEEP_S:
                return
            due.cancel()
        self._sweeps[kind.memory.kind] = asyncio.get_running_loop().create_task(self._sweep(kind, delay_s))

    async def _sweep(self, kind: Kind, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        try:
            listed, version = await asyncio.to_thread(self.list_metadata, kind)
        except Exception as exc:  # tried again at the next re-list, or the next period
            log.warning("cannot list %s to find ghosts: %s", kind.memory.kind, exc)
        else:
            for ghost in kind.memory.bury(listed, version):
                namespace, name = ident_of(ghost)
                log.info("%s %s/%s: deleted while the watch was broken; forgotten", kind.memory.kind,
                         namespace, name)  # fmt: skip
                if (job := kind.job_of(ghost)) is not None:
                    self.trigger(*job)
        self._sweeps.pop(kind.memory.kind, None)
        self._sweep_soon(kind, GHOST_SWEEP_S)

    def list_metadata(self, kind: Kind) -> tuple[dict[Ident, str], str]:
        """What exists of ``kind`` (ident -> resourceVersion) and the LIST's resourceVersion: metadata only,
        one LIST per namespace the operator handles (or one for the cluster)."""
        listed: dict[Ident, str] = {}
        versions: list[str] = []
        for namespace in self.settings.namespaces or ("",):
            response = self._list(kind, namespace)
            body = json.loads(response.data or b"{}")
            versions.append(str(body["metadata"]["resourceVersion"]))
            for item in body.get("items") or []:
                listed[ident_of(item)] = version_of(item)
        # Several namespaces: the oldest LIST bounds what may be buried (newer objects are kept).
        return listed, min(versions, key=lambda v: int(v) if v.isdigit() else 0)

    def _list(self, kind: Kind, namespace: str) -> Any:
        options: dict[str, Any] = {"_preload_content": False, "_headers": {"Accept": METADATA_LIST}}
        if kind.selector:
            options["label_selector"] = kind.selector
        custom, core = self.executor.custom, self.executor.core
        if kind.memory is self.pods:
            if namespace:
                return core.list_namespaced_pod(namespace, **options)
            return core.list_pod_for_all_namespaces(**options)
        group, version, plural = cast(tuple[str, str, str], kind.resource)
        if namespace:
            return custom.list_namespaced_custom_object(group, version, namespace, plural, **options)
        return custom.list_cluster_custom_object(group, version, plural, **options)


def connection_info(config: Any) -> kopf.ConnectionInfo:
    """kopf's credentials from a kubernetes.client Configuration, as ``kopf.login_via_client`` reads them (a
    token's hook, e.g. a service account's rotating token, is asked again at each login)."""
    header = config.get_api_key_with_prefix("BearerToken") or config.get_api_key_with_prefix("authorization")
    scheme, _, token = (header or "").rpartition(" ")
    return kopf.ConnectionInfo(
        server=config.host,
        ca_path=config.ssl_ca_cert,
        insecure=not config.verify_ssl,
        username=config.username or None,
        password=config.password or None,
        scheme=scheme or None,
        token=token or None,
        certificate_path=config.cert_file,
        private_key_path=config.key_file,
    )


def _indexer(kind: Kind) -> Callable[..., Any]:
    """kopf's index of ``kind``: the raw object under its job's key (an Index is read-only outside kopf)."""

    async def index(body: kopf.Body, **_: Any) -> dict[Hashable, Any] | None:
        raw = cast(Mapping[str, Any], body)
        key = kind.memory.key_of(raw)
        return {key: dict(raw)} if key is not None else None

    return index
