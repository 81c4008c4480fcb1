"""Runs a job's master: one asyncio process serving gRPC (agents) and HTTP (people, Prometheus).

:func:`run_master` binds both servers (port 0 picks a free port), prints the two address lines other
tools parse, runs until SIGTERM or SIGINT, then shuts down gracefully: stops accepting calls, gives
running ones a moment to finish, saves the state a last time and closes the job log.

The first two lines of stdout are exactly::

    PHALANX_MASTER_GRPC=<host>:<port>
    PHALANX_MASTER_HTTP=<host>:<port>
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
from collections.abc import Generator
from pathlib import Path
from typing import TextIO

import grpc
import uvicorn
from grpc import aio

from phalanx.api import auth
from phalanx.api.errors import ConfigError
from phalanx.api.httpguard import GuardedH11Protocol
from phalanx.api.settings import MasterSettings
from phalanx.master.job import Job
from phalanx.master.serve.grpc_service import AuthInterceptor, add_to_server
from phalanx.master.serve.http_api import create_app
from phalanx.master.serve.logstore import LogStore
from phalanx.master.serve.runtime import Runtime
from phalanx.master.store.stores import StateStore, StatusSink

__all__ = ["job_log_path", "run_master"]

log = logging.getLogger("phalanx.master")

MAX_SEND_BYTES = 16 * 1024 * 1024
SHUTDOWN_GRACE_S = 1.0
PARENT_POLL_S = 0.5


class _HttpServer(uvicorn.Server):
    """uvicorn without its own signal handling: the master's loop owns SIGTERM/SIGINT."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


def _addr(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def job_log_path(settings: MasterSettings) -> Path | None:
    """``<log_dir>/<job>.log``, or beside the state file; None without either (or in Kubernetes)."""
    if settings.log_dir:
        return Path(settings.log_dir) / f"{settings.job_id}.log"
    if settings.state_path and "://" not in settings.state_path:
        state = Path(settings.state_path)
        return state.with_name(f"{state.stem}.log")
    return None


def _tick_interval(settings: MasterSettings) -> float:
    candidates = [0.25, settings.heartbeat.interval_s / 2]
    if settings.rendezvous.last_call_s > 0:
        candidates.append(settings.rendezvous.last_call_s / 2)
    return max(0.05, min(candidates))


def _http_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {_addr(host, port)}: {exc.strerror}", field="http_port") from exc
    sock.listen(128)
    sock.setblocking(False)
    return sock


def _tls_pair(settings: MasterSettings) -> tuple[bytes, bytes] | None:
    """The certificate chain and key (PEM) to serve TLS with, or None for plain text; a file that cannot be
    read is a ConfigError naming its setting."""
    if not settings.tls_cert_file:
        return None
    pair = []
    for field in ("tls_cert_file", "tls_key_file"):
        path = getattr(settings, field)
        try:
            pair.append(Path(path).read_bytes())
        except OSError as exc:
            raise ConfigError(f"cannot read {path}: {exc.strerror}", field=field) from exc
    return pair[0], pair[1]


async def _watch_parent(parent_pid: int, stopping: asyncio.Event) -> None:
    """Sets ``stopping`` once ``parent_pid`` is no longer this process's parent (it exited: this process
    was re-parented), so a master started for one agent never outlives it."""
    while True:  # polled: Linux tells a process nothing when its parent dies, short of PDEATHSIG
        await asyncio.sleep(PARENT_POLL_S)
        if os.getppid() != parent_pid:
            break
    log.warning("the process that started this master (pid %d) is gone; shutting down", parent_pid)
    stopping.set()


async def run_master(
    settings: MasterSettings,
    *,
    token: str,
    store: StateStore,
    sink: StatusSink,
    metrics_token: str = "",
    out: TextIO = sys.stdout,
    parent_pid: int = 0,
) -> int:
    """Serves the job until SIGTERM/SIGINT (or, with ``parent_pid``, until that parent exits); returns
    the process exit code. ``metrics_token``, when given, is accepted for GET /metrics only."""
    auth.check_token(token, field="token_file")  # whoever calls: a short token is never served
    if metrics_token:
        auth.check_token(metrics_token, field="metrics_token_file")
    loop = asyncio.get_running_loop()
    saved = await asyncio.to_thread(store.load)
    job = Job(settings=settings, now=Runtime.now(), saved=saved)
    logs = LogStore(
        ring_lines=settings.logs.ring_lines,
        max_line_bytes=settings.logs.max_line_bytes,
        path=job_log_path(settings),
    )
    rt = Runtime(job=job, logs=logs, store=store, sink=sink)

    grpc_server, grpc_port = _grpc_server(settings, rt, token=token)
    sock = _http_socket(settings.host, settings.http_port)
    http_port = sock.getsockname()[1]
    await grpc_server.start()
    http = _http_server(settings, rt, token=token, metrics_token=metrics_token)
    http_task = asyncio.create_task(http.serve(sockets=[sock]))
    print(f"PHALANX_MASTER_GRPC={_addr(settings.host, grpc_port)}", file=out, flush=True)
    print(f"PHALANX_MASTER_HTTP={_addr(settings.host, http_port)}", file=out, flush=True)
    log.info(
        "serving job %s: gRPC %s, HTTP %s, phase %s, round %d",
        settings.job_id,
        grpc_port,
        http_port,
        job.phase,
        job.round_number,
        extra={"round": job.round_number},
    )

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, rt.stopping.set)
    rt.after()
    workers = [
        asyncio.create_task(rt.saver()),
        asyncio.create_task(rt.ticker(_tick_interval(settings))),
        asyncio.create_task(rt.publisher()),
        asyncio.create_task(rt.fence()),
    ]
    if parent_pid:
        workers.append(asyncio.create_task(_watch_parent(parent_pid, rt.stopping)))
    try:
        await rt.stopping.wait()
    finally:
        log.info("shutting down", extra={"round": job.round_number})
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        await grpc_server.stop(SHUTDOWN_GRACE_S)
        http.should_exit = True
        for task in workers:
            task.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(http_task, SHUTDOWN_GRACE_S + 1)
        if not rt.fenced:  # a fenced master's state and status are its replacement's now
            try:
                await rt.save_now()
                await asyncio.to_thread(sink.publish, job.status())
            except Exception:
                log.exception("final save of the master state failed")
        logs.close()
    return FENCED_EXIT if rt.fenced else 0


FENCED_EXIT = 3
"""The exit status of a master that stopped because another took over its job (:meth:`Runtime.fence`)."""

MAX_AGENTS = 5000
"""The most nodes a job has (an ElasticJob's ``nodes.max``), each one agent."""

MAX_CONCURRENT_RPCS = 4 * MAX_AGENTS
"""RPCs the agents' server runs at once; beyond it a call is refused (RESOURCE_EXHAUSTED, which an agent
retries) instead of queued without bound. Every agent has at most a few calls under way."""

GRPC_CONNECTION_LIMITS = (
    # Connections beyond this are closed as they come: one per agent, and room to spare.
    ("grpc.max_allowed_incoming_connections", 2 * MAX_AGENTS),
    # A connection that has not finished its HTTP/2 (and TLS) handshake in 10 s is closed (gRPC: 120 s).
    ("grpc.server_handshake_timeout_ms", 10_000),
    # A connection without a call for 5 minutes is closed; an agent's heartbeat calls every few seconds.
    ("grpc.max_connection_idle_ms", 300_000),
    # No cap on streams per connection: a client that opens many calls at once before it has read the
    # server's settings has them refused (RST_STREAM), and MAX_CONCURRENT_RPCS bounds them all anyway.
)
"""Bounds on the connections of the agents' port: a Pod holding thousands open cannot exhaust the master's
descriptors, and the agents (one connection each, their calls a few at a time) never meet them."""


def _grpc_server(settings: MasterSettings, rt: Runtime, *, token: str) -> tuple[aio.Server, int]:
    """The agents' gRPC server, every call checked against the job token; TLS when the settings name a
    certificate. Bound, not started; returns it and its port."""
    grpc_server = aio.server(
        interceptors=[AuthInterceptor(token)],
        options=[
            ("grpc.max_receive_message_length", settings.max_request_bytes),
            ("grpc.max_send_message_length", MAX_SEND_BYTES),
            ("grpc.so_reuseport", 0),
            *GRPC_CONNECTION_LIMITS,
        ],
        maximum_concurrent_rpcs=MAX_CONCURRENT_RPCS,
    )
    add_to_server(grpc_server, rt)
    tls = _tls_pair(settings)
    try:
        address = _addr(settings.host, settings.grpc_port)
        if tls is None:
            grpc_port = grpc_server.add_insecure_port(address)
        else:
            grpc_port = grpc_server.add_secure_port(address, grpc.ssl_server_credentials([(tls[1], tls[0])]))
    except RuntimeError as exc:
        raise ConfigError(
            f"cannot listen on {_addr(settings.host, settings.grpc_port)}", field="grpc_port"
        ) from exc
    return grpc_server, grpc_port


TLS_HANDSHAKE_TIMEOUT_S = 10.0
"""A connection to the HTTP port that has not finished its TLS handshake by then is closed (asyncio's default:
60 s). The guarded protocol sees a connection only once TLS is up, so this bounds what comes before it: a
Pod opening connections and never starting TLS holds each for 10 s, as on the gRPC port."""


def _http_server(settings: MasterSettings, rt: Runtime, *, token: str, metrics_token: str) -> _HttpServer:
    """The HTTP API for people and Prometheus (TLS with the gRPC server's certificate when it has one)."""
    if settings.tls_cert_file:
        # uvicorn passes no handshake timeout to the loop, so asyncio's module default applies: this process
        # serves only the master's ports, which all want the bound.
        asyncio.constants.SSL_HANDSHAKE_TIMEOUT = TLS_HANDSHAKE_TIMEOUT_S  # type: ignore[attr-defined]
    return _HttpServer(
        uvicorn.Config(
            create_app(rt, token=token, metrics_token=metrics_token),
            log_level="warning",
            access_log=False,
            lifespan="off",
            log_config=None,
            http=GuardedH11Protocol,  # idle and trickling connections closed; a flood never locks one out
            ssl_certfile=settings.tls_cert_file or None,
            ssl_keyfile=settings.tls_key_file or None,
        )
    )
