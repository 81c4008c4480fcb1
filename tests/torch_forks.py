"""The tests' own Python processes that import torch (gloo ranks, checkpoint writers), forked from one
interpreter that imported torch once, instead of each importing it again.

``import torch`` costs about 4 CPU-seconds on the 2-core machine, and the suite starts hundreds of such
processes: most of their CPU, for tests whose subject is what the process does after its imports. This is
the agent's own zygote (:mod:`phalanx.agent.zygote`: the same protocol, the same fork, a child in its own
session with its own environment, working directory and standard streams) serving the tests: only what a
child runs differs. It runs the script at once, as ``python script.py args`` would: no spare's hand-over, no
instrumentation; at its end it skips only the teardown of every module (:func:`_run`). A child dumps its
threads' stacks onto its stderr on SIGUSR1, for a test that waited for it in vain. The tests of
phalanx's own launch path (``phalanx-run``, ``phalanx local``) do not come here: they start their processes
as users do.

    proc = torch_forks.popen([sys.executable, "dist_worker.py", "save"], env=env, stdout=subprocess.PIPE)
    out, _ = proc.communicate(timeout=90)

:func:`popen` starts the lane's zygote on first use (one per pytest-xdist lane); it ends with the lane.
"""

from __future__ import annotations

import atexit
import builtins
import contextlib
import faulthandler
import io
import os
import runpy
import signal
import socket
import subprocess
import sys
import threading
import types
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from phalanx.agent import bootstrap, zygote

PREIMPORT = "torch,torch.distributed"
ROOT = Path(__file__).resolve().parents[1]
_ZYGOTE: zygote.Zygote | None = None
_LOCK = threading.Lock()
_ENDED_CPU_S = 0.0
"""The CPU seconds of the processes of zygotes that ended (a zygote that died is started again)."""


def reaped_cpu_seconds() -> float:
    """The CPU seconds of every forked process that ended, for the suite's CPU report (tests/cpu_usage.py):
    they are the zygote's children, not the test's."""
    return _ENDED_CPU_S + (_ZYGOTE.reaped_cpu_s if _ZYGOTE is not None else 0.0)


class Forked:
    """What the tests use of :class:`subprocess.Popen`, for a process forked from the lane's zygote."""

    def __init__(self, proc: zygote.ForkedProcess, *, text: bool) -> None:
        self._proc = proc
        self.pid = proc.pid
        self.stdout: IO[Any] | None = _wrap(proc.stdout, text)
        self.stderr: IO[Any] | None = _wrap(proc.stderr, text)

    @property
    def returncode(self) -> int | None:
        return self._proc.returncode

    def poll(self) -> int | None:
        return self._proc.poll()

    def wait(self, timeout: float | None = None) -> int:
        return self._proc.wait(timeout)

    def send_signal(self, sig: int) -> None:
        if self._proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[Any, Any]:
        """Reads stdout and stderr (those that are pipes) to their end and waits for the exit, as Popen's."""
        read: dict[str, Any] = {}
        readers = [
            threading.Thread(target=lambda n=name, s=stream: read.__setitem__(n, s.read()), daemon=True)
            for name, stream in (("stdout", self.stdout), ("stderr", self.stderr))
            if stream is not None and not stream.closed  # closed: read by an earlier call
        ]
        for reader in readers:
            reader.start()
        self.wait(timeout)  # raises subprocess.TimeoutExpired, as Popen's does
        for reader in readers:
            reader.join(timeout)
        for stream in (self.stdout, self.stderr):
            if stream is not None:
                stream.close()
        return read.get("stdout"), read.get("stderr")


def _wrap(stream: IO[bytes] | None, text: bool) -> IO[Any] | None:
    if stream is None or not text:
        return stream
    return io.TextIOWrapper(stream, encoding="utf-8", errors="replace")


Stream = int | IO[Any] | None
"""As Popen's: ``subprocess.PIPE``, ``subprocess.DEVNULL``, ``subprocess.STDOUT`` (stderr only), an open file
or a descriptor, or None (this process's own)."""


def popen(
    cmd: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    stdout: Stream = None,
    stderr: Stream = None,
    text: bool = True,
) -> Forked:
    """``subprocess.Popen(cmd, ...)`` for ``python script.py args``, ``python -m module args`` or ``python -c
    code args``, forked from the zygote. The child's stdin is empty (``/dev/null``)."""
    cmd = [str(a) for a in cmd]
    target = cmd[1:3] if cmd[1:2] in (["-m"], ["-c"]) else cmd[1:2]
    if cmd[:1] != [sys.executable] or not target or (len(target) == 1 and target[0].startswith("-")):
        raise ValueError(f"torch_forks runs `python script.py|-m module|-c code args`, not {cmd}")
    devnull = os.open(os.devnull, os.O_RDWR)
    try:
        out = _descriptor(stdout, own=1, devnull=devnull)
        if stderr == subprocess.STDOUT:
            if out is None:
                raise ValueError("stderr=STDOUT with stdout=PIPE: one pipe of both is not needed yet")
            err = out
        else:
            err = _descriptor(stderr, own=2, devnull=devnull)
        proc = _zygote().fork(
            cmd[1:],  # [script, *args], ["-m", module, *args] or ["-c", code, *args]
            env=dict(os.environ if env is None else env),
            cwd=None if cwd is None else str(cwd),
            streams=(devnull, out, err),
        )
    finally:
        os.close(devnull)
    return Forked(proc, text=text)


def _descriptor(stream: Stream, *, own: int, devnull: int) -> int | None:
    """The descriptor the child gets; None: a pipe."""
    if stream is None:
        return own
    if stream == subprocess.PIPE:
        return None
    if stream == subprocess.DEVNULL:
        return devnull
    if isinstance(stream, int):
        return stream
    return stream.fileno()


def _zygote() -> zygote.Zygote:
    global _ZYGOTE, _ENDED_CPU_S
    with _LOCK:
        if _ZYGOTE is None or _ZYGOTE.dead:
            if _ZYGOTE is not None:
                _ENDED_CPU_S += _ZYGOTE.reaped_cpu_s
            # What the imports read from the environment is the zygote's: one thread, as every rank here runs.
            paths = [str(ROOT), *_pythonpath(os.environ)]
            env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(paths)}
            started = zygote.Zygote(
                preimport=PREIMPORT, env=env, agent_pid_var=bootstrap.AGENT_PID_ENV_VAR, server=__name__
            )
            if not started.wait_ready(120):
                started.close()
                raise RuntimeError("the tests' torch zygote did not get ready in 120 s")
            atexit.register(started.close)
            _ZYGOTE = started
        return _ZYGOTE


def main(argv: list[str]) -> None:
    """The zygote's process: imports, serves forks, and in each forked child runs its script."""
    preimport = argv[1] if argv[:1] == ["--preimport"] else ""
    sock = socket.socket(fileno=0)
    bootstrap.die_with_parent(bootstrap.agent_pid())
    # The interpreter's own path, without what only the zygote needed (its working directory, the project
    # root on its PYTHONPATH): a child gets its script's directory and its own PYTHONPATH in front instead.
    own = _pythonpath(os.environ)
    installed = [p for p in sys.path[1:] if p not in own]
    bootstrap.preimport_modules(preimport)
    child = zygote.serve(sock)
    if child is None:
        os._exit(0)
    # A test that waits in vain for a child asks for its stacks (SIGUSR1, onto its stderr): where is it stuck?
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    mode, (target, *args) = (child[0], child[1:]) if child[0] in ("-m", "-c") else ("", child)
    sys.argv = ["-c" if mode == "-c" else target, *args]
    # sys.path[0] as python sets it: the working directory for -m (its absolute path) and -c (""), else the
    # script's directory.
    first = {"-m": os.getcwd(), "-c": ""}.get(mode, os.path.dirname(os.path.abspath(target)))
    sys.path[:] = [first, *_pythonpath(os.environ), *installed]
    os._exit(_run(mode, target))


def _run(mode: str, target: str) -> int:
    """Runs the script, module or code as ``python`` does, up to its exit code; then what the interpreter does
    at exit (waits for the threads that are not daemons, runs the ``atexit`` functions, flushes the output),
    less tearing down every module: about a second of CPU per process with torch loaded. What that teardown
    would have done is lost as after a SIGKILL: a file the script left open is not flushed (the scripts
    here close theirs or flush each line)."""
    code = 0
    try:
        if mode == "-m":
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        elif mode == "-c":
            main_module = types.ModuleType("__main__")
            main_module.__dict__["__builtins__"] = builtins
            sys.modules["__main__"] = main_module
            exec(compile(target, "<string>", "exec"), main_module.__dict__)
        else:
            runpy.run_path(target, run_name="__main__")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    threading._shutdown()  # type: ignore[attr-defined]  # what the interpreter's own exit calls first
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    return code


def _pythonpath(env: Mapping[str, str]) -> list[str]:
    return [os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]


if __name__ == "__main__":
    main(sys.argv[1:])
