"""Worker processes: spawning (cold or from warm spares), output capture, stack dumps and stopping.

Every worker runs through :mod:`phalanx.agent.bootstrap` in its own session (process group), so stopping
it can signal everything it started. Its stdout and stderr are pipes read by two threads that write each
line to the rank's log files, echo it to the agent's stdout with a ``[rankN]:`` prefix, keep a tail for
failure reports and queue it for shipping to the master.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Protocol

from phalanx.agent import script_imports
from phalanx.agent.env import WorkerPaths
from phalanx.agent.zygote import Zygote

TAIL_LINES = 40
READY_ENV_VAR = "PHALANX_BOOTSTRAP_READY_FILE"  # same names as in phalanx.agent.bootstrap
AGENT_PID_ENV_VAR = "PHALANX_AGENT_PID"

LineSink = Callable[[int, int, int, str], None]
"""Called with (rank, local_rank, stream 1=stdout 2=stderr, text) for every worker output line."""


WARM_IMPORTS = "torch,torch._dynamo"
"""What a warm spare imports before a round needs it. ``torch._dynamo`` too: every ``torch.optim`` optimizer
imports it when built (sympy, triton, inductor: seconds even on an idle machine, far longer on a busy one; see
docs/benchmarks.md), so a spare that imported torch alone still left that on every restart's path, and
recovery depended on whether the script builds an optimizer."""


@dataclass(frozen=True, kw_only=True)
class LaunchSpec:
    """How to run the user's program."""

    script: str
    script_args: list[str]
    module: bool = False
    no_python: bool = False
    preimport: str = WARM_IMPORTS

    def target(self) -> list[str]:
        """What :func:`phalanx.agent.bootstrap.run_spare` runs once the round is handed over."""
        mode = "--exec" if self.no_python else "--module" if self.module else "--script"
        return [mode, self.script, *self.script_args]

    def command(self) -> list[str]:
        pre = [] if self.no_python else ["--preimport", self.preimport]
        return [sys.executable, "-m", "phalanx.agent.bootstrap", *pre, *self.target()]


class Process(Protocol):
    """A worker's process: a :class:`subprocess.Popen`, or a spare forked by the agent's zygote."""

    pid: int
    returncode: int | None
    stdin: IO[bytes] | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


@dataclass
class Worker:
    """One worker process (a spare until :meth:`hand_over`)."""

    local_rank: int
    proc: Process
    started_at: float
    rank: int = -1
    paths: WorkerPaths | None = None
    handed_over_at: float | None = None
    tail: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=TAIL_LINES))
    _files: dict[int, IO[str]] = field(default_factory=dict)
    _pending: list[tuple[int, str]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _threads: list[threading.Thread] = field(default_factory=list)
    sink: LineSink | None = None
    ready_file: Path | None = None

    def ready(self) -> bool:
        """Done with its imports (or dead, so there is nothing to wait for)."""
        if self.proc.poll() is not None or self.ready_file is None:
            return True
        return self.ready_file.exists()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def hand_over(self, *, env: Mapping[str, str], paths: WorkerPaths, rank: int, sink: LineSink) -> None:
        """Gives a waiting bootstrap its round; from now on it runs the user's program."""
        paths.stdout_log.parent.mkdir(parents=True, exist_ok=True)
        for p in (paths.error_file, paths.regroup_file):
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
        with self._lock:
            self.rank, self.paths, self.sink = rank, paths, sink
            self._files = {1: paths.stdout_log.open("a"), 2: paths.stderr_log.open("a")}
            pending, self._pending = self._pending, []
        for stream, text in pending:
            self._emit(stream, text)
        payload = json.dumps({"env": dict(env), "stack_file": str(paths.stack_file)}) + "\n"
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(payload.encode())
            self.proc.stdin.close()
        except BrokenPipeError:
            pass  # the spare died while waiting; the monitor sees its exit code
        self.handed_over_at = time.monotonic()

    def discard(self) -> None:
        """Ends a spare that was never handed over."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            with contextlib.suppress(BrokenPipeError):
                self.proc.stdin.close()
        kill_group(self.proc, signal.SIGKILL)

    def _emit(self, stream: int, text: str) -> None:
        self.tail.append(text)
        f = self._files.get(stream)
        if f is not None:
            f.write(text + "\n")
            f.flush()
        if self.sink is not None:
            self.sink(self.rank, self.local_rank, stream, text)

    def on_line(self, stream: int, text: str) -> None:
        with self._lock:
            if self.paths is None:
                self._pending.append((stream, text))
                return
            self._emit(stream, text)

    def close_logs(self, timeout: float = 1.0) -> None:
        for t in self._threads:
            t.join(timeout)
        with self._lock:
            for f in self._files.values():
                f.close()
            self._files = {}


def _pump(worker: Worker, pipe: IO[bytes], stream: int, max_line_bytes: int) -> None:
    with pipe:
        for raw in iter(pipe.readline, b""):
            text = raw[:max_line_bytes].decode(errors="replace").rstrip("\n")
            worker.on_line(stream, text)


def spawn(
    spec: LaunchSpec,
    *,
    local_rank: int,
    env: Mapping[str, str],
    max_line_bytes: int,
    cwd: str | None = None,
    ready_file: Path | None = None,
    imports_file: Path | None = None,
    zygote: Zygote | None = None,
) -> Worker:
    """Starts a bootstrap that imports the heavy modules and waits for its round: forked from ``zygote``
    when there is one (its imports are done), a fresh interpreter otherwise. With ``imports_file`` it also
    imports, once ready, what the previous incarnation recorded there, and records its own script's imports
    there for the next (:mod:`phalanx.agent.script_imports`). Raises OSError when the zygote cannot fork."""
    env = dict(env)
    if ready_file is not None:
        ready_file.parent.mkdir(parents=True, exist_ok=True)
        ready_file.unlink(missing_ok=True)
        env[READY_ENV_VAR] = str(ready_file)
    if imports_file is not None:
        imports_file.parent.mkdir(parents=True, exist_ok=True)
        env[script_imports.ENV_VAR] = str(imports_file)
    proc: Process
    if zygote is not None:
        forked = zygote.fork(spec.target(), env=env, cwd=cwd)
        proc, stdout, stderr = forked, forked.stdout, forked.stderr
    else:
        popen = subprocess.Popen(
            spec.command(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={**env, AGENT_PID_ENV_VAR: str(os.getpid())},
            cwd=cwd,
            start_new_session=True,  # its own process group, so stopping it reaches its children too
        )
        proc, stdout, stderr = popen, popen.stdout, popen.stderr
    worker = Worker(local_rank=local_rank, proc=proc, started_at=time.monotonic(), ready_file=ready_file)
    for stream, pipe in ((1, stdout), (2, stderr)):
        assert pipe is not None
        t = threading.Thread(
            target=_pump, args=(worker, pipe, stream, max_line_bytes), daemon=True, name=f"pump-{local_rank}"
        )
        t.start()
        worker._threads.append(t)
    return worker


def kill_group(proc: Process, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def process_state(pid: int) -> str:
    """The process's state letter from ``/proc/<pid>/stat`` (R, S, D, T, t, Z, ...); "" when it cannot be
    read (gone, or no procfs). The command name, field 2, may hold spaces and parentheses: the state is the
    first field after its last ``)``."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    fields = stat.rsplit(")", 1)[-1].split()
    return fields[0] if fields else ""


def is_stopped(pid: int) -> bool:
    """True when the process is stopped (SIGSTOP) or traced; it cannot act on a signal then."""
    return process_state(pid) in ("T", "t")


def stop(workers: list[Worker], *, grace_period_s: float) -> dict[int, int]:
    """Stops workers: SIGTERM to each process group, SIGKILL after the grace period. Returns exit codes."""
    alive = [w for w in workers if w.proc.poll() is None]
    for w in alive:
        # A stopped process would sit on SIGTERM until the grace period ends; it gets no grace.
        kill_group(w.proc, signal.SIGKILL if is_stopped(w.pid) else signal.SIGTERM)
    deadline = time.monotonic() + grace_period_s
    for w in alive:
        with contextlib.suppress(subprocess.TimeoutExpired):
            w.proc.wait(max(0.0, deadline - time.monotonic()))
    for w in workers:
        # Also reaches grandchildren left in the group after the leader exited.
        kill_group(w.proc, signal.SIGKILL)
    codes = {}
    for w in workers:
        with contextlib.suppress(subprocess.TimeoutExpired):
            w.proc.wait(5.0)
        codes[w.local_rank] = w.proc.returncode if w.proc.returncode is not None else -9
        w.close_logs()
    return codes


def dump_stacks(workers: list[Worker], *, wait_s: float = 1.0) -> dict[int, str]:
    """Asks every worker's faulthandler for its stacks (SIGUSR1) and returns the new text per local rank."""
    offsets: dict[int, int] = {}
    result: dict[int, str] = {}
    for w in workers:
        if w.paths is None or w.proc.poll() is not None:
            continue
        if is_stopped(w.pid):
            result[w.local_rank] = f"<process {w.pid} is stopped (SIGSTOP); no stack dump possible>"
            continue
        try:
            offsets[w.local_rank] = w.paths.stack_file.stat().st_size
        except FileNotFoundError:
            offsets[w.local_rank] = 0
        with contextlib.suppress(ProcessLookupError):
            os.kill(w.pid, signal.SIGUSR1)
    deadline = time.monotonic() + wait_s
    pending = dict(offsets)
    while pending and time.monotonic() < deadline:
        time.sleep(0.05)
        for w in workers:
            if w.local_rank in pending and w.paths is not None:
                with contextlib.suppress(FileNotFoundError), w.paths.stack_file.open("rb") as f:
                    f.seek(pending[w.local_rank])
                    text = f.read().decode(errors="replace")
                    if text.strip():
                        result[w.local_rank] = text
                        # Keep the offset: more threads may still be written; a second read below.
        pending = {k: v for k, v in pending.items() if k not in result}
    return result
