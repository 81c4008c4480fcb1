"""The relay that gives a local node a bad network: real sockets, an echo server behind it."""

from __future__ import annotations

import socket
import socketserver
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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


@pytest.mark.timeout(120)
def test_an_agent_registers_and_joins_over_a_link_slower_than_its_default_deadlines(tmp_path: Path) -> None:
    """3 s each way between the agent and a real master: a round trip (6 s) is longer than the 5 s default
    deadline of RegisterNode and JoinRendezvous. The agent's client doubles its deadlines on each call that
    ran out of time, so its retries get through; with fixed deadlines every attempt failed."""
    from phalanx.agent.client import MasterClient, MasterUnavailableError
    from phalanx.api.v1 import master_pb2 as pb
    from tests.master.procs import TOKEN, Master

    master = Master(tmp_path, "--nodes", "1:1")
    relay = Relay(master.grpc)
    client = MasterClient(address=relay.start(), token=TOKEN)
    relay.latency_s = 3.0
    try:
        late = 0

        def retried(call: Any) -> Any:
            nonlocal late
            while True:
                try:
                    return call()
                except MasterUnavailableError as exc:
                    if not exc.late:  # refused, not slow: the master is not there
                        raise
                    late += 1
                    assert late <= 4, "the deadlines did not grow"

        register = pb.RegisterNodeRequest(
            job_id="test-job", node_id="n", incarnation="i", host="127.0.0.1", nproc_per_node=1
        )
        join = pb.JoinRendezvousRequest(
            node_id="n", incarnation="i", nproc_per_node=1, store_host="127.0.0.1", store_port=1
        )
        started = time.monotonic()
        reg = retried(lambda: client.register(register))
        joined = retried(lambda: client.join(join))
        took = time.monotonic() - started
    finally:
        client.close()
        relay.close()
        master.stop()
    assert reg.heartbeat_interval_s > 0
    assert joined.round == 1
    assert late >= 1, "the link was not slower than the default deadline"
    assert client.stretch >= 2.0
    print(f"\nregister + join over 3 s each way: {took:.1f}s, {late} attempt(s) out of time")
