"""The guarded uvicorn protocol (phalanx.api.httpguard) on a real server over loopback, with small bounds:
connections that trickle a request are closed at the deadline, and a connection beyond the cap closes the
oldest idle one instead of locking the new client out. The 20,000-connection runs against the master and
the operator are in tests/master/test_connection_flood.py."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import uvicorn
from fastapi import FastAPI

from phalanx.api.httpguard import GuardedH11Protocol


class Small(GuardedH11Protocol):
    header_timeout_s = 2.0
    max_connections = 4


@pytest.fixture
def port() -> Iterator[int]:
    app = FastAPI()

    @app.get("/")
    async def root() -> dict[str, str]:
        return {"ok": "yes"}

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, http=Small, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    yield sock.getsockname()[1]
    server.should_exit = True
    thread.join(5)
    sock.close()


def closed_within(conn: socket.socket, seconds: float, *, trickle: bytes = b"") -> float:
    """Seconds until the server closes ``conn``, sending ``trickle`` every 0.2 s meanwhile."""
    start = time.monotonic()
    conn.settimeout(0.2)
    while time.monotonic() - start < seconds:
        try:
            if trickle:
                conn.sendall(trickle)
            if conn.recv(4096) == b"":
                return time.monotonic() - start
        except TimeoutError:
            continue
        except (ConnectionResetError, BrokenPipeError):
            return time.monotonic() - start
    raise AssertionError(f"the server kept the connection open for {seconds} s")


def test_a_connection_that_sends_nothing_or_trickles_its_headers_is_closed_at_the_deadline(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as idle:
        assert closed_within(idle, 6) < 4
    with socket.create_connection(("127.0.0.1", port)) as slow:
        slow.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")
        assert closed_within(slow, 6, trickle=b"X-Pad: y\r\n") < 4


def test_a_kept_alive_connections_next_request_gets_the_same_deadline(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        reply = b""
        while not reply.endswith(b'{"ok":"yes"}'):  # the headers and the body may come apart
            chunk = conn.recv(4096)
            assert chunk, reply
            reply += chunk
        conn.sendall(b"GET / HTTP/1.1\r\n")
        assert closed_within(conn, 6, trickle=b"X-Pad: y\r\n") < 4


def test_beyond_the_cap_a_new_client_is_served_and_the_oldest_idle_connection_goes(port: int) -> None:
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(Small.max_connections)]
    try:
        time.sleep(0.2)  # all accepted
        assert httpx.get(f"http://127.0.0.1:{port}/", timeout=2).json() == {"ok": "yes"}
        assert closed_within(idle[0], 1) < 1, "the oldest idle connection made room"
        for conn in idle[1:]:  # the others wait for their deadline: they were not closed for it
            conn.settimeout(0.05)
            with pytest.raises(TimeoutError):
                conn.recv(1)
    finally:
        for conn in idle:
            conn.close()
