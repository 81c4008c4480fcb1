"""The checkpoint host: one torch-free process per node that owns the flash-checkpoint shared memory and
persists it in the background.

Contract for the node agent (``phalanx-run``), which must not import torch::

    from phalanx.checkpoint.host import start
    handle = start(job_id="j1", storage="/ckpt", keep_last=2, master_addr="10.0.0.1:5000",
                   token_file="/run/token", node_id="node-0", incarnation="abc")
    worker_env.update(handle.env())   # PHALANX_CHECKPOINT_{SOCKET,SHM_DIR,JOB,STORAGE}
    ...
    handle.persist_now()              # workers failed: save the last complete snapshot first
    handle.stop()                     # job over: drain persistence, unlink every segment, exit

The host outlives training processes, so a restarted process finds its snapshot in memory. It creates
and sizes each rank's two slots when the rank first asks (the rank allocates their pages), adopts slots
it finds in ``shm_dir`` after its own restart (taking them over from a lingering older host, which then
exits without releasing them), unlinks them at :meth:`HostHandle.stop` (or when its
parent dies, or, when it was started by a training process itself, after ``idle_exit_s`` without any
client).

Without ``phalanx-run`` the Checkpointer on local rank 0 starts a host itself (same module, same
protocol). The host process runs :class:`phalanx.checkpoint.server.HostServer`; its requests (JSON lines
on a unix socket, see :mod:`phalanx.checkpoint.protocol`) are :mod:`phalanx.checkpoint.messages`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from phalanx.api.errors import CheckpointError
from phalanx.checkpoint import messages, protocol, shm
from phalanx.checkpoint.server import HostServer
from phalanx.checkpoint.storage import canonical_location, open_storage

if TYPE_CHECKING:
    pass

log = logging.getLogger("phalanx.checkpoint")

# -------------------------------------------------------------------------------------------------
# The agent's API


@dataclass
class HostHandle:
    """A running checkpoint host, as seen by the process that started it."""

    process: subprocess.Popen[bytes] | None  # None when the host was detached (daemonized)
    pid: int
    socket_path: Path
    shm_dir: Path
    job_id: str
    storage: str

    def env(self) -> dict[str, str]:
        """The environment variables training processes need to find this host."""
        return {
            protocol.ENV_SOCKET: str(self.socket_path),
            protocol.ENV_SHM_DIR: str(self.shm_dir),
            protocol.ENV_JOB: self.job_id,
            protocol.ENV_STORAGE: self.storage,
        }

    def _call(self, request: messages.Request, timeout_s: float | None) -> messages.Message:
        client = protocol.HostClient(str(self.socket_path))
        try:
            return client.call(request, timeout_s=timeout_s)
        finally:
            client.close()

    def persist_now(self, *, timeout_s: float | None = 600.0) -> dict[str, Any]:
        """Persists the newest complete in-memory snapshot of every local rank; returns the host's reply
        (``ok``, ``steps`` by rank, ``errors``). Call it when workers failed, before restarting them."""
        return self._call(messages.PersistNow(), timeout_s)

    def alive(self) -> bool:
        """Whether the host process still runs."""
        if self.process is not None:
            return self.process.poll() is None
        return process_running(self.pid)

    def kill(self, *, timeout_s: float = 10.0) -> None:
        """SIGKILLs the host (a stopped one too) and waits until it is gone; its memory stays for the
        host that replaces it to adopt."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        if self.process is not None:
            self.process.wait(timeout=timeout_s)
            return
        deadline = time.monotonic() + timeout_s
        while process_running(self.pid) and time.monotonic() < deadline:
            time.sleep(0.01)

    def stop(self, *, timeout_s: float = 60.0) -> int:
        """Drains persistence, unlinks the shared memory and waits for the host to exit; returns its exit
        code (0 for a detached host that exited). A host that does not exit in ``timeout_s`` (a stopped
        one) is killed, -9, and its memory is left for the caller to remove."""
        deadline = time.monotonic() + timeout_s
        if self.alive():
            try:
                self._call(messages.Stop(), min(timeout_s, 10.0))  # answered at once; draining follows
            except protocol.HostTimeoutError:
                deadline = time.monotonic()  # it does not answer: it will not drain either
            except CheckpointError:
                pass  # it exited meanwhile
        if self.process is None:
            while self.alive() and time.monotonic() < deadline:
                time.sleep(0.02)
            if not self.alive():
                return 0
            self.kill()
            return -signal.SIGKILL
        try:
            self.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        return int(self.process.returncode)


def process_running(pid: int) -> bool:
    """Whether process ``pid`` runs. A detached host is adopted by whichever process reaps orphans; where
    that is the agent itself (PID 1 of its container), a dead host stays a zombie until reaped here."""
    with contextlib.suppress(ChildProcessError):
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no procfs: trust the signal
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def start(
    *,
    job_id: str,
    storage: str = "",
    keep_last: int = 2,
    shm_dir: str | Path = "/dev/shm",
    socket_path: str | Path | None = None,
    master_addr: str = "",
    token_file: str = "",
    node_id: str = "",
    incarnation: str = "",
    idle_exit_s: float = 0.0,
    watch_parent: bool = True,
    detach: bool = False,
    timeout_s: float = 30.0,
    release_also: Sequence[Path] = (),
) -> HostHandle:
    """Starts a checkpoint host process and waits until it accepts connections. ``release_also``: files
    the host unlinks when it exits, with the job's shared memory."""
    if socket_path is None:
        socket_path = protocol.socket_path(job_id)
    argv = [
        sys.executable,
        "-m",
        "phalanx.checkpoint.host",
        f"--job-id={job_id}",
        f"--socket={socket_path}",
        f"--shm-dir={shm_dir}",
        f"--storage={storage}",
        f"--keep-last={keep_last}",
        f"--master-addr={master_addr or os.environ.get('PHALANX_MASTER_ADDR', '')}",
        f"--token-file={token_file or os.environ.get('PHALANX_TOKEN_FILE', '')}",
        f"--node-id={node_id}",
        f"--incarnation={incarnation}",
        f"--idle-exit-s={idle_exit_s}",
    ]
    argv += [f"--release-also={path}" for path in release_also]
    if watch_parent:
        argv.append(f"--parent-pid={os.getpid()}")
    if detach:
        argv.append("--daemon")  # a host started by a trainer must survive that trainer's SIGKILL
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
    assert proc.stdout is not None
    line = _read_line(proc, timeout_s)
    proc.stdout.close()  # nothing more is printed there; the host logs to stderr
    try:
        ready = json.loads(line)
    except ValueError:
        ready = None
    if not isinstance(ready, dict) or not isinstance(ready.get("pid"), int):
        proc.kill()
        proc.wait()
        why = ready.get("error") if isinstance(ready, dict) else None
        raise CheckpointError(
            f"the checkpoint host did not start: {why}"
            if why
            else f"the checkpoint host did not start (exit code {proc.returncode})"
        )
    pid = ready["pid"]
    if detach:
        proc.wait()  # the launcher exits once the daemon is ready
    return HostHandle(
        process=None if detach else proc,
        pid=pid,
        socket_path=Path(socket_path),
        shm_dir=Path(shm_dir),
        job_id=job_id,
        storage=storage,
    )


def _read_line(proc: subprocess.Popen[bytes], timeout_s: float) -> bytes:
    result: list[bytes] = [b""]

    def read() -> None:
        assert proc.stdout is not None
        result[0] = proc.stdout.readline()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout_s)
    return result[0]


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m phalanx.checkpoint.host``."""
    parser = argparse.ArgumentParser(
        prog="python -m phalanx.checkpoint.host", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--job-id", required=True)
    parser.add_argument("--socket", required=True)
    parser.add_argument("--shm-dir", default="/dev/shm")
    parser.add_argument("--storage", default="")
    parser.add_argument("--keep-last", type=int, default=2)
    parser.add_argument("--master-addr", default=os.environ.get("PHALANX_MASTER_ADDR", ""))
    parser.add_argument("--token-file", default=os.environ.get("PHALANX_TOKEN_FILE", ""))
    parser.add_argument("--node-id", default="")
    parser.add_argument("--incarnation", default="")
    parser.add_argument("--idle-exit-s", type=float, default=0.0)
    parser.add_argument("--parent-pid", type=int, default=0)
    parser.add_argument("--release-also", type=Path, action="append", default=[], help="unlink on exit too")
    parser.add_argument("--daemon", action="store_true", help="detach from the starting process")
    args = parser.parse_args(argv)
    if args.daemon:
        if os.fork() > 0:
            os._exit(0)  # the launcher; the daemon prints the ready line on the inherited stdout
        os.setsid()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s checkpoint-host %(levelname)s %(message)s")
    reporter = None
    if args.master_addr:  # grpc and the generated stubs load only when there is a master to report to
        from phalanx.checkpoint.report import MasterReporter

        reporter = MasterReporter(
            addr=args.master_addr,
            token_file=args.token_file,
            node_id=args.node_id,
            incarnation=args.incarnation,
        )
    server = HostServer(
        job_id=args.job_id,
        socket_path=Path(args.socket),
        shm_dir=Path(args.shm_dir),
        storage=open_storage(args.storage) if args.storage else None,
        storage_location=canonical_location(args.storage),
        keep_last=args.keep_last,
        reporter=reporter,
        idle_exit_s=args.idle_exit_s,
        parent_pid=args.parent_pid,
        release_also=args.release_also,
    )
    try:
        server.serve()
    except shm.UnsafePathError as exc:  # told to the starter, which raises it: the agent logs why
        log.error("%s", exc)
        print(json.dumps({"error": str(exc)}), flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
