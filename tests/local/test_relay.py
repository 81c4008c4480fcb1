"""The relay that gives a local node a bad network: real sockets, an echo server behind it."""

from __future__ import annotations

import socket
import socketserver
import threading
import time
from collections.abc import Iterator

import pytest

from phalanx.local.relay import Relay

pytestmark = pytest.mark.timeout(30)


class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        while data := self.request.recv(65536):
            self.request.sendall(data)


@pytest.fixture
def relay() -> Iterator[Relay]:
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Echo)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    r = Relay(f"127.0.0.1:{server.server_address[1]}")
    r.start()
    try:
        yield r
    finally:
        r.close()
        server.shutdown()
        server.server_close()


def _connect(r: Relay) -> socket.socket:
    host, _, port = r.address.rpartition(":")
    return socket.create_connection((host, int(port)), timeout=10)


def _exchange(sock: socket.socket, payload: bytes) -> tuple[bytes, float]:
    start = time.monotonic()
    sock.sendall(payload)
    got = b""
    while len(got) < len(payload):
        got += sock.recv(65536)
    return got, time.monotonic() - start


def test_relays_both_ways_unchanged(relay: Relay) -> None:
    with _connect(relay) as sock:
        payload = bytes(range(256)) * 4096  # 1 MiB, many chunks
        got, _ = _exchange(sock, payload)
        assert got == payload


def test_latency_delays_each_direction(relay: Relay) -> None:
    with _connect(relay) as sock:
        _, fast = _exchange(sock, b"ping")
        relay.latency_s = 0.3
        got, slow = _exchange(sock, b"ping-" * 1000)
        assert got == b"ping-" * 1000
        assert slow >= 0.6  # 0.3 s there and 0.3 s back
        assert fast < 0.3


def test_cut_holds_traffic_without_an_error_until_it_heals(relay: Relay) -> None:
    with _connect(relay) as sock:
        _exchange(sock, b"before")
        relay.cut()
        time.sleep(0.05)
        sock.sendall(b"during")
        sock.settimeout(1.0)
        with pytest.raises(TimeoutError):  # silence, not a reset
            sock.recv(100)
        relay.heal()
        sock.settimeout(10)
        assert sock.recv(100) == b"during"  # what was sent meanwhile arrives after the heal


def test_a_connection_opened_during_a_cut_goes_through_after_the_heal(relay: Relay) -> None:
    relay.cut()
    time.sleep(0.05)
    with _connect(relay) as sock:
        sock.sendall(b"hello")
        sock.settimeout(0.5)
        with pytest.raises(TimeoutError):
            sock.recv(100)
        relay.heal()
        sock.settimeout(10)
        assert sock.recv(100) == b"hello"


def test_server_close_reaches_the_client(relay: Relay) -> None:
    with _connect(relay) as sock:
        _exchange(sock, b"x")
        relay.close()  # the relay going away closes its connections: the client sees the end
        sock.settimeout(5)
        assert sock.recv(100) == b""
