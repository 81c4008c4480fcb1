"""The master's watch of its one ElasticJob (:class:`JobWatch`), for :mod:`phalanx.master.store.kube`'s status
sink: spec changes (``spec.suspend``, the generation, the operator's scheduled-workers annotation) reach
the master within a second, and an idle job costs no reads."""

from __future__ import annotations

import contextlib
import functools
import logging
import random
import threading
import time
from typing import Any

from phalanx.api.elasticjob import GROUP, PLURAL, VERSION

log = logging.getLogger("phalanx.master")

SPEC_POLL_S = 2.0  # how stale the spec's suspend may be when no status was published meanwhile
WATCH_TIMEOUT_S = 300  # the API server ends each watch after this; it is resumed from the last version
WATCH_BACKOFF_S = (0.5, 30.0)  # first and longest wait before reconnecting a failed watch


class JobWatch:
    """Follows one ElasticJob: a LIST, then a WATCH from its resourceVersion, both with the field selector
    ``metadata.name=<job>`` (the only list/watch the master's RBAC allows). A watch the API server ends
    (its timeout) is resumed at once from the last version seen (events and bookmarks); one that fails
    (connection lost, API server restarted) is resumed after a backoff doubling from 0.5 s to 30 s;
    ``410 Gone`` (the version is older than the server keeps) lists again. ``403`` (a Role made by an
    operator older than this master, without list/watch) stops the watch for good: the sink then reads
    the job by GET as before. Runs in a daemon thread; ``on_object`` gets every version of the job."""

    def __init__(
        self, custom: Any, *, namespace: str, name: str, on_object: Any, resource_version: str = ""
    ) -> None:
        self._custom = custom
        self.namespace = namespace
        self.name = name
        self._on_object = on_object
        self.resource_version = resource_version  # "" lists first; a given one resumes from it
        self.connected = False
        self.forbidden = False
        self.lists = 0
        self.watches = 0
        self.gone = 0  # 410 answers: versions the API server no longer had
        self.failures = 0
        self._listed_at = float("-inf")
        self._stop = threading.Event()
        self._watch: Any = None
        self._thread = threading.Thread(target=self._run, name=f"watch-elasticjob-{name}", daemon=True)

    def start(self) -> JobWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        w = self._watch
        if w is not None:
            w.stop()
            with contextlib.suppress(Exception):  # unblocks the read of the open watch
                w._resp.close()

    def _selector(self) -> str:
        return f"metadata.name={self.name}"

    def _run(self) -> None:
        from kubernetes.client.exceptions import ApiException

        backoff = WATCH_BACKOFF_S[0]
        while not self._stop.is_set():
            try:
                if not self.resource_version:
                    self._list()
                self._follow()
                backoff = WATCH_BACKOFF_S[0]
                continue
            except ApiException as exc:
                if exc.status == 410:
                    self.gone += 1
                    self.resource_version = ""  # list again
                    if time.monotonic() - self._listed_at > 1.0:
                        continue  # at once: the server is fine, the version was just old
                reason = f"{exc.status} {exc.reason}"
                if exc.status == 403:
                    self.forbidden = True
                    log.warning(
                        "no list/watch on ElasticJob %s/%s (%s): reading it every %.0fs instead",
                        self.namespace, self.name, exc.reason, SPEC_POLL_S,
                    )  # fmt: skip
                    return
            except Exception as exc:  # connection refused or reset, a timeout, a broken stream
                reason = f"{type(exc).__name__}: {exc}"
            finally:
                self.connected = False
            if self._stop.is_set():
                return
            self.failures += 1
            wait = backoff * random.uniform(0.8, 1.2)  # jitter: a thousand masters do not reconnect at once
            log.warning("watch of ElasticJob %s/%s failed (%s); again in %.1fs", self.namespace, self.name,
                        reason, wait)  # fmt: skip
            self._stop.wait(wait)
            backoff = min(backoff * 2, WATCH_BACKOFF_S[1])

    def _list(self) -> None:
        listed = self._custom.list_namespaced_custom_object(
            GROUP, VERSION, self.namespace, PLURAL, field_selector=self._selector(),
            _request_timeout=30,
        )  # fmt: skip
        self.lists += 1
        self._listed_at = time.monotonic()
        for item in listed.get("items") or []:
            self._on_object(item)
        self.resource_version = str(listed["metadata"]["resourceVersion"])

    def _follow(self) -> None:
        from kubernetes import watch

        self._watch = w = watch.Watch()  # type: ignore[no-untyped-call]
        self.watches += 1
        started = time.monotonic()
        list_objects = self._custom.list_namespaced_custom_object

        @functools.wraps(list_objects)  # the watch reads the signature and docstring of what it calls
        def open_watch(*args: Any, **kwargs: Any) -> Any:
            response = list_objects(*args, **kwargs)
            # Connected once the API server answered, not when the request was sent: a connection lost
            # before the answer is retried inside the HTTP client, unseen here.
            self.connected = True
            # The first at INFO, the renewals (every WATCH_TIMEOUT_S) only at DEBUG.
            log.log(logging.INFO if self.watches == 1 else logging.DEBUG, "watching ElasticJob %s/%s from "
                    "resourceVersion %s", self.namespace, self.name, self.resource_version)  # fmt: skip
            return response

        for event in w.stream(  # type: ignore[no-untyped-call]
            open_watch,
            GROUP, VERSION, self.namespace, PLURAL,
            field_selector=self._selector(),
            resource_version=self.resource_version,
            allow_watch_bookmarks=True,
            timeout_seconds=WATCH_TIMEOUT_S,
            _request_timeout=(10, WATCH_TIMEOUT_S + 30),  # a silent dead connection ends too
        ):  # fmt: skip
            obj = event.get("raw_object") or {}
            version = str((obj.get("metadata") or {}).get("resourceVersion") or "")
            if version:
                self.resource_version = version
            if event.get("type") in ("ADDED", "MODIFIED"):
                self._on_object(obj)
        if self._stop.is_set():
            return
        if time.monotonic() - started < 1.0:  # ended at once: not the server's timeout; do not spin
            raise ConnectionError("the watch ended as soon as it started")
