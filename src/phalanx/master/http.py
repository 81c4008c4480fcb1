"""The master's HTTP API (FastAPI) for people, ``phalanx local`` and Prometheus.

Every endpoint, ``/healthz`` and ``/metrics`` included, needs ``Authorization: Bearer <job token>``;
otherwise the answer is 401. ``GET /metrics`` also accepts the metrics token (``--metrics-token-file``), one
read-only credential a Prometheus PodMonitor can present to every job's master. Bad query parameters get
422. All bodies are JSON except ``/metrics``.
The shapes below are a contract (``phalanx local`` and the operator read them); add fields, never
rename or remove one.

``GET /healthz`` -> ``{"status": "ok", "phase": str}``

``GET /v1/job`` -> the job status, also what the StatusSink publishes::

    job_id: str
    phase: "Pending" | "Running" | "Restarting" | "Suspended" | "Succeeded" | "Failed"
    suspended: bool                  the ElasticJob's spec.suspend, as the master follows it
    spec_generation: int             the generation of the ElasticJob spec it follows (0 outside Kubernetes)
    reason: str                      why the job ended (or ""), one sentence
    round: int                       latest completed rendezvous round, 0 before the first
    open_round: int | null           the round gathering now, if any
    world_size: int                  processes in `round`
    members: [node_id]               nodes of `round` in group-rank order
    waiting: [node_id]               nodes that joined `open_round`
    min_nodes, max_nodes: int
    nodes_alive: int
    restart_count, max_restarts: int
    eviction_count, max_evictions: int
    evictions: [{node_id, machine, reason, kind, requested_at}]
                                     kind: heartbeat_timeout | hardware | hang | probe_failed | straggler
    committed_checkpoint_step: int   -1 if none
    max_step: int                    highest step any rank reported, -1 before the first
    root_cause: null | {node_id, round, rank, local_rank, exit_code, failure_class, kind, message,
                        traceback, log_tail: [str], unix, last_step, explanation}
                                     of the latest failed round: its first real failure, a peer's
                                     communication error (an echo) only when nothing else failed;
                                     explanation: one sentence ("rank 1 on node-1 SIGKILLed at
                                     12:00:01.2 UTC; ranks 0, 2, 3 lost their peer after it")
    hang_analysis: null | {round, hung_node, odd_nodes: [str], odd_ranks: [int], nodes_reported, reason,
                           blamed}
                                     hung_node: the node that reported; blamed: the node the hang
                                     counts against ("": none, nothing singled one out)
    started_unix: float
    completed: [node_id]             members that reported completion of `round`
    probe: null | {id, round, trigger, result, members: [node_id], started_unix, finished_unix: float | null,
                   reported: {matmul|allgather: [node_id]}, stale_reports: int,
                   verdicts: [{node_id, kind, confidence, value, reference, reason}], evicted: [node_id]}
                                     the running or latest probe round (see phalanx.master.probing);
                                     result: running | ok | suspects | evicted | inconclusive | aborted
    slow_ranks: [{rank, node, median_interval_s, reference_s, reason}]
                                     ranks of `round` whose step intervals lag the others' (step-time check)

``GET /v1/nodes`` -> ``{"nodes": [{node_id, incarnation, host, machine, nproc, agent_version, status
(alive|lost|evicted), state (idle|rendezvous|running|restarting|succeeded|failed|leaving), round,
last_heartbeat_unix, heartbeat_age_s, disconnected_unix (when a held heartbeat's connection closed
and the node was not heard from since, else null), ranks: [{rank, local_rank, step, step_unix,
beacon_age_s, pid}], agent_restarts, memory_checkpoint_step, probes: {matmul|allgather: [{peer_node_id,
ok, elapsed_s, rate, error, unix, probe_round}]}, exit_reason, member: bool, group_rank: int (-1 if not a
member), hang_count, straggler: null | {verdict (ok|suspect|slow), basis (compute|step), step_time_s, value_s,
relative, reference_s, individual, baseline_s, slow_checks, reason}}]}``: ``straggler`` is the node's
latest step-time scores (see :meth:`phalanx.master.slowsteps.StepChecks.straggler_view`)

``GET /v1/events?since=SEQ&limit=N`` -> ``{"events": [{seq, unix, kind, node, rank, round, message}],
"next_seq": int}``: events with ``seq > since``, oldest first. ``seq`` increases by one per event and
jumps forward (never back) when the master restarts; kinds
are listed in :data:`phalanx.master.events.KINDS` (job_started, master_resumed, node_registered,
node_replaced, node_joined, round_open, round_complete, node_disconnected, node_lost, failure, restart,
root_cause (a later report of the round named a better root cause than the restart went by),
eviction_requested, hang, hang_analysis, checkpoint_breakpoint, checkpoint_committed, checkpoint_failed,
node_completed, job_succeeded, job_failed, probe_started, probe_finished, probe_failed, straggler,
slow_steps, job_suspended, job_resumed, node_left).

``POST /v1/probe`` -> 202 ``{"probe": <the probe field of /v1/job>}`` once a probe round started; 409
``{"error": str}`` when none can start (probes disabled, no running round, a probe round running, no
kind of ``probes.kinds`` that runs on this many nodes).

``GET /v1/logs?node=&rank=&tail=N`` -> ``{"lines": [{unix, node, rank, local_rank, stream (out|err),
text}]}``: the newest ``tail`` (default 100) lines of the matching (node, rank) rings, oldest first.

``GET /v1/timeline?around=&window_s=S&node=&rank=`` -> the ranks' recent intervals (see
:mod:`phalanx.master.timeline`): ``{now_unix, start_unix, end_unix, ranks: [{node, rank, local_rank, pid,
last_beat_unix, intervals: [{name, group, seq, start_unix_ns, end_unix_ns (0: open), device, open,
unfinished}]}], failures: [{id, unix, kind, node, rank, round, message}], around_failure: null | <a
failure>, refused, kept, omitted, max_age_s}``. At most 65,536 intervals, each rank's newest share;
``omitted`` counts the rest (narrow with ``node``, ``rank`` or ``window_s``). ``around`` empty: the last
``window_s`` (default 120) seconds up to now; ``latest``: the newest failure, and the window is
``window_s`` seconds each side of it; a whole number below 10^9: the failure with that id (its event's
``seq``), likewise; otherwise a unix time, likewise. 404 ``{"error": str}`` when no such failure is
remembered.

``GET /metrics`` -> Prometheus text format (see :mod:`phalanx.master.metrics`).

``GET /openapi.json`` -> the OpenAPI schema of these endpoints (behind the token like the rest; the fuzz
tests generate their requests from it).
"""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from fastapi import FastAPI, Query
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel

from phalanx.api import auth
from phalanx.master.errors import RequestError
from phalanx.master.runtime import Runtime
from phalanx.master.timeline import Timeline

__all__ = ["create_app"]

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class BearerAuth:
    """ASGI middleware: 401 unless the request carries the job's bearer token, or the metrics token for a
    GET of /metrics (a read-only credential Prometheus may share across jobs)."""

    def __init__(self, app: ASGIApp, *, token: str, metrics_token: str = "") -> None:
        self._app = app
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
        await self._app(scope, receive, send)


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


def create_app(runtime: Runtime, *, token: str, metrics_token: str = "") -> ASGIApp:
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

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        return {"status": "ok", "phase": job.phase}

    @app.get("/v1/job")
    async def get_job() -> dict[str, Any]:
        return job.status()

    @app.get("/v1/nodes")
    async def get_nodes() -> dict[str, Any]:
        now = runtime.now()
        round_ = job.round
        nodes = []
        for node in sorted(job.nodes.values(), key=lambda n: n.node_id):
            view = node.view(now=now)
            member = round_.member(node.node_id) if round_ else None
            view["member"] = member is not None
            view["group_rank"] = member.group_rank if member else -1
            view["hang_count"] = job.hang_counts.get(node.node_id, 0)
            view["straggler"] = job.straggler_view(node.node_id)
            nodes.append(view)
        return {"nodes": nodes}

    @app.post(
        "/v1/probe",
        status_code=202,
        responses={
            202: {"description": "A probe round started."},
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
        return JSONResponse({"probe": probe.view()}, status_code=202)

    @app.get("/v1/events")
    async def get_events(
        since: int = Query(0, ge=0), limit: int = Query(1000, ge=1, le=10_000)
    ) -> dict[str, Any]:
        return {
            "events": [e.to_json() for e in job.events.since(since, limit=limit)],
            "next_seq": job.events.next_seq,
        }

    @app.get("/v1/logs")
    async def get_logs(
        node: str = Query("", max_length=253),
        rank: int | None = Query(None, ge=0),
        tail: int = Query(100, ge=0, le=100_000),
    ) -> dict[str, Any]:
        return {"lines": runtime.logs.tail(node=node, rank=rank, tail=tail)}

    @app.get(
        "/v1/timeline",
        responses={404: {"description": "No failure with that id is remembered.", "model": ErrorBody}},
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
