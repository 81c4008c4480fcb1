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
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from phalanx.api.elasticjob import Phase

PHASES = tuple(phase.value for phase in Phase if phase is not Phase.PENDING)


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
        self._phases: dict[tuple[str, str], str] = {}
        self._lock = threading.Lock()
        self.registry.register(_Phases(self))

    def job_phase(self, namespace: str, name: str, phase: str | None) -> None:
        """Records a job's phase after a pass; None: the job is gone."""
        with self._lock:
            if phase is None:
                self._phases.pop((namespace, name), None)
            else:
                self._phases[(namespace, name)] = phase

    def phase_counts(self) -> dict[str, int]:
        with self._lock:
            phases = list(self._phases.values())
        return {p: phases.count(p) for p in PHASES}


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


def serve(
    *,
    port: int,
    metrics: OperatorMetrics,
    healthy: Callable[[], bool],
    token: str,
    host: str = "0.0.0.0",
) -> ThreadingHTTPServer:
    """Starts the health and metrics server in a daemon thread; returns it (``server_address`` has the
    port when ``port`` is 0)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path == "/healthz":
                ok = healthy()
                self._reply(
                    200 if ok else 503, b"ok\n" if ok else b"the operator's event loop does not answer\n"
                )
            elif self.path == "/metrics" and token:
                given = self.headers.get("Authorization", "")
                if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
                    self._reply(401, b"unauthorized\n")
                    return
                self._reply(200, generate_latest(metrics.registry), "text/plain; version=0.0.4")
            else:
                self._reply(404, b"not found\n")

        def _reply(self, code: int, body: bytes, content_type: str = "text/plain") -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            return

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="operator-http", daemon=True).start()
    return server
