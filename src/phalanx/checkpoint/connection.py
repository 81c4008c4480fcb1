"""A training process's connection to its node's checkpoint host (torch-free): :class:`HostConnection`.

It connects (starting the host when this is local rank 0 and no agent advertised one), learns who the host
is, reconnects once when the host went away (its agent replaces it), and stops asking a host that hung
until it is replaced (:data:`SILENT_HOLD_S`), so a hung host stalls training once, not at every request.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from phalanx.api.errors import CheckpointError
from phalanx.checkpoint import messages, protocol

CALL_LIMIT_S = 5.0
"""Longest a training process waits for its host to answer a request. Answers take milliseconds (storage
is written on the host's own thread); a host that takes longer is hung, and its agent replaces it, so a
save or persist then fails with an error instead of stalling training."""
SILENT_HOLD_S = 30.0
"""How long a host that did not answer is not asked again while it has not been replaced, so that a hung
host stalls training once, not at every persist (its agent replaces it within seconds)."""


class HostConnection:
    """The connection to this node's checkpoint host, made at the first request.

    ``on_host(pid)`` is told the pid of every host this process meets (a new pid: the host was replaced,
    and what the old one had queued is gone). Without a host advertised in the environment, local rank 0
    starts one (detached, so it survives the training process) with ``host_args`` (see
    :func:`phalanx.checkpoint.host.start`); the other local ranks wait for it."""

    def __init__(
        self,
        *,
        socket_path: str,
        local_rank: int,
        host_args: dict[str, Any],
        on_host: Callable[[int], None],
    ) -> None:
        self.socket_path = socket_path
        self.local_rank = local_rank
        self.call_limit_s = CALL_LIMIT_S
        self._host_args = host_args
        self._on_host = on_host
        self._client: protocol.HostClient | None = None
        self._client_lock = threading.Lock()
        self.pid = 0  # of the host this process is connected to, to notice it was replaced
        self.storage = ""  # where that host persists (canonical), "" for nowhere
        self._lost = False  # a host went away since this process first met one
        self._silent: tuple[tuple[int, int, int], float] | None = None  # (socket, until) of a hung host
        self._own_host: Any = None  # the HostHandle of a host this process started

    def client(self) -> protocol.HostClient:
        """The connection to this node's checkpoint host, starting the host if this is local rank 0."""
        with self._client_lock:
            if self._client is None:
                self._client = self._connect()
                self._met_host(self._client)
            return self._client

    def _connect(self) -> protocol.HostClient:
        try:
            return protocol.HostClient(self.socket_path, timeout_s=2.0)
        except CheckpointError:
            if self.local_rank != 0 or protocol.ENV_SOCKET in os.environ:
                # At first the host may still be starting. Later, a host that went away is not waited
                # for: the agent replaces it, and the next request connects to the new one.
                if self._lost:
                    raise
                return self._connect_retry()
        from phalanx.checkpoint import host

        self._own_host = host.start(
            socket_path=self.socket_path, watch_parent=False, detach=True, **self._host_args
        )
        return self._connect_retry()

    def _connect_retry(self, timeout_s: float = 30.0) -> protocol.HostClient:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return protocol.HostClient(self.socket_path, timeout_s=2.0)
            except CheckpointError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def _met_host(self, client: protocol.HostClient) -> None:
        """Learns who the host is and where it persists."""
        try:
            reply = client.call(messages.Ping(), timeout_s=self.call_limit_s)
        except CheckpointError:
            client.close()
            raise
        self.pid = int(reply.get("pid", 0))
        self.storage = str(reply.get("storage", ""))
        self._on_host(self.pid)

    def _drop_client(self) -> None:
        with self._client_lock:
            if self._client is not None:
                self._client.close()
                self._client = None
            self._lost = True

    def call(self, request: messages.Request, *, timeout_s: float | None) -> messages.Message:
        """One request to the host. A connection the host closed is made again once: the host died, and
        its agent may have replaced it already. A host that does not answer is not asked again, so the
        caller learns of it within ``timeout_s``, and is told at once while that host was not replaced (see
        :data:`SILENT_HOLD_S`)."""
        self._refuse_a_silent_host()
        try:
            return self.client().call(request, timeout_s=timeout_s)
        except protocol.HostTimeoutError:
            self._drop_client()
            identity = protocol.socket_identity(self.socket_path)
            if identity is not None:
                self._silent = (identity, time.monotonic() + SILENT_HOLD_S)
            raise
        except CheckpointError:
            self._drop_client()
        try:
            return self.client().call(request, timeout_s=timeout_s)
        except CheckpointError:
            self._drop_client()
            raise

    def _refuse_a_silent_host(self) -> None:
        if self._silent is None:
            return
        identity, until = self._silent
        if protocol.socket_identity(self.socket_path) == identity and time.monotonic() < until:
            raise protocol.HostTimeoutError(
                f"the checkpoint host at {self.socket_path} did not answer within {self.call_limit_s}s "
                "and has not been replaced yet"
            )
        self._silent = None  # a new host bound the socket, or it is time to ask the old one again

    def allocate(self, rank: int, size: int) -> list[Path]:
        """Has the host create ``rank``'s two slots of ``size`` bytes; their paths."""
        reply = self.call(messages.Alloc(rank=rank, size=size), timeout_s=self.call_limit_s)
        if not reply.get("ok"):
            raise CheckpointError(str(reply.get("error")))
        return [Path(p) for p in messages.Allocated.from_dict(reply).paths]

    def close(self, *, stop_host: bool = False) -> None:
        """Closes the connection; with ``stop_host`` also stops the host (which unlinks the job's memory),
        connecting just for that when this process had no connection."""
        if self._client is not None:
            if stop_host:
                with contextlib.suppress(CheckpointError):
                    self._client.call(messages.Stop(), timeout_s=self.call_limit_s)
            self._client.close()
            self._client = None
            if stop_host and self._own_host is not None:
                self._own_host.stop()
        elif stop_host:
            with contextlib.suppress(CheckpointError, socket.error):
                client = protocol.HostClient(self.socket_path, timeout_s=2.0)
                client.call(messages.Stop(), timeout_s=self.call_limit_s)
                client.close()
