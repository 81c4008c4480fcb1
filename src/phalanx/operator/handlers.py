"""kopf wiring: when to reconcile. Every handler only triggers a pass of the executor; the decision is
:func:`phalanx.operator.reconcile.reconcile` and the state is read fresh from the API in each pass.

Level based: a timer reconciles every job every ``reconcile_interval_s`` whatever events were missed
(an operator restarted mid-job simply continues); creation, spec changes and Pod events trigger an
immediate pass so the common cases react at once. kopf's own bookkeeping lives in annotations
(``phalanx.dev/...``), never in the strict status schema.
"""

from __future__ import annotations

import logging
from typing import Any

import kopf

from phalanx.api.settings import OperatorSettings
from phalanx.operator import names
from phalanx.operator.crd import GROUP, PLURAL, VERSION
from phalanx.operator.executor import Executor

log = logging.getLogger("phalanx.operator")

_state: dict[str, Any] = {}


def install(*, executor: Executor, settings: OperatorSettings) -> kopf.OperatorRegistry:
    """Registers the handlers into a fresh kopf registry and returns it."""
    registry = kopf.OperatorRegistry()
    _state["executor"] = executor

    def run(namespace: str, name: str) -> None:
        executor.reconcile_job(namespace=namespace, name=name)

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
            prefix=GROUP, key="last-handled-configuration"
        )
        settings.persistence.finalizer = f"{GROUP}/operator"
        settings.posting.level = logging.WARNING  # the executor records the Events that tell the story
        settings.watching.server_timeout = 60
        settings.execution.max_workers = 8

    @kopf.on.login(registry=registry)
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        return kopf.login_via_client(**kwargs)

    @kopf.on.resume(GROUP, VERSION, PLURAL, registry=registry)
    @kopf.on.create(GROUP, VERSION, PLURAL, registry=registry)
    @kopf.on.field(GROUP, VERSION, PLURAL, field="spec", registry=registry)
    def on_change(**kwargs: Any) -> None:
        run(kwargs["namespace"], kwargs["name"])

    @kopf.timer(GROUP, VERSION, PLURAL, interval=settings.reconcile_interval_s, registry=registry)
    def periodic(**kwargs: Any) -> None:
        run(kwargs["namespace"], kwargs["name"])

    @kopf.on.event(
        "", "v1", "pods", labels={"app.kubernetes.io/managed-by": names.MANAGED_BY}, registry=registry
    )
    def pod_event(**kwargs: Any) -> None:
        # A worker or master Pod changed (failed, vanished): reconcile its job now, not at the next tick.
        job = kwargs["labels"].get(names.JOB_LABEL)
        if job and kwargs["event"].get("type") in ("MODIFIED", "DELETED"):
            run(kwargs["namespace"], job)

    return registry
