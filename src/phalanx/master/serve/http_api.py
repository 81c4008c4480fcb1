"""The master's HTTP API (FastAPI) for people, ``phalanx local`` and Prometheus.

Every endpoint, ``/healthz`` and ``/metrics`` included, needs ``Authorization: Bearer <job token>``;
otherwise the answer is 401. ``GET /metrics`` also accepts the metrics token (``--metrics-token-file``), one
read-only credential a Prometheus PodMonitor can present to every job's master. Bad query parameters get
422. All bodies are JSON except ``/metrics``.

What each endpoint answers is a model of :mod:`phalanx.api.views`, served with ``response_model``: the
OpenAPI schema (``GET /openapi.json``, behind the token like the rest; the fuzz tests generate their requests
from it and check the answers against it) is the contract. ``GET /v1/timeline`` encodes its answer (up to
65,536 intervals) off the event loop, so it is checked against :class:`~phalanx.api.views.TimelineView` by
the tests rather than on every request.

``POST /v1/probe`` -> 202 once a probe round started; 409 ``{"error": str}`` when none can start (probes
disabled, no running round, a probe round running, no kind of ``probes.kinds`` that runs on this many nodes).

``GET /v1/timeline?around=&window_s=S&node=&rank=``: ``around`` empty: the last ``window_s`` (default 120)
seconds up to now; ``latest``: the newest failure, and the window is ``window_s`` seconds each side of it; a
whole number below 10^9: the failure with that id (its event's ``seq``), likewise; otherwise a unix time,
likewise. 404 ``{"error": str}`` when no such failure is remembered.

``GET /metrics`` -> Prometheus text format (see :mod:`phalanx.master.serve.metrics`).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import secrets
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from fastapi import FastAPI, Query
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel

from phalanx.api import auth, views
from phalanx.master.errors import RequestError
from phalanx.master.serve.runtime import Runtime
from phalanx.master.state.timeline import Timeline

__all__ = ["create_app", "openapi_document"]

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class BearerAuth:
    """ASGI middleware: 401 unless the request carries the job's bearer token, or the metrics token for a
    GET of /metrics (a read-only credential Prometheus may share across jobs)."""

    def __init__(self, app: FastAPI, *, token: str, metrics_token: str = "") -> None:
        self.app = app
        self._expected = auth.bearer(token).encode()
        self._metrics = auth.bearer(metrics_token).encode() if metrics_token else b""

    def _allowed(self, scope: Scope, given: bytes) -> bool:
        if hmac.compare_digest(given, self._expected):
            return True
        scrape = scope.get("method") == "GET" and scope.get("path") == "/metrics"
        return bool(self._metrics) and scrape and hmac.compare_digest(given, self._metrics)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            given = b""
            for key, value in scope.get("headers", ()):
                if key == auth.HEADER.encode():
                    given = value
                    break
            if not self._allowed(scope, given):
                body = json.dumps({"error": "missing or wrong job token"}).encode()
                headers = [
                    (b"content-type", b"application/json"),
                    (b"www-authenticate", b"Bearer"),
                    (b"content-length", str(len(body)).encode()),
                ]
                await send({"type": "http.response.start", "status": 401, "headers": headers})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


class ErrorBody(BaseModel):
    """The body of a refusal (401, 409), for the OpenAPI schema."""

    error: str


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema plus the bearer token every endpoint needs (checked by :class:`BearerAuth`, which
    FastAPI does not see)."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        schema.setdefault("components", {})["securitySchemes"] = {
            "job_token": {"type": "http", "scheme": "bearer"}
        }
        schema["security"] = [{"job_token": []}]
        app.openapi_schema = schema
    return app.openapi_schema


DEFAULT_WINDOW_S = 120.0
MAX_WINDOW_S = 3600.0
_FIRST_UNIX = 1e9
"""Below this, ``around`` is a failure id (an event seq); from here on, a unix time (2001 onwards)."""


def timeline_center(around: str, timeline: Timeline) -> tuple[float | None, dict[str, Any] | None]:
    """The unix time ``around`` names (None for "now") and the failure it names, if any: ``latest`` is the
    newest failure, a number below 10^9 a failure id (LookupError for either when there is none), another
    number a unix time. The endpoint's pattern lets nothing else through."""
    text = around.strip()
    if not text:
        return None, None
    if text == "latest":
        known = timeline.failures()
        if not known:
            raise LookupError("no failure is remembered")
        return float(known[-1]["unix"]), known[-1]
    value = float(text)
    if value < _FIRST_UNIX:
        failure = timeline.failure(int(value)) if value.is_integer() else None
        if failure is None:
            raise LookupError(f"no failure {text} is remembered (GET /v1/timeline?around=latest, /v1/events)")
        return float(failure["unix"]), failure
    return value, None


def openapi_document() -> dict[str, Any]:
    """The schema :func:`create_app` serves, from an app over an empty job (``docs/master-api.json``)."""
    from phalanx.api.settings import MasterSettings
    from phalanx.master.job import Job
    from phalanx.master.serve.logstore import LogStore
    from phalanx.master.store.stores import MemoryStateStore, NullStatusSink

    runtime = Runtime(
        job=Job(settings=MasterSettings(job_id="job"), now=0.0),
        logs=LogStore(ring_lines=1, max_line_bytes=1, path=None),
        store=MemoryStateStore(),
        sink=NullStatusSink(),
    )
    return create_app(runtime, token=secrets.token_hex(16)).app.openapi()  # the schema needs no token


def create_app(runtime: Runtime, *, token: str, metrics_token: str = "") -> BearerAuth:
    """The HTTP API over ``runtime``'s job, wrapped in the bearer-token check (see :class:`BearerAuth`).

    The handlers are ``async def`` on purpose: they then run on the event loop, like the gRPC handlers
    that change the job, and never read it from a worker thread while it changes.
    """
    app = FastAPI(
        title="phalanx master",
        docs_url=None,
        redoc_url=None,
        openapi_url="/openapi.json",
        responses={
            401: {
                "description": "Missing or wrong job token.",
                "content": {"application/json": {"schema": ErrorBody.model_json_schema()}},
            }
        },
    )
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    job = runtime.job

    @app.get("/healthz", response_model=views.Health)
    async def healthz() -> views.Health:
        return views.Health(phase=job.phase)

    @app.get("/v1/job", response_model=views.JobView)
    async def get_job() -> views.JobView:
        return job.status()

    @app.get("/v1/nodes", response_model=views.NodesView)
    async def get_nodes() -> views.NodesView:
        return job.nodes_view(now=runtime.now())

    @app.post(
        "/v1/probe",
        status_code=202,
        responses={
            202: {"description": "A probe round started.", "model": views.ProbeStarted},
            409: {"description": "No probe round can start now.", "model": ErrorBody},
        },
    )
    async def post_probe() -> Response:
        try:
            probe = job.start_probe(now=runtime.now(), trigger="requested via POST /v1/probe")
        except RequestError as exc:
            return JSONResponse({"error": str(exc)}, status_code=409)
        finally:
            runtime.after()
        return JSONResponse(views.ProbeStarted(probe=probe.view()).model_dump(mode="json"), status_code=202)

    @app.get("/v1/events", response_model=views.EventsPage)
    async def get_events(
        since: int = Query(0, ge=0), limit: int = Query(1000, ge=1, le=10_000)
    ) -> views.EventsPage:
        return views.EventsPage(
            events=[e.view() for e in job.events.since(since, limit=limit)], next_seq=job.events.next_seq
        )

    @app.get("/v1/logs", response_model=views.LogsPage)
    async def get_logs(
        node: str = Query("", max_length=253),
        rank: int | None = Query(None, ge=0),
        tail: int = Query(100, ge=0, le=100_000),
    ) -> views.LogsPage:
        return views.LogsPage(lines=runtime.logs.tail(node=node, rank=rank, tail=tail))

    @app.get(
        "/v1/timeline",
        responses={
            200: {"description": "The ranks' intervals in the window.", "model": views.TimelineView},
            404: {"description": "No failure with that id is remembered.", "model": ErrorBody},
        },
    )
    async def get_timeline(
        around: str = Query("", max_length=32, pattern=r"^(latest|[0-9]{1,20}(\.[0-9]{0,9})?)?$"),
        window_s: float = Query(DEFAULT_WINDOW_S, gt=0, le=MAX_WINDOW_S),
        node: str = Query("", max_length=253),
        rank: int | None = Query(None, ge=0),
    ) -> Response:
        now = runtime.now()
        try:
            center, failure = timeline_center(around, job.timeline)
        except LookupError as exc:
            return JSONResponse({"error": str(exc)}, status_code=404)
        start, end = (now - window_s, now) if center is None else (center - window_s, center + window_s)
        answer = job.timeline.window(start=start, end=end, now=now, node=node, rank=rank)
        answer["around_failure"] = failure
        # The answer is a copy: encoding it (megabytes at the bound) need not hold up the event loop.
        body = await asyncio.to_thread(json.dumps, answer)
        return Response(body, media_type="application/json")

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> Response:
        return Response(generate_latest(runtime.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return BearerAuth(app, token=token, metrics_token=metrics_token)
