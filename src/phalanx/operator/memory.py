"""What the operator knows of one kind of object between its passes: kopf's index of it (what the watch
delivered), with the operator's own writes laid over it and the deletions it knows of taken out.

kopf keeps the index (one LIST, then one WATCH, re-listed after ``410 Gone``) but leaves two things to the
operator, made up for here:

- **Its own writes** (a *write-through*): a pass that created a Pod must count it in the next pass, which may
  run before the watch delivers it. What the operator writes is laid over the index until the index holds that
  version or a newer one (or for :data:`OVERLAY_S` at most: a watch that lost it is reopened long before).
- **Deletions the index does not see**: kopf's index forgets an object when the watch reports it deleted, but
  an object deleted while the watch was broken, and then missing from the re-list, stays in the index for
  good (a *ghost*). :meth:`KindMemory.bury` takes such objects out, given a LIST made after the re-list.
  A deletion is also remembered by its resourceVersion, so that a stale copy (the answer to the DELETE, read
  after the watch reported it) does not bring the object back.

kopf's index lives on the event loop (its handlers write it there); a pass reads this memory from its own
thread, so every read of the index is made on the loop (:meth:`KindMemory._on_loop`), never beside a write.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import Any, TypeVar

OVERLAY_S = 120.0
"""The longest an own write is laid over the index: by then the watch delivered it, or was reopened."""
GONE_KEPT = 10_000
"""How many deletions the memory remembers (their names and versions)."""
READ_TIMEOUT_S = 30.0

T = TypeVar("T")
Ident = tuple[str, str]
"""(namespace, name) of one object."""


def meta_of(obj: Any) -> dict[str, Any]:
    """name, namespace, resourceVersion and labels of a model object (V1Pod) or a dict (custom object)."""
    if isinstance(obj, Mapping):
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


def ident_of(obj: Any) -> Ident:
    m = meta_of(obj)
    return (m["namespace"], m["name"])


def version_of(obj: Any) -> str:
    return str(meta_of(obj)["resourceVersion"])


def newer(incoming: str, held: str) -> bool:
    """Whether resourceVersion ``incoming`` is newer than ``held`` (the same version is no change).
    resourceVersions are opaque by contract; etcd's are integers, and anything else is taken as newer (never
    stuck on an old copy)."""
    if incoming.isdigit() and held.isdigit():
        return int(incoming) > int(held)
    return incoming != held


def visible(index_copy: Any | None, written: Any | None, gone: str | None) -> Any | None:
    """The copy of one object a pass sees: the newer of the index's and the operator's own, unless a deletion
    at that version or later is known. Pure."""
    copies = [c for c in (index_copy, written) if c is not None]
    if not copies:
        return None
    best = copies[0]
    for other in copies[1:]:
        if newer(version_of(other), version_of(best)):
            best = other
    if gone is not None and not newer(version_of(best), gone):
        return None
    return best


class KindMemory:
    """One kind of object. ``key`` indexes an object's metadata (the job's (namespace, name) for jobs, its
    ``phalanx.dev/job`` label for Pods and Workloads; None: not kept), as the kopf index handler does.
    ``model`` turns an index copy (a raw dict) into what the executor reads (a V1Pod for Pods); it is made
    once per version of the object, not once per pass."""

    def __init__(
        self,
        kind: str,
        *,
        key: Callable[[dict[str, Any]], Hashable | None],
        model: Callable[[Mapping[str, Any]], Any] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.kind = kind
        self._key = key
        self._model = model
        self._clock = clock
        self._index: Mapping[Hashable, Iterable[Any]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()
        self._written: dict[Ident, tuple[Any, float]] = {}
        """The operator's own writes not yet in the index, with when they were written."""
        self._gone: dict[Ident, str] = {}
        """Deletions known, by the resourceVersion of the last copy: no copy at or before it is seen."""
        self._models: dict[Ident, tuple[str, Any]] = {}
        self._delivered: set[Ident] = set()
        """What the watch delivered since :meth:`attach` (deletions taken out): a LIST delivering one again
        is a re-list."""

    def attach(self, index: Mapping[Hashable, Iterable[Any]], loop: asyncio.AbstractEventLoop) -> None:
        """Reads kopf's ``index`` (a Mapping of key -> the objects under it), on ``loop``, from now on."""
        self._index, self._loop = index, loop
        self._delivered = set()

    def key_of(self, obj: Any) -> Hashable | None:
        """The index key of ``obj`` (kopf's index handler files it there)."""
        return self._key(meta_of(obj))

    # --- reads (any thread) --------------------------------------------------------------------------
    def get(self, namespace: str, name: str) -> Any | None:
        key = self._key({"namespace": namespace, "name": name, "labels": {}})
        return self._on_loop(lambda: self._get((namespace, name), key))

    def by_index(self, key: Hashable) -> list[Any]:
        return self._on_loop(lambda: self._under(key))

    def idents(self) -> list[Ident]:
        return self._on_loop(self._all_idents)

    # --- writes (any thread) -------------------------------------------------------------------------
    def put(self, obj: Any) -> None:
        """Lays ``obj`` (an API server's answer to the operator's write) over the index, unless its deletion
        at that version or later is known."""
        ident, version = ident_of(obj), version_of(obj)
        with self._lock:
            gone = self._gone.get(ident)
            if gone is not None and not newer(version, gone):
                return
            held = self._written.get(ident)
            if held is None or newer(version, version_of(held[0])):
                self._written[ident] = (obj, self._clock())

    def remove(self, namespace: str, name: str) -> None:
        """The operator deleted the object: no copy it saw is seen again."""
        ident = (namespace, name)
        held = self._on_loop(lambda: self._get(ident, None))
        self.forget(ident, version_of(held) if held is not None else "")

    def forget(self, ident: Ident, version: str) -> None:
        """The object was deleted at ``version`` (a watch's DELETED, the operator's own DELETE, a ghost)."""
        with self._lock:
            self._delivered.discard(ident)
            self._written.pop(ident, None)
            self._models.pop(ident, None)
            self._gone[ident] = version
            if len(self._gone) > GONE_KEPT:
                self._gone.pop(next(iter(self._gone)))

    def seen(self, obj: Mapping[str, Any], *, listed: bool) -> bool:
        """The watch delivered ``obj`` (not a deletion; ``listed``: by a LIST, kopf's event type None). A
        deletion remembered from before it no longer hides it (the name was created again). Returns whether
        a LIST delivered an object already delivered: kopf re-listed (after ``410 Gone``), and objects
        deleted meanwhile may be left in its index (see :meth:`bury`). Call on the loop."""
        ident, version = ident_of(obj), version_of(obj)
        with self._lock:
            relisted = listed and ident in self._delivered
            self._delivered.add(ident)
            gone = self._gone.get(ident)
            if gone is not None and newer(version, gone):
                del self._gone[ident]
        return relisted

    def bury(self, listed: Mapping[Ident, str], list_version: str) -> list[Any]:
        """Takes the ghosts out: objects the index holds that a LIST made at ``list_version`` (``listed``:
        ident -> resourceVersion) does not, and that are older than that LIST (a newer one was created after
        it). Returns what was buried (their jobs need a pass). Call on the loop."""
        with self._lock:
            known = dict(self._gone)
        buried = [
            obj
            for ident, obj in self._copies(None).items()
            if ident not in listed
            and newer(list_version, version_of(obj))
            and (ident not in known or newer(version_of(obj), known[ident]))  # not buried already
        ]
        for obj in buried:
            self.forget(ident_of(obj), version_of(obj))
        return buried

    # --- on the loop ---------------------------------------------------------------------------------
    def _on_loop(self, read: Callable[[], T]) -> T:
        loop = self._loop
        if loop is None or loop.is_closed() or _running_loop() is loop:
            return read()

        async def run() -> T:
            return read()

        return asyncio.run_coroutine_threadsafe(run(), loop).result(READ_TIMEOUT_S)

    def _copies(self, key: Hashable | None) -> dict[Ident, Any]:
        """The index's copies under ``key`` (None: all of them), by ident. kopf files an object by its uid: a
        ghost and the object made again under its name are both there, and the newer is the one that is."""
        stores = [self._index.get(key, ())] if key is not None else list(self._index.values())
        copies: dict[Ident, Any] = {}
        for store in stores:
            for obj in store:
                ident = ident_of(obj)
                held = copies.get(ident)
                if held is None or newer(version_of(obj), version_of(held)):
                    copies[ident] = obj
        return copies

    def _get(self, ident: Ident, key: Hashable | None) -> Any | None:
        index_copy = self._copies(key).get(ident)
        with self._lock:
            written = self._fresh_write(ident, index_copy)
            return self._as_model(visible(index_copy, written, self._gone.get(ident)))

    def _under(self, key: Hashable | None) -> list[Any]:
        """What a pass sees under ``key`` (None: everything), own writes included."""
        copies: dict[Ident, Any | None] = dict(self._copies(key))
        with self._lock:
            for ident, (obj, _) in list(self._written.items()):
                if ident not in copies and (key is None or self._key(meta_of(obj)) == key):
                    copies[ident] = None
            seen = []
            for ident, index_copy in copies.items():
                obj = visible(index_copy, self._fresh_write(ident, index_copy), self._gone.get(ident))
                if obj is not None:
                    seen.append(self._as_model(obj))
            return seen

    def _all_idents(self) -> list[Ident]:
        return sorted(ident_of(obj) for obj in self._under(None))

    def _fresh_write(self, ident: Ident, index_copy: Any | None) -> Any | None:
        """The operator's own copy, dropped once the index caught up with it or it outlived
        :data:`OVERLAY_S`. Holds the lock."""
        held = self._written.get(ident)
        if held is None:
            return None
        obj, at = held
        caught_up = index_copy is not None and not newer(version_of(obj), version_of(index_copy))
        if caught_up or self._clock() - at > OVERLAY_S:
            del self._written[ident]
            return None
        return obj

    def _as_model(self, obj: Any | None) -> Any | None:
        """The executor's type for an index copy (a raw dict), made once per version. Holds the lock."""
        if obj is None or self._model is None or not isinstance(obj, Mapping):
            return obj
        ident, version = ident_of(obj), version_of(obj)
        made = self._models.get(ident)
        if made is None or made[0] != version:
            made = self._models[ident] = (version, self._model(obj))
        return made[1]


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
