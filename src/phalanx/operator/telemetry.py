"""The operator's own health and metrics, on one HTTP port (``OperatorSettings.http_port``).

* ``GET /healthz``: 200 while the operator's event loop answers within a few seconds, else 503; the
  Deployment's liveness probe, so a wedged operator is restarted instead of leaving every job unreconciled.
* ``GET /metrics``: Prometheus text, only with ``Authorization: Bearer <metrics token>`` (the chart's shared
  metrics token, the one every master also takes for its /metrics); served only when there is such a token.

The metrics have bounded labels: pass results, action kinds, job phases; never a job's name.
"""

from __future__ import annotations

import asyncio
import hmac
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import uvicorn
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from phalanx.api.elasticjob import Phase
from phalanx.api.httpguard import GuardedH11Protocol

PHASES = tuple(phase for phase in Phase if phase is not Phase.PENDING)


class OperatorMetrics:
    """What the operator did, for Prometheus: its passes, the actions they took, the jobs by phase."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.passes = Counter(
            "phalanx_operator_reconcile_passes",
            "Reconciliation passes, by result (error: the pass could not observe or decide).",
            labelnames=["result"],
            registry=self.registry,
        )
        self.duration = Histogram(
            "phalanx_operator_reconcile_duration_seconds",
            "Time one reconciliation pass took: observing the job, deciding and carrying out its actions.",
            registry=self.registry,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
        )
        self.actions = Counter(
            "phalanx_operator_actions",
            "Actions carried out (Create, DeletePod, PatchStatus, Event, ...), by kind.",
            labelnames=["action"],
            registry=self.registry,
        )
        self.action_failures = Counter(
            "phalanx_operator_action_failures",
            "Actions the Kubernetes API refused or failed, by kind.",
            labelnames=["action"],
            registry=self.registry,
        )
        self._phases: dict[tuple[str, str], Phase] = {}
        self._lock = threading.Lock()
        self.registry.register(_Phases(self))

    def job_phase(self, namespace: str, name: str, phase: Phase | None) -> None:
        """Records a job's phase after a pass; None: the job is gone (or has no phase yet)."""
        with self._lock:
            if phase is None:
                self._phases.pop((namespace, name), None)
            else:
                self._phases[(namespace, name)] = phase

    def phase_counts(self) -> dict[str, int]:
        with self._lock:
            phases = list(self._phases.values())
        return {p.value: phases.count(p) for p in PHASES}


class _Phases(Collector):
    def __init__(self, metrics: OperatorMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[GaugeMetricFamily]:
        jobs = GaugeMetricFamily("phalanx_operator_jobs", "ElasticJobs the operator handles, by phase.",
                                 labels=["phase"])  # fmt: skip
        for phase, count in self._metrics.phase_counts().items():
            jobs.add_metric([phase], count)
        yield jobs


def loop_answers(loop: asyncio.AbstractEventLoop, *, timeout_s: float = 5.0) -> bool:
    """Whether ``loop`` runs a no-op within ``timeout_s`` (called from another thread)."""

    async def noop() -> None:
        return None

    if loop.is_closed() or not loop.is_running():
        return False
    future = asyncio.run_coroutine_threadsafe(noop(), loop)
    try:
        future.result(timeout=timeout_s)
    except Exception:  # a timeout or a loop shutting down: not healthy either way
        future.cancel()
        return False
    return True


class TelemetryServer:
    """The health and metrics server, running on its own thread and event loop."""

    def __init__(self, server: uvicorn.Server, sock: socket.socket) -> None:
        self._server = server
        self._sock = sock
        self._thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="operator-http",
                                        daemon=True)  # fmt: skip
        self._thread.start()

    @property
    def server_address(self) -> tuple[str, int]:
        host, port = self._sock.getsockname()[:2]
        return str(host), int(port)

    def shutdown(self) -> None:
        self._server.should_exit = True
        self._thread.join(10)


def serve(
    *,
    port: int,
    metrics: OperatorMetrics,
    healthy: Callable[[], bool],
    token: str,
    host: str = "0.0.0.0",
) -> TelemetryServer:
    """Starts the health and metrics server on a daemon thread; returns it (``server_address`` has the
    port when ``port`` is 0). uvicorn with :mod:`phalanx.api.httpguard`'s protocol: connections that send no
    request are closed, and however many a Pod opens the kubelet's probe still gets in. Two plain routes
    need no framework: FastAPI's import would lengthen every operator start (a standby's takeover)."""

    async def answer(path: str, authorization: bytes) -> tuple[int, bytes, bytes]:
        if path == "/healthz":
            if await asyncio.to_thread(healthy):  # blocks up to loop_answers' timeout: off this loop
                return 200, b"ok\n", b"text/plain"
            return 503, b"the operator's event loop does not answer\n", b"text/plain"
        if path != "/metrics" or not token:
            return 404, b"not found\n", b"text/plain"
        if not hmac.compare_digest(authorization, f"Bearer {token}".encode()):
            return 401, b"unauthorized\n", b"text/plain"
        return 200, generate_latest(metrics.registry), b"text/plain; version=0.0.4"

    async def app(scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        if scope["type"] != "http":
            return
        authorization = dict(scope["headers"]).get(b"authorization", b"")
        status, body, content_type = await answer(scope["path"], authorization)
        headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    # Listening before the server's thread runs: a connection that comes first waits in the backlog instead
    # of being refused (the fuzz test's first request was, once).
    sock.listen(2048)
    config = uvicorn.Config(app, http=GuardedH11Protocol, log_level="warning", access_log=False,
                            lifespan="off", log_config=None)  # fmt: skip
    return TelemetryServer(uvicorn.Server(config), sock)
