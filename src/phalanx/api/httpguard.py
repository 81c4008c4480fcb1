"""uvicorn's HTTP protocol, guarded against connections that hold a server without asking it anything.

uvicorn closes a kept-alive connection that idles between requests, but never one that sends no request,
or one byte at a time; and its only cap, ``limit_concurrency``, answers 503 to every request once such
connections fill it. Any Pod that reaches a port could so hold the master's or the operator's HTTP server
until its file descriptors run out and it accepts no one, Prometheus and the kubelet's probes included.
:class:`GuardedH11Protocol` bounds both:

* a request's headers must be complete within :data:`HEADER_TIMEOUT_S` of the connection's start, or of
  the first byte of a later request on a kept-alive connection (a deadline: trickling bytes does not extend
  it); else the connection is closed;
* at most :data:`MAX_CONNECTIONS` are open at once: a connection beyond that closes the oldest one still
  waiting for its first request, or itself when every open connection is serving one. A flood of idle
  connections costs the server at most that many descriptors, and never locks a real client out.

Use it as ``uvicorn.Config(app, http=GuardedH11Protocol)``. TLS handshakes happen before the protocol
sees a connection: asyncio bounds those (60 s), not this module.
"""

from __future__ import annotations

import asyncio
import weakref
from collections import OrderedDict
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import ServerState

HEADER_TIMEOUT_S = 10.0
MAX_CONNECTIONS = 2048

_waiting: weakref.WeakKeyDictionary[ServerState, OrderedDict[GuardedH11Protocol, None]] = (
    weakref.WeakKeyDictionary()
)
"""Per server, its connections that have not yet sent a whole request's headers, oldest first."""


class GuardedH11Protocol(H11Protocol):
    header_timeout_s = HEADER_TIMEOUT_S
    max_connections = MAX_CONNECTIONS

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_deadline: asyncio.TimerHandle | None = None
        self._waiting = _waiting.setdefault(self.server_state, OrderedDict())

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._waiting[self] = None
        self._header_deadline = self.loop.call_later(self.header_timeout_s, self._no_request_in_time)
        if len(self.connections) > self.max_connections:
            oldest = next(iter(self._waiting))  # this one when every other connection serves a request
            oldest.transport.close()
            oldest._forget()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # a request's headers are in: the connection is serving
            self._forget()
        elif self._header_deadline is None and not self.transport.is_closing():
            # The next request on a kept-alive connection has begun: its headers get the same time.
            self._header_deadline = self.loop.call_later(self.header_timeout_s, self._no_request_in_time)

    def connection_lost(self, exc: Exception | None) -> None:
        self._forget()
        super().connection_lost(exc)

    def _no_request_in_time(self) -> None:
        self._header_deadline = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()
        self._forget()

    def _forget(self) -> None:
        self._waiting.pop(self, None)
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None
