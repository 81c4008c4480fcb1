"""When to reconcile: every trigger only asks for a pass of the executor; the decision is
:func:`phalanx.operator.reconcile.reconcile`, and the state it sees comes from the watch caches
(:mod:`phalanx.operator.cache`): the jobs, their Pods and, where Kueue is installed when the operator starts,
their Workloads.

Level based: every job is reconciled every ``reconcile_interval_s`` whatever events were missed (an
operator restarted mid-job, or a new leader, simply continues); a change of a job (created, spec or status
changed) or of one of its Pods triggers a pass at once. A pass reads memory only, so the periodic passes
cost the API server nothing; it is written to only when a pass changes something.

No finalizer: deleting an ElasticJob never waits for a live operator. Everything a job owns carries an
ownerReference to it, so Kubernetes' garbage collector removes it. The finalizer older versions (kopf) put on
jobs is taken off by the first pass that sees it, deleted jobs included.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

from phalanx.api.elasticjob import GROUP, PLURAL, VERSION
from phalanx.api.settings import OperatorSettings
from phalanx.operator import kueue, names
from phalanx.operator.cache import Cache, watch
from phalanx.operator.executor import Executor

log = logging.getLogger("phalanx.operator")

LEGACY_FINALIZER = f"{GROUP}/operator"
"""The finalizer kopf kept on every job (its timers needed it); a job deleted while no operator ran hung."""
PASS_WORKERS = 8
SYNC_TIMEOUT_S = 120


def pod_key(meta: dict[str, Any]) -> Hashable | None:
    job = meta["labels"].get(names.JOB_LABEL)
    return (meta["namespace"], job) if job else None


def job_key(meta: dict[str, Any]) -> Hashable | None:
    return (meta["namespace"], meta["name"])


class Reconciler:
    """Keeps the watch caches and runs the passes: on changes, and for every job every interval."""

    def __init__(self, *, executor: Executor, settings: OperatorSettings) -> None:
        self.executor = executor
        self.interval_s = settings.reconcile_interval_s
        core, custom = executor.core, executor.custom
        selector = f"app.kubernetes.io/managed-by={names.MANAGED_BY}"
        self._namespaces = settings.namespaces

        def jobs(ns: str) -> tuple[Callable[..., Any], tuple[Any, ...]]:
            if ns:
                return custom.list_namespaced_custom_object, (GROUP, VERSION, ns, PLURAL)
            return custom.list_cluster_custom_object, (GROUP, VERSION, PLURAL)

        def pods(ns: str) -> tuple[Callable[..., Any], tuple[Any, ...]]:
            return (core.list_namespaced_pod, (ns,)) if ns else (core.list_pod_for_all_namespaces, ())

        self.jobs = watch(PLURAL, namespaces=self._namespaces, lister=jobs, index=job_key,
                          on_change=self._changed)  # fmt: skip
        self.pods = watch("pods", namespaces=self._namespaces, lister=pods, label_selector=selector,
                          index=pod_key, on_change=self._changed)  # fmt: skip
        executor.use_caches(jobs=self.jobs, pods=self.pods)
        self.workloads: Cache | None = None
        self._pool = ThreadPoolExecutor(max_workers=PASS_WORKERS, thread_name_prefix="pass")
        self._stop = threading.Event()
        self._synced = threading.Event()
        """Set once both caches listed everything: no pass runs before (see :meth:`trigger`)."""
        self._last_tick = time.monotonic()

    def start(self) -> Reconciler:
        for cache in (self.jobs, self.pods):
            cache.start()
        for cache in (self.jobs, self.pods):
            if not cache.wait_synced(SYNC_TIMEOUT_S):
                raise TimeoutError(f"could not list {cache.kind} within {SYNC_TIMEOUT_S}s")
        self._synced.set()
        threading.Thread(target=self._resync, name="resync", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self.jobs.stop()
        self.pods.stop()
        if self.workloads is not None:
            self.workloads.stop()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def healthy(self) -> bool:
        """Whether the periodic passes are still being scheduled (a wedged operator is restarted)."""
        return time.monotonic() - self._last_tick < max(30.0, 10 * self.interval_s)

    def _changed(self, key: Hashable, _obj: Any) -> None:
        namespace, name = cast(tuple[str, str], key)
        self.trigger(namespace, name)

    def trigger(self, namespace: str, name: str) -> None:
        """Asks for a pass of the job, unless the caches have not both listed everything yet. The jobs'
        watch starts delivering changes while the Pods are still being listed (a large cluster's LIST takes
        seconds): a pass then would see a job without its Pods and replace every one of them, none kept off
        an evicted machine. Nothing is lost by dropping those triggers: the first periodic round, which
        starts once both caches are synced, passes every job."""
        if self._synced.is_set() and not self._stop.is_set():
            self._pool.submit(self._pass, namespace, name)

    def _watch_workloads(self) -> None:
        """Once Kueue serves Workloads (installed before the operator or after), the jobs' Workloads are
        watched too: a queued job's pass reads its Workload from memory and runs at once when Kueue admits or
        evicts it. Until the watch has listed them, a pass reads its job's Workload with a GET."""
        queues = self.executor.queues
        if self.workloads is not None or not queues.serves_workloads():
            return
        custom = self.executor.custom

        def workloads(ns: str) -> tuple[Callable[..., Any], tuple[Any, ...]]:
            if ns:
                return custom.list_namespaced_custom_object, (kueue.GROUP, kueue.VERSION, ns, kueue.WORKLOADS)
            return custom.list_cluster_custom_object, (kueue.GROUP, kueue.VERSION, kueue.WORKLOADS)

        self.workloads = watch(
            kueue.WORKLOADS, namespaces=self._namespaces, lister=workloads,
            label_selector=f"app.kubernetes.io/managed-by={names.MANAGED_BY}", index=pod_key,
            on_change=self._changed,
        ).start()  # fmt: skip
        threading.Thread(target=self._use_workloads, args=(self.workloads,), daemon=True).start()

    def _use_workloads(self, cache: Cache) -> None:
        if cache.wait_synced(SYNC_TIMEOUT_S):
            self.executor.queues.use_cache(cache)

    def _resync(self) -> None:
        while not self._stop.is_set():
            self._last_tick = time.monotonic()
            try:
                self._watch_workloads()
            except Exception:  # the API server's hiccup: the passes read Workloads with GETs meanwhile
                log.exception("cannot start watching Kueue's Workloads")
            for namespace, name in self.jobs.idents():
                self.trigger(namespace, name)
            self._stop.wait(self.interval_s)

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
