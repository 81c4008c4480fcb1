"""The checkpoint host's messages: typed at the boundary, and a malformed line is answered with an error
that says what is wrong while the host goes on serving (a real host process, raw bytes on its socket)."""

from __future__ import annotations

import json
import socket
from typing import Any

import pytest

from phalanx.checkpoint import host as host_mod
from phalanx.checkpoint import messages, protocol


def test_every_request_survives_the_wire() -> None:
    for request in (
        messages.Alloc(rank=3, size=4096),
        messages.Persist(rank=0, step=7),
        messages.Persist(rank=1),
        messages.Wait(rank=2, step=None, timeout=1.5),
        messages.PersistNow(),
        messages.Ping(),
        messages.Stop(),
    ):
        wire = json.loads(json.dumps(request.to_dict()))
        assert messages.parse_request(wire) == request


@pytest.mark.parametrize(
    ("message", "why"),
    [
        ([1, 2], "JSON object"),
        ({"rank": 0}, "unknown request None"),
        ({"op": "format_disk"}, "unknown request 'format_disk'"),
        ({"op": 5}, "unknown request 5"),
        ({"op": "alloc", "rank": 0}, "'size'"),
        ({"op": "alloc", "rank": "0", "size": 10}, "'rank'"),
        ({"op": "alloc", "rank": True, "size": 10}, "'rank'"),  # a bool is no rank
        ({"op": "alloc", "rank": 0, "size": -1}, "'size'"),
        ({"op": "persist", "rank": 0, "step": 1.5}, "'step'"),
        ({"op": "wait", "rank": 0, "timeout": "soon"}, "'timeout'"),
    ],
)
def test_a_malformed_request_is_refused_with_what_is_wrong(message: Any, why: str) -> None:
    with pytest.raises(messages.MalformedMessage, match=why):
        messages.parse_request(message)


def test_replies_read_back_what_the_host_wrote() -> None:
    assert messages.Pong.from_dict(messages.Pong(pid=12, storage="/ckpt").to_dict()) == messages.Pong(
        12, "/ckpt"
    )
    assert messages.Reply.from_dict(messages.Reply.failed("full").to_dict()) == messages.Reply(False, "full")
    with pytest.raises(messages.MalformedMessage):
        messages.Allocated.from_dict({"ok": True, "paths": [1]})


def test_the_host_answers_malformed_lines_with_an_error_and_keeps_serving(
    host: host_mod.HostHandle,
) -> None:
    lines = [
        b"not json at all",
        b"[1, 2]",
        b'{"op": "format_disk"}',
        b'{"op": "alloc", "rank": "zero", "size": 4096}',
        b'{"op": "wait", "rank": 0, "timeout": {}}',
        b"\xff\xfe",
    ]
    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(str(host.socket_path))
        sock.settimeout(10)
        reader = sock.makefile("rb")
        for line in lines:
            sock.sendall(line + b"\n")
            reply = json.loads(reader.readline())
            assert reply["ok"] is False, line
            assert reply["error"].startswith("bad request: "), reply
        sock.sendall(b'{"op": "ping"}\n')  # the same connection still serves
        assert json.loads(reader.readline()) == {"ok": True, "pid": host.pid, "storage": host.storage}
    assert host.alive()


def test_a_line_that_never_ends_closes_its_connection_not_the_host(host: host_mod.HostHandle) -> None:
    """A client that streams bytes without a newline would otherwise grow the host's buffer without end."""

    def closed_by_the_host(sock: socket.socket) -> bool:
        try:
            for _ in range(4 * protocol.MAX_LINE_BYTES // 65536):
                sock.sendall(b"x" * 65536)
            return sock.recv(1) == b""  # a host that buffers on answers nothing: the timeout fails the test
        except (BrokenPipeError, ConnectionResetError):
            return True

    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(str(host.socket_path))
        sock.settimeout(10)
        assert closed_by_the_host(sock)
    with socket.socket(socket.AF_UNIX) as sock:  # and the host serves the next client
        sock.connect(str(host.socket_path))
        sock.settimeout(10)
        sock.sendall(b'{"op": "ping"}\n')
        assert json.loads(sock.makefile("rb").readline())["pid"] == host.pid
    assert host.alive()
