"""Runs probes forked from the warm probe server (:mod:`phalanx.diagnostics.probe_server`); torch-free.

:class:`WarmProbes` starts the server at the first probe and keeps it for the next ones, so every later
probe starts with torch imported: the probes of one round run back to back, and a confirming round follows
at once, both on the node whose CPU may be the starved one. :meth:`WarmProbes.run` keeps the contract of
:func:`phalanx.diagnostics.probe_runner.run_probe` (same measurements, same failures, a timeout kills the
probe's process group), except that it returns None when no server could take the probe (none could be
started, or it ended before starting the probe): the caller then runs the probe cold.

The agent has the server forked from its zygote (``fork``: ``Zygote.fork_probe_server`` of
:mod:`phalanx.agent.zygote`), which imported torch for the warm spares already: a node imports torch once for
its spares and its probes.
Without a ready zygote (warm spares off, ``--no-python``) the server is a process of its own.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, Protocol

from phalanx.diagnostics import probe_runner
from phalanx.diagnostics.probe_runner import Measurement

__all__ = ["SERVER", "ForkServer", "ServerProcess", "WarmProbes"]

SERVER = "phalanx.diagnostics.probe_server"
_KILL_WAIT_S = 5.0

Replies = queue.Queue[dict[str, Any] | None]
"""The server's replies, in order; None once its output ended."""


class ServerProcess(Protocol):
    """What is used of the server's process: a :class:`subprocess.Popen`, or one forked from the agent's
    zygote (:class:`phalanx.agent.zygote.ForkedProcess`), with its stdin and stdout pipes."""

    pid: int
    stdin: IO[bytes] | None
    stdout: IO[bytes] | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


Server = tuple[ServerProcess, Replies]
ForkServer = Callable[[Mapping[str, str] | None], ServerProcess | None]
"""Starts a server, with that environment, as a fork of a process that imported torch already; None when
it cannot (a fresh process is started then)."""


class _Timeout:
    pass


_TIMEOUT = _Timeout()


class WarmProbes:
    """One probe server, started on first use and replaced when it has died; one probe at a time."""

    def __init__(
        self,
        *,
        python: str = sys.executable,
        env: Mapping[str, str] | None = None,
        fork: ForkServer | None = None,
    ) -> None:
        """``fork``: where a server can start without importing torch itself (the agent's zygote)."""
        self.python = python
        self.env = dict(env) if env is not None else None
        self.fork = fork
        self._lock = threading.Lock()
        self._server: Server | None = None
        self._closed = False

    @property
    def server_pid(self) -> int | None:
        """The running server's pid (for tests and logs)."""
        server = self._server
        return server[0].pid if server is not None and server[0].poll() is None else None

    def run(
        self,
        *,
        kind: probe_runner.ProbeName,
        args: Sequence[str],
        timeout_s: float,
        started: Callable[[Callable[[], None]], None] | None = None,
        env: Mapping[str, str] | None = None,
    ) -> list[Measurement] | None:
        """Runs one probe in a child of the server, with ``env`` added to its environment; ``started`` gets
        a function that kills it. None when the probe could not be handed to a server (run it cold then)."""
        for _ in range(2):  # a server that died since the last probe is noticed only when asked
            server, fresh = self._start()
            if server is None:
                return None
            measured = self._run_in(
                server, kind=kind, args=args, timeout_s=timeout_s, started=started, env=env or {}
            )
            if measured is not None or fresh:
                return measured
        return None

    def _run_in(
        self,
        server: Server,
        *,
        kind: probe_runner.ProbeName,
        args: Sequence[str],
        timeout_s: float,
        started: Callable[[Callable[[], None]], None] | None,
        env: Mapping[str, str],
    ) -> list[Measurement] | None:
        proc, replies = server
        deadline = time.monotonic() + timeout_s
        with tempfile.TemporaryDirectory(prefix="phalanx-probe-") as tmp:
            out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
            request = {"argv": [kind, *args], "stdout": str(out), "stderr": str(err), "env": dict(env)}
            try:
                assert proc.stdin is not None
                proc.stdin.write(json.dumps(request).encode() + b"\n")
                proc.stdin.flush()
            except (OSError, ValueError):  # it died since it was looked at
                self._discard(proc)
                return None
            first = _next(replies, deadline)
            if first is _TIMEOUT:  # still importing torch, or stuck: either way the probe took too long
                self._discard(proc)
                return probe_runner.failure(f"{kind} probe timed out after {timeout_s:g}s and was killed")
            if not isinstance(first, dict) or not isinstance(first.get("started"), int):
                self._discard(proc)  # it ended, or refused the request: not the probe's doing
                return None
            child = _Child(first["started"])
            if started is not None:
                started(child.kill)
            last = _next(replies, deadline)
            if last is _TIMEOUT:
                child.kill()
                if _exited(_next(replies, time.monotonic() + _KILL_WAIT_S), child.pid):
                    child.reaped = True
                else:  # a server that does not report its child's end cannot be trusted with the next probe
                    self._discard(proc)
                return probe_runner.failure(f"{kind} probe timed out after {timeout_s:g}s and was killed")
            if not isinstance(last, dict) or not _exited(last, child.pid):
                child.kill()  # not reaped: the server is gone, and the probe is in a session of its own
                self._discard(proc)
                return probe_runner.failure(f"{kind} probe lost: the probe server ended while it ran")
            child.reaped = True
            return probe_runner.outcome(kind, out=_tail(out), err=_tail(err), code=last["code"])

    def close(self) -> None:
        """Ends the server; a probe of it still running must have been killed before (``started``'s kill)."""
        with self._lock:
            self._closed = True
            server, self._server = self._server, None
        if server is not None:
            _end(server[0])

    def _start(self) -> tuple[Server | None, bool]:
        """The server, started now when there is none (second item True), or None when none can run."""
        with self._lock:
            if self._closed:
                return None, False
            if self._server is not None:
                if self._server[0].poll() is None:
                    return self._server, False
                _end(self._server[0])  # it died since the last probe: closes its input
                self._server = None
            try:
                proc = (self.fork(self.env) if self.fork is not None else None) or subprocess.Popen(
                    [self.python, "-m", SERVER],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL,  # a server that fails to start sends the probe cold: its error
                    start_new_session=True,  # not in the agent's process group: signals to it are not its
                    env=self.env,
                )
            except OSError:
                return None, True
            replies: Replies = queue.Queue()
            assert proc.stdout is not None
            reader = threading.Thread(
                target=_read_replies, args=(proc.stdout, replies), name="phalanx-probe-server", daemon=True
            )
            reader.start()
            self._server = (proc, replies)
            return self._server, True

    def _discard(self, proc: ServerProcess) -> None:
        with self._lock:
            if self._server is not None and self._server[0] is proc:
                self._server = None
        _end(proc)


class _Child:
    """A probe forked by the server: its pid is the server's unreaped child until the server reports its
    exit, so it is killed only before that (after, the pid may be another process's)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.reaped = False

    def kill(self) -> None:
        if self.reaped:
            return
        for kill in (os.killpg, os.kill):  # the group once it called setsid, the process before
            with contextlib.suppress(ProcessLookupError, PermissionError):
                kill(self.pid, signal.SIGKILL)


def _read_replies(stream: IO[bytes], replies: Replies) -> None:
    try:
        for line in stream:
            with contextlib.suppress(ValueError):
                message = json.loads(line)
                if isinstance(message, dict):
                    replies.put(message)
    finally:
        stream.close()  # here, not by whoever ends the server: closing it under this loop would raise in it
        replies.put(None)


def _next(replies: Replies, deadline: float) -> dict[str, Any] | _Timeout | None:
    try:
        return replies.get(timeout=max(0.0, deadline - time.monotonic()))
    except queue.Empty:
        return _TIMEOUT


def _exited(reply: dict[str, Any] | _Timeout | None, pid: int) -> bool:
    """Whether ``reply`` is the server's report that its child ``pid`` ended (with an exit code)."""
    return isinstance(reply, dict) and reply.get("exited") == pid and isinstance(reply.get("code"), int)


def _tail(path: Path) -> bytes:
    try:
        with path.open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - probe_runner.MAX_OUTPUT_BYTES))
            return f.read()
    except OSError:  # the child died before it opened its output
        return b""


def _end(proc: ServerProcess) -> None:
    """Closes the server's input (it exits between probes) and kills it (it may be stuck in one)."""
    with contextlib.suppress(OSError, ValueError):
        if proc.stdin is not None:
            proc.stdin.close()
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=_KILL_WAIT_S)
