"""Watch caches: the operator's reads of ElasticJobs and of their Pods come from memory, kept current by
one LIST and then one long WATCH per kind, not from a GET and a LIST per job per pass.

A reconciliation pass for each of N jobs every couple of seconds would otherwise cost the API server
about 8 N requests per pass; with the caches the steady state costs nothing but the watches' reconnects.
Objects are indexed by ``(namespace, phalanx.dev/job label)`` for Pods and ``(namespace, name)`` for jobs.

What the operator writes is put into the cache at once from the API server's answer (a *write-through*):
the next pass, which may run before the watch delivers the change, never acts on its own stale state.
An event older than what the cache holds (by resourceVersion) is then ignored.

The caches are filled before the first pass (:meth:`WatchCache.wait_synced`); a watch that fails (the API
server restarted, the resourceVersion expired: 410 Gone) is re-established with a fresh LIST.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Hashable
from typing import Any

log = logging.getLogger("phalanx.operator.cache")

WATCH_TIMEOUT_S = 300
GONE_KEPT = 10_000
"""How many deletions the cache remembers (their names and versions) between two LISTs."""
"""The server ends each watch after this long (randomised by it); the cache reconnects from where it was."""


def meta_of(obj: Any) -> dict[str, Any]:
    """name, namespace, resourceVersion and labels of a model object (V1Pod) or a dict (custom object)."""
    if isinstance(obj, dict):
        meta = obj.get("metadata") or {}
        return {
            "name": meta.get("name", ""),
            "namespace": meta.get("namespace", ""),
            "resourceVersion": meta.get("resourceVersion", ""),
            "labels": meta.get("labels") or {},
        }
    meta = obj.metadata
    return {
        "name": meta.name,
        "namespace": meta.namespace,
        "resourceVersion": meta.resource_version or "",
        "labels": meta.labels or {},
    }


def newer(incoming: str, held: str) -> bool:
    """Whether resourceVersion ``incoming`` is newer than ``held`` (the same version is no change: the watch
    delivering what a write-through stored already). resourceVersions are opaque by contract; etcd's are
    integers, and anything else is taken as newer (never stuck on an old copy)."""
    if incoming.isdigit() and held.isdigit():
        return int(incoming) > int(held)
    return incoming != held


class WatchCache:
    """One kind of object (``list_fn`` with ``list_args``/``label_selector``), indexed by ``index``
    (an object -> a hashable key, None: not kept). ``on_change(key, obj)`` is called after every change
    the watch delivers (not after write-throughs: the writer knows)."""

    def __init__(
        self,
        *,
        kind: str,
        list_fn: Callable[..., Any],
        list_args: tuple[Any, ...] = (),
        label_selector: str = "",
        index: Callable[[dict[str, Any]], Hashable | None],
        on_change: Callable[[Hashable, Any], None] | None = None,
    ) -> None:
        self.kind = kind
        self._list_fn, self._list_args, self._selector = list_fn, list_args, label_selector
        self._index = index
        self._on_change = on_change
        self._lock = threading.Lock()
        self._objects: dict[tuple[str, str], Any] = {}
        self._by_key: dict[Hashable, dict[tuple[str, str], Any]] = {}
        self._gone: dict[tuple[str, str], str] = {}
        """Objects the watch reported deleted, with the deletion's resourceVersion: a write-through of an
        older copy (the answer to the DELETE itself, read after the watch's event) is not one that exists."""
        self._synced = threading.Event()
        self._stop = threading.Event()
        self._watch: Any = None

    # --- reads ---------------------------------------------------------------------------------------
    def get(self, namespace: str, name: str) -> Any | None:
        with self._lock:
            return self._objects.get((namespace, name))

    def by_index(self, key: Hashable) -> list[Any]:
        with self._lock:
            return list(self._by_key.get(key, {}).values())

    def idents(self) -> list[tuple[str, str]]:
        with self._lock:
            return list(self._objects)

    def wait_synced(self, timeout: float | None = None) -> bool:
        return self._synced.wait(timeout)

    # --- writes --------------------------------------------------------------------------------------
    def put(self, obj: Any) -> None:
        """Writes ``obj`` (an API server's answer) through, unless the cache already holds a newer one or the
        watch already reported it deleted."""
        m = meta_of(obj)
        with self._lock:
            gone = self._gone.get((m["namespace"], m["name"]))
            if gone is None or newer(m["resourceVersion"], gone):
                self._store(obj)

    def remove(self, namespace: str, name: str) -> None:
        with self._lock:
            self._drop((namespace, name))

    def _store(self, obj: Any) -> bool:
        m = meta_of(obj)
        ident = (m["namespace"], m["name"])
        held = self._objects.get(ident)
        if held is not None and not newer(m["resourceVersion"], meta_of(held)["resourceVersion"]):
            return False
        self._drop(ident)
        key = self._index(m)
        if key is None:
            return False
        self._objects[ident] = obj
        self._by_key.setdefault(key, {})[ident] = obj
        return True

    def _drop(self, ident: tuple[str, str]) -> None:
        held = self._objects.pop(ident, None)
        if held is None:
            return
        key = self._index(meta_of(held))
        bucket = self._by_key.get(key, {})
        bucket.pop(ident, None)
        if not bucket:
            self._by_key.pop(key, None)

    def apply(self, kind: str, obj: Any) -> bool:
        """One event of the watch (ADDED, MODIFIED, DELETED); whether it changed what the cache holds."""
        m = meta_of(obj)
        ident = (m["namespace"], m["name"])
        with self._lock:
            if kind != "DELETED":
                return self._store(obj)
            self._drop(ident)
            self._gone[ident] = m["resourceVersion"]
            if len(self._gone) > GONE_KEPT:
                self._gone.pop(next(iter(self._gone)))
            return True

    # --- the watch -----------------------------------------------------------------------------------
    def start(self) -> WatchCache:
        threading.Thread(target=self._run, name=f"watch-{self.kind}", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._watch is not None:
            self._watch.stop()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                version = self._relist()
                self._follow(version)
            except Exception as exc:  # the API server restarted, 410 Gone, a network error: relist
                if self._stop.is_set():
                    return
                log.warning("watch of %s: %s; listing again", self.kind, exc)
                self._stop.wait(1.0)

    def _kwargs(self) -> dict[str, Any]:
        return {"label_selector": self._selector} if self._selector else {}

    def _relist(self) -> str:
        listed = self._list_fn(*self._list_args, **self._kwargs())
        if isinstance(listed, dict):
            items, version = listed.get("items") or [], listed["metadata"]["resourceVersion"]
        else:
            items, version = listed.items or [], listed.metadata.resource_version
        with self._lock:
            before = {ident: self._index(meta_of(obj)) for ident, obj in self._objects.items()}
            self._objects.clear()
            self._by_key.clear()
            self._gone.clear()  # a LIST is the whole truth again
            for obj in items:
                self._store(obj)
            gone = {key for ident, key in before.items() if ident not in self._objects}
        self._synced.set()
        for key in gone:  # deleted while the watch was down: their jobs need a pass too
            if self._on_change is not None and key is not None:
                self._on_change(key, None)
        return str(version)

    def _follow(self, version: str) -> None:
        from kubernetes import watch

        self._watch = w = watch.Watch()  # type: ignore[no-untyped-call]
        while not self._stop.is_set():
            for event in w.stream(  # type: ignore[no-untyped-call]
                self._list_fn,
                *self._list_args,
                resource_version=version,
                timeout_seconds=WATCH_TIMEOUT_S,
                allow_watch_bookmarks=True,
                **self._kwargs(),
            ):
                kind, obj = event["type"], event["object"]
                if kind == "BOOKMARK":
                    continue
                changed = self.apply(kind, obj)
                key = self._index(meta_of(obj))
                if changed and self._on_change is not None and key is not None:
                    self._on_change(key, obj)
            # The server closed the watch after its timeout: watch again from where this one ended.
            version = w.resource_version or version


class NamespacedCaches:
    """One :class:`WatchCache` per namespace, read and written as one: an operator that handles the jobs of
    a few namespaces lists and watches each (a Role there suffices), never the whole cluster."""

    def __init__(self, caches: dict[str, WatchCache]) -> None:
        self._caches = caches
        self.kind = next(iter(caches.values())).kind

    def _of(self, namespace: str) -> WatchCache | None:
        return self._caches.get(namespace)

    def get(self, namespace: str, name: str) -> Any | None:
        cache = self._of(namespace)
        return cache.get(namespace, name) if cache is not None else None

    def by_index(self, key: Hashable) -> list[Any]:
        """Every cache's objects under ``key`` (a key starts with its namespace, as the operator's do)."""
        namespace = key[0] if isinstance(key, tuple) and key else None
        caches = [self._caches[namespace]] if namespace in self._caches else list(self._caches.values())
        return [obj for cache in caches for obj in cache.by_index(key)]

    def idents(self) -> list[tuple[str, str]]:
        return [ident for cache in self._caches.values() for ident in cache.idents()]

    def wait_synced(self, timeout: float | None = None) -> bool:
        return all(cache.wait_synced(timeout) for cache in self._caches.values())

    def put(self, obj: Any) -> None:
        if (cache := self._of(meta_of(obj)["namespace"])) is not None:
            cache.put(obj)

    def remove(self, namespace: str, name: str) -> None:
        if (cache := self._of(namespace)) is not None:
            cache.remove(namespace, name)

    def start(self) -> NamespacedCaches:
        for cache in self._caches.values():
            cache.start()
        return self

    def stop(self) -> None:
        for cache in self._caches.values():
            cache.stop()


Cache = WatchCache | NamespacedCaches
"""What the operator reads its objects from: a watch of the cluster, or one per namespace it handles."""

Lister = Callable[[str], tuple[Callable[..., Any], tuple[Any, ...]]]
"""A namespace -> the Kubernetes client's list function and its arguments for that namespace ("": all)."""


def watch(
    kind: str,
    *,
    namespaces: tuple[str, ...],
    lister: Lister,
    label_selector: str = "",
    index: Callable[[dict[str, Any]], Hashable | None],
    on_change: Callable[[Hashable, Any], None] | None = None,
) -> Cache:
    """A cache of ``kind`` in ``namespaces`` (a watch each), or in the whole cluster when there are none."""

    def one(namespace: str) -> WatchCache:
        list_fn, args = lister(namespace)
        return WatchCache(kind=kind, list_fn=list_fn, list_args=args, label_selector=label_selector,
                          index=index, on_change=on_change)  # fmt: skip

    return NamespacedCaches({ns: one(ns) for ns in namespaces}) if namespaces else one("")
