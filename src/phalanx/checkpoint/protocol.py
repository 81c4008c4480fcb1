"""The control channel between training processes and the checkpoint host (torch-free).

A unix domain socket carrying newline-delimited JSON, one request and one reply at a time per
connection; bulk data never crosses it (tensors go through shared memory). Environment variables tell a
training process where its host is.
"""

from __future__ import annotations

import json
import os
import socket
import threading
from typing import Any

from phalanx.api.errors import CheckpointError

ENV_SOCKET = "PHALANX_CHECKPOINT_SOCKET"
ENV_SHM_DIR = "PHALANX_CHECKPOINT_SHM_DIR"
ENV_JOB = "PHALANX_CHECKPOINT_JOB"
ENV_STORAGE = "PHALANX_CHECKPOINT_STORAGE"

Message = dict[str, Any]


def job_id_from_env(env: os._Environ[str] | dict[str, str]) -> str:
    """The job id a training process belongs to, with torchrun's run id as fallback."""
    return env.get(ENV_JOB) or env.get("PHALANX_JOB_ID") or env.get("TORCHELASTIC_RUN_ID") or "default"


def socket_identity(path: str | os.PathLike[str]) -> tuple[int, int, int] | None:
    """What tells the socket a host bound at ``path`` from one bound there later (None: no socket). The
    inode number alone does not: a file system reuses a freed one at once."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_ctime_ns


def send(sock: socket.socket, message: Message) -> None:
    """Sends one JSON line."""
    sock.sendall(json.dumps(message, separators=(",", ":")).encode() + b"\n")


class LineReader:
    """Reads JSON lines from a socket."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buf = b""

    def read(self) -> Message | None:
        """The next message, or None when the peer closed the connection."""
        while b"\n" not in self._buf:
            chunk = self._sock.recv(65536)
            if not chunk:
                return None
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        message = json.loads(line)
        if not isinstance(message, dict):
            raise ValueError("a control message must be a JSON object")
        return message


class HostTimeoutError(CheckpointError):
    """The host did not answer in time: it is hung (stopped, or stuck in the kernel), not gone."""


class HostClient:
    """A connection to the checkpoint host; thread-safe, one request in flight at a time.

    A call that fails or times out closes the connection: a late reply would otherwise be read as the
    answer to the next request. Every later call raises at once; connect again (the host's agent
    replaces a host that died or hangs)."""

    def __init__(self, path: str, *, timeout_s: float = 10.0) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._broken = ""
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout_s)
        try:
            self._sock.connect(path)
        except OSError as exc:
            self._sock.close()
            raise CheckpointError(f"cannot reach the checkpoint host at {path}: {exc}") from exc
        self._sock.settimeout(None)
        self._reader = LineReader(self._sock)

    def call(self, message: Message, *, timeout_s: float | None = None) -> Message:
        """Sends a request and returns the reply; raises HostTimeoutError when none came in ``timeout_s``
        and CheckpointError when the host is gone."""
        with self._lock:
            if self._broken:
                raise CheckpointError(f"the connection to the checkpoint host at {self.path} {self._broken}")
            try:
                self._sock.settimeout(timeout_s)
                send(self._sock, message)
                reply = self._reader.read()
            except TimeoutError as exc:
                self._break("timed out")
                raise HostTimeoutError(
                    f"the checkpoint host at {self.path} did not answer {message.get('op')!r} in {timeout_s}s"
                ) from exc
            except (OSError, ValueError) as exc:
                self._break("failed")
                raise CheckpointError(f"the checkpoint host at {self.path} failed: {exc}") from exc
            if reply is None:
                self._break("was closed")
                raise CheckpointError(f"the checkpoint host at {self.path} closed the connection")
            return reply

    def _break(self, why: str) -> None:
        self._broken = why
        self._sock.close()

    def close(self) -> None:
        """Closes the connection."""
        self._sock.close()
