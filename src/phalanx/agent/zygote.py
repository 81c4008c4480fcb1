"""The agent's zygote: one process that imports torch once and forks every warm spare from there.

A warm spare used to be a fresh interpreter that imported torch and ``torch._dynamo`` itself: seconds of
CPU each (see docs/benchmarks.md), paid again for every spare that refills the pool after a restart, at the
moment the new workers need the cores, and wasted for every spare a finished job never used. The zygote pays
once per agent; each spare is then a ``fork()`` of it (milliseconds), the way Android starts its apps and
Python's ``multiprocessing`` forkserver starts its workers. Forking is safe here because the zygote does
nothing but import: one thread, CUDA never initialised (a child initialises its own), no locks held.

    python -m phalanx.agent.zygote --preimport torch,torch._dynamo --script train.py ARGS  (stdin: a socket)

The zygote's stdin is one end of a ``SOCK_SEQPACKET`` socket pair (one message a datagram) whose other end the
agent holds. The script and its arguments are in its command line only to be seen there, and in every
spare's, which is the zygote's: ``ps`` shows the workers' script, as under torchrun. Messages are JSON (never
pickle); file descriptors travel beside them (``SCM_RIGHTS``):

    zygote -> agent   {"ready": true}                       once the imports are done
    agent -> zygote   {"argv": [...], "env": {...}} + fds   fork a spare: stdin, stdout, stderr
    zygote -> agent   {"pid": N} or {"error": "..."}        the spare's pid, in order of the requests
    zygote -> agent   {"exited": N, "code": C, "cpu_s": S}  a spare ended: Popen.returncode, CPU seconds

The zygote is its spares' parent: it reaps them and reports each exit code. It dies with the agent, and its
spares die with it (their parent-death signal), so a killed node still takes its workers with it. A spare
runs :func:`phalanx.agent.bootstrap.run_spare` in the forked child as a fresh bootstrap would after its
imports: in its own session, with its own environment, working directory and standard streams.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

MAX_MESSAGE = 1 << 20
"""The largest request (its environment): a datagram, sent and received whole."""

STREAMS = 3
"""stdin, stdout and stderr, sent with every fork request."""

PROBE_SERVER = "--probe-server"
"""The argv of a fork request whose child becomes the node's warm probe server
(:mod:`phalanx.diagnostics.probe_server`) rather than a spare: its probes start with torch imported, and no
process of the node imports it a second time for them."""


def send(sock: socket.socket, message: dict[str, Any], fds: list[int] | None = None) -> None:
    data = json.dumps(message).encode()
    if fds:
        socket.send_fds(sock, [data], fds)
    else:
        sock.send(data)


def _receive_request(sock: socket.socket) -> tuple[dict[str, Any], list[int]] | None:
    """The next fork request and its descriptors; None when the agent closed its end."""
    data, fds, _flags, _addr = socket.recv_fds(sock, MAX_MESSAGE, STREAMS)
    if not data:
        for fd in fds:
            os.close(fd)
        return None
    try:
        message = json.loads(data)
    except ValueError:
        message = None
    if not isinstance(message, dict) or len(fds) != STREAMS:
        for fd in fds:
            os.close(fd)
        return {}, []
    return message, fds


class _Child(Exception):
    """Raised in a forked child to leave the zygote's loop; carries what the child runs."""

    def __init__(self, argv: list[str]) -> None:
        super().__init__()
        self.argv = argv


def _become_spare(message: dict[str, Any], fds: list[int], zygote_pid: int) -> list[str]:
    """In the forked child: the spare's session, streams and environment; returns its bootstrap argv."""
    from phalanx.agent import bootstrap

    os.setsid()  # its own process group, so stopping it reaches its children too
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in fds:
        if fd > 2:
            os.close(fd)
    os.environ.clear()
    os.environ.update({str(k): str(v) for k, v in message["env"].items()})
    if message.get("cwd"):
        os.chdir(message["cwd"])
    _reseed()
    bootstrap.die_with_parent(zygote_pid)
    return [str(a) for a in message["argv"]]


def _reseed() -> None:
    """A fresh interpreter seeds numpy's global generator from the OS; forked ones would share the zygote's
    (Python's own ``random`` reseeds itself after a fork)."""
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        with contextlib.suppress(Exception):
            numpy_random.seed()


def _fork(sock: socket.socket, wake: tuple[int, int], message: dict[str, Any], fds: list[int]) -> None:
    zygote_pid = os.getpid()
    try:
        pid = os.fork()
    except OSError as e:
        for fd in fds:
            os.close(fd)
        send(sock, {"error": f"fork failed: {e}"})
        return
    if pid == 0:
        # The child leaves the loop: nothing of the zygote's may stay open in a spare.
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        sock.close()
        for fd in wake:
            os.close(fd)
        raise _Child(_become_spare(message, fds, zygote_pid))
    for fd in fds:
        os.close(fd)
    send(sock, {"pid": pid})


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        cpu = round(usage.ru_utime + usage.ru_stime, 3)
        send(sock, {"exited": pid, "code": os.waitstatus_to_exitcode(status), "cpu_s": cpu})


def serve(sock: socket.socket) -> list[str] | None:
    """Forks spares on request until the agent goes. Returns in a forked child only, with its argv."""
    wake = os.pipe()
    os.set_blocking(wake[1], False)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so that the wakeup fd hears of exits
    signal.set_wakeup_fd(wake[1])
    selector = selectors.DefaultSelector()
    selector.register(sock, selectors.EVENT_READ)
    selector.register(wake[0], selectors.EVENT_READ)
    send(sock, {"ready": True})
    try:
        while True:
            for key, _ in selector.select():
                if key.fileobj is sock:
                    request = _receive_request(sock)
                    if request is None:
                        return None  # the agent is gone; its spares die with this process
                    message, fds = request
                    if not fds:
                        send(sock, {"error": "malformed fork request"})
                        continue
                    _fork(sock, wake, message, fds)
                else:
                    with contextlib.suppress(BlockingIOError):
                        os.read(wake[0], 512)
                    _reap(sock)
    except _Child as child:
        selector.close()
        return child.argv


# ---------------------------------------------------------------------------------------------------------
# the agent's side


class Zygote:
    """The agent's handle on its zygote: starts it, forks spares from it, and hears of their exits."""

    REPLY_TIMEOUT_S = 30.0

    def __init__(
        self,
        *,
        preimport: str,
        env: Mapping[str, str],
        agent_pid_var: str,
        target: Sequence[str] = (),
        server: str = __name__,
    ) -> None:
        """``target`` (``--script train.py args``) is only shown, in the zygote's command line and so in every
        spare's: ``ps`` and ``pgrep -f train.py`` find the workers by their script, as under torchrun.
        ``server``: the module the zygote runs, this one or another that serves with :func:`serve` and runs
        its children otherwise (the tests' rank processes, ``tests/torch_forks.py``)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock = ours
        self.proc = subprocess.Popen(
            [sys.executable, "-m", server, "--preimport", preimport, *target],
            stdin=theirs.fileno(),  # the zygote's stdin is its socket: no training process has one like it
            stdout=subprocess.DEVNULL,
            env={**env, agent_pid_var: str(os.getpid())},
            start_new_session=True,  # the agent's terminal signals go to the agent, which stops its workers
        )
        theirs.close()
        self._ready = threading.Event()
        self._requests = threading.Lock()  # one fork request at a time: replies come in order
        self._replies: queue.Queue[dict[str, Any]] = queue.Queue()
        self._exits: dict[int, int] = {}
        self.reaped_cpu_s = 0.0
        """The CPU seconds (user and system) of the spares that ended, their children's included."""
        self._changed = threading.Condition()
        self.dead = False
        threading.Thread(target=self._read, daemon=True, name="zygote").start()

    def _read(self) -> None:
        while True:
            try:
                data = self._sock.recv(MAX_MESSAGE)
                message = json.loads(data) if data else None
            except (OSError, ValueError):
                message = None
            if not isinstance(message, dict):
                break
            if "ready" in message:
                self._ready.set()
            elif "exited" in message:
                with self._changed:
                    self._exits[int(message["exited"])] = int(message["code"])
                    self.reaped_cpu_s += float(message.get("cpu_s", 0.0))
                    self._changed.notify_all()
            else:
                self._replies.put(message)
        with self._changed:
            self.dead = True
            self._changed.notify_all()
        self._ready.set()
        self._replies.put({"error": "the zygote ended"})

    def ready(self) -> bool:
        """Done with its imports and still there to fork."""
        return self._ready.is_set() and not self.dead

    def wait_ready(self, timeout_s: float) -> bool:
        self._ready.wait(max(0.0, timeout_s))
        return self.ready()

    def fork(
        self,
        argv: list[str],
        *,
        env: Mapping[str, str],
        cwd: str | None = None,
        streams: Sequence[int | None] = (None, None, None),
    ) -> ForkedProcess:
        """A spare running ``bootstrap.run_spare(argv)`` (the probe server for ``[PROBE_SERVER]``; the server
        module's own child otherwise, see ``server``). Its stdin, stdout and stderr are the descriptors in
        ``streams``; a pipe for each None, whose other end is the returned process's stream of that name."""
        ours: list[int | None] = []
        theirs: list[int] = []
        for index, given in enumerate(streams):
            if given is not None:
                ours.append(None)
                theirs.append(given)
                continue
            read, write = os.pipe()
            ours.append(write if index == 0 else read)
            theirs.append(read if index == 0 else write)
        try:
            with self._requests:
                send(self._sock, {"argv": argv, "env": dict(env), "cwd": cwd}, theirs)
                reply = self._replies.get(timeout=self.REPLY_TIMEOUT_S)
        except (OSError, queue.Empty) as e:
            reply = {"error": f"no answer from the zygote: {e}"}
        finally:
            for child_end, given in zip(theirs, streams, strict=True):
                if given is None:
                    os.close(child_end)
        if "pid" not in reply:
            for our_end in ours:
                if our_end is not None:
                    os.close(our_end)
            raise OSError(str(reply.get("error", "the zygote refused")))
        stdin, stdout, stderr = (
            None if fd is None else os.fdopen(fd, "wb" if index == 0 else "rb")
            for index, fd in enumerate(ours)
        )
        return ForkedProcess(self, int(reply["pid"]), stdin=stdin, stdout=stdout, stderr=stderr)

    def fork_probe_server(self, env: Mapping[str, str]) -> ForkedProcess:
        """The node's warm probe server (:data:`PROBE_SERVER`), its requests on ``stdin``, its replies on
        ``stdout``; its stderr goes nowhere, as a fresh server's does."""
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            return self.fork([PROBE_SERVER], env=env, streams=(None, None, devnull))
        finally:
            os.close(devnull)

    def exit_code(self, pid: int, timeout_s: float | None = 0.0) -> int | None:
        """A spare's exit code once it ended (waiting up to ``timeout_s``; None: forever); None while it
        runs. A spare of a zygote that died was killed with it (its parent-death signal), and someone else
        reaps it: it ended once its process is gone."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._changed:
            while True:
                if pid in self._exits:
                    return self._exits.pop(pid)
                if self.dead and not _running(pid):
                    return -signal.SIGKILL
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                if self.dead:  # a dead zygote sends nothing more: look again at the process shortly
                    left = 0.05 if left is None else min(left, 0.05)
                self._changed.wait(left)

    def close(self) -> None:
        """Ends the zygote (its spares with it: stop the workers first)."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        try:
            self.proc.wait(5.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class ForkedProcess:
    """A spare forked by the zygote, with what the agent uses of :class:`subprocess.Popen`."""

    def __init__(
        self,
        zygote: Zygote,
        pid: int,
        *,
        stdin: IO[bytes] | None,
        stdout: IO[bytes] | None,
        stderr: IO[bytes] | None,
    ):
        self._zygote = zygote
        self.pid = pid
        self.stdin: IO[bytes] | None = stdin
        self.stdout: IO[bytes] | None = stdout
        self.stderr: IO[bytes] | None = stderr
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._zygote.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self._zygote.exit_code(self.pid, timeout_s=timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(f"spare {self.pid}", timeout or 0.0)
        return self.returncode


def _running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] not in ("Z", "X")


def _forks_cleanly() -> bool:
    """Whether a child forked now could still use CUDA. torch refuses in a child ("Cannot re-initialize CUDA
    in forked subprocess") once its parent initialised the driver, and even ``torch.cuda.is_available()``
    does; the imports must not have. Only a child can tell (torch marks it at fork), so one is forked."""
    torch = sys.modules.get("torch")
    if torch is None:
        return True
    pid = os.fork()
    if pid == 0:
        os._exit(3 if torch.cuda._is_in_bad_fork() else 0)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0


def main(argv: list[str]) -> None:
    from phalanx.agent import bootstrap

    preimport = argv[1] if argv[:1] == ["--preimport"] else ""
    sock = socket.socket(fileno=0)  # the rest of argv is the spares' target, shown only
    bootstrap.die_with_parent(bootstrap.agent_pid())
    bootstrap.preimport_modules(preimport)
    if not _forks_cleanly():
        # Never ready: the agent's spares start cold, as without a zygote.
        sys.exit("phalanx zygote: CUDA was initialised while importing; a forked worker could not use it")
    spare = serve(sock)
    if spare is None:
        os._exit(0)
    if spare == [PROBE_SERVER]:
        from phalanx.diagnostics import probe_server

        code = probe_server.serve()
        sys.stdout.flush()
        os._exit(code)  # nothing of a training process to tear down: it only forked probes
    bootstrap.run_spare(spare)


if __name__ == "__main__":
    main(sys.argv[1:])
