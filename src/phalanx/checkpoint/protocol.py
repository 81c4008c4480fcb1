"""The control channel between training processes and the checkpoint host (torch-free).

A unix domain socket carrying newline-delimited JSON, one request and one reply at a time per
connection (the messages are :mod:`phalanx.checkpoint.messages`); bulk data never crosses it (tensors go
through shared memory). Environment variables tell a
training process where its host is.

The socket lives in the user's 0700 directory of the temporary directory (:func:`socket_path`, the one
place its name is made), and the host answers only a peer of its own user, or root (:func:`peer_allowed`,
from ``SO_PEERCRED``); a client in turn talks only to a host of its own user, or root.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import struct
import tempfile
import threading
from collections.abc import Mapping
from pathlib import Path

from phalanx.api.errors import CheckpointError
from phalanx.checkpoint import shm
from phalanx.checkpoint.messages import Message, Request

ENV_SOCKET = "PHALANX_CHECKPOINT_SOCKET"
ENV_SHM_DIR = "PHALANX_CHECKPOINT_SHM_DIR"
ENV_JOB = "PHALANX_CHECKPOINT_JOB"
ENV_STORAGE = "PHALANX_CHECKPOINT_STORAGE"
ENV_JOB_NAME = "PHALANX_JOB_ID"
ENV_NAMESPACE = "PHALANX_NAMESPACE"
"""The job's Kubernetes namespace, when the operator tells it: two jobs of one name in two namespaces are
two jobs (their node's files and their storage claims must differ)."""
ENV_JOB_UID = "PHALANX_JOB_UID"
"""The ElasticJob's metadata.uid, when the operator tells it: tells apart a job from a deleted one of the
same name."""

MAX_SOCKET_PATH = 107  # sun_path holds 108 bytes, the terminating NUL included


def job_id_from_env(env: Mapping[str, str]) -> str:
    """The job id a training process belongs to, with torchrun's run id as fallback."""
    return env.get(ENV_JOB) or env.get(ENV_JOB_NAME) or env.get("TORCHELASTIC_RUN_ID") or "default"


def job_scope(env: Mapping[str, str]) -> str:
    """What sets a job apart from another one of the same name on the same machine: its uid, else its
    namespace, else nothing (``phalanx local`` and bare runs name their jobs uniquely themselves)."""
    return env.get(ENV_JOB_UID) or env.get(ENV_NAMESPACE) or ""


def job_identity(env: Mapping[str, str], *, fallback: str) -> tuple[str, str]:
    """(name, uid) of the job a process belongs to: the name is ``namespace/name`` on Kubernetes, the job
    id elsewhere (``fallback`` when the environment names none); the uid is "" when unknown."""
    # The job, not the node's share of it (PHALANX_CHECKPOINT_JOB): every node of one job claims storage
    # under one name. torchrun names the job in TORCHELASTIC_RUN_ID.
    name = env.get(ENV_JOB_NAME) or env.get("TORCHELASTIC_RUN_ID") or fallback
    namespace = env.get(ENV_NAMESPACE)
    return (f"{namespace}/{name}" if namespace else name), env.get(ENV_JOB_UID, "")


def socket_dir() -> Path:
    """The directory of this user's checkpoint-host sockets (0700, see :func:`shm.check_private_dir`)."""
    return shm.private_dir(Path(tempfile.gettempdir()))


def socket_path(job_key: str) -> Path:
    """The control socket of the host of ``job_key`` (a node's job id): the only place its name is made.
    A name that would not fit in a socket address (108 bytes) is replaced by a hash of it."""
    directory = socket_dir()
    path = directory / f"ckpt-{shm.sanitize_job(job_key)}.sock"
    if len(os.fsencode(path)) > MAX_SOCKET_PATH:
        path = directory / f"ckpt-{hashlib.sha256(job_key.encode()).hexdigest()[:32]}.sock"
    return path


def host_socket(env: Mapping[str, str], *, job_id: str, given: str | None = None) -> str:
    """Where a training process finds its node's host: the socket it was ``given``, else the one its agent
    advertised in the environment, else its job's own (:func:`socket_path`)."""
    return given or env.get(ENV_SOCKET) or str(socket_path(job_id))


def peer_allowed(peer_uid: int, own_uid: int) -> bool:
    """Whether a process of ``peer_uid`` may use a host run by ``own_uid``: the same user, or root (who
    can read the shared memory anyway)."""
    return peer_uid in (own_uid, 0)


def peer_uid(conn: socket.socket) -> int:
    """The uid of the process at the other end of a unix socket (SO_PEERCRED: set by the kernel)."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return int(uid)


def socket_identity(path: str | os.PathLike[str]) -> tuple[int, int, int] | None:
    """What tells the socket a host bound at ``path`` from one bound there later (None: no socket). The
    inode number alone does not: a file system reuses a freed one at once. The time is the modification
    time, set when the socket is bound and never after: a chmod or chown of the socket changes its ctime,
    and must not look like another host."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_mtime_ns


def send(sock: socket.socket, message: Message) -> None:
    """Sends one JSON line."""
    sock.sendall(json.dumps(message, separators=(",", ":")).encode() + b"\n")


MAX_LINE_BYTES = 1 << 20
"""The longest control message read: requests are a few hundred bytes, replies a few kilobytes (the data
itself goes through shared memory)."""


class LineTooLong(ConnectionError):
    """The peer sent more than :data:`MAX_LINE_BYTES` without ending the line: it does not speak the
    protocol, and the connection is dropped rather than buffered without end."""


class LineReader:
    """Reads JSON lines from a socket."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buf = b""

    def read(self) -> Message | None:
        """The next message, or None when the peer closed the connection. Raises :class:`LineTooLong`
        (an OSError: the connection is unusable) for a line beyond :data:`MAX_LINE_BYTES`, ValueError for
        one that is not a JSON object."""
        while b"\n" not in self._buf:
            if len(self._buf) > MAX_LINE_BYTES:
                raise LineTooLong(f"a control message longer than {MAX_LINE_BYTES} bytes")
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
        # Both ways: the host answers only its own user, and a training process gives its tensors' shared
        # memory only to a host of its own user (or root), never to whoever bound a socket at that path.
        if not peer_allowed(host_uid := peer_uid(self._sock), os.getuid()):
            self._sock.close()
            raise CheckpointError(
                f"the process answering at {path} runs as uid {host_uid}, not as this user ({os.getuid()}) "
                "or root: it is not this node's checkpoint host"
            )
        self._sock.settimeout(None)
        self._reader = LineReader(self._sock)

    def call(self, request: Request | Message, *, timeout_s: float | None = None) -> Message:
        """Sends a request and returns the reply; raises HostTimeoutError when none came in ``timeout_s``
        and CheckpointError when the host is gone."""
        message = request if isinstance(request, dict) else request.to_dict()
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
