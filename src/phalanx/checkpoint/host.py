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
protocol). Requests on the socket (JSON lines; see :mod:`phalanx.checkpoint.protocol`)::

    {"op": "alloc", "rank": r, "size": n}        -> {"ok": true, "paths": [slot0, slot1]}
    {"op": "persist", "rank": r, "step": s}      -> {"ok": true}            (queued)
    {"op": "wait", "rank": r, "step": s|null}    -> {"ok": bool, "error": ..., "results": [...]}
    {"op": "persist_now"}                        -> {"ok": bool, "steps": {rank: step}, "errors": [...]}
    {"op": "ping"}                               -> {"ok": true, "pid": p, "storage": location or ""}
    {"op": "stop"}
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from phalanx.api.errors import CheckpointError, PersistError
from phalanx.checkpoint import protocol, shm
from phalanx.checkpoint.persister import PersistResult, Superseded, choose_slot, persist_shard, pin_queued
from phalanx.checkpoint.storage import Storage, canonical_location, open_storage

if TYPE_CHECKING:
    from phalanx.checkpoint.report import MasterReporter

log = logging.getLogger("phalanx.checkpoint")

MAX_RESULTS = 1000  # persist results kept per rank for its next wait (failures also go to the master)
NO_STORAGE = (
    "this node's checkpoint host has no storage, so nothing can be persisted; give phalanx-run "
    "--checkpoint-dir (or PHALANX_CHECKPOINT_STORAGE_PATH), or save without persist: the snapshot "
    "stays in memory"
)


@dataclass
class _Rank:
    paths: list[Path]
    segments: list[shm.Segment] = field(default_factory=list)
    pending: int = 0
    results: list[dict[str, Any]] = field(default_factory=list)


class HostServer:
    """The host's state and request handling; :func:`main` runs it in its own process."""

    def __init__(
        self,
        *,
        job_id: str,
        socket_path: Path,
        shm_dir: Path,
        storage: Storage | None,
        keep_last: int,
        storage_location: str = "",
        reporter: MasterReporter | None = None,
        idle_exit_s: float = 0.0,
        parent_pid: int = 0,
        release_also: Sequence[Path] = (),
    ) -> None:
        self.job_id = job_id
        self.socket_path = socket_path
        self.shm_dir = shm_dir
        self.storage = storage
        # Told to every client that asks, so a Checkpointer can check that it loads from where this host
        # persists (see Checkpointer.persist).
        self.storage_location = storage_location
        self.keep_last = keep_last
        self.reporter = reporter
        self.idle_exit_s = idle_exit_s
        self.parent_pid = parent_pid
        # Files of the node that must not outlive a SIGKILLed owner (the agent's progress beacons): the
        # host outlives the agent by design, so it removes them with the job's memory.
        self.release_also = list(release_also)
        self._ranks: dict[int, _Rank] = {}
        self._cond = threading.Condition()
        self._queue: queue.Queue[tuple[int, int | None] | None] = queue.Queue()
        self._clients = 0
        self._last_client = time.monotonic()
        self._stopping = threading.Event()
        self._socket_id: tuple[int, int, int] | None = None  # of the socket this host bound

    # ---------------------------------------------------------------------------------------------
    # Requests

    def handle(self, request: dict[str, Any]) -> dict[str, Any]:
        """Answers one request."""
        op = request.get("op")
        if op == "ping":
            return {"ok": True, "pid": os.getpid(), "storage": self.storage_location}
        if op == "alloc":
            return self._alloc(int(request["rank"]), int(request["size"]))
        if op == "persist":
            return self._enqueue(int(request["rank"]), request.get("step"))
        if op == "wait":
            return self._wait(int(request["rank"]), request.get("step"), request.get("timeout"))
        if op == "persist_now":
            return self.persist_now()
        if op == "stop":
            self._stopping.set()
            return {"ok": True}
        return {"ok": False, "error": f"unknown request {op!r}"}

    def _alloc(self, rank: int, size: int) -> dict[str, Any]:
        paths = [shm.slot_path(self.shm_dir, self.job_id, rank, s) for s in range(shm.SLOTS)]
        try:
            # The rank allocates the pages itself (in parallel, and a full tmpfs then fails its populate
            # cleanly); this check only turns the common case, a /dev/shm too small, into an early answer.
            needed = sum(shm.unallocated_bytes(path, size) for path in paths)
            free = shm.free_bytes(self.shm_dir)
            if needed > free:
                raise OSError(
                    errno.ENOSPC,
                    f"{free} bytes free, two slots need {needed} more; give the node more shared memory",
                )
            for path in paths:
                shm.create(path, size)
        except OSError as exc:
            return {
                "ok": False,
                "error": f"cannot allocate {size} bytes of shared memory in {self.shm_dir}: {exc}",
            }
        with self._cond:
            old = self._ranks.get(rank)
            if old is not None:
                for seg in old.segments:
                    seg.close()
            entry = _Rank(paths=paths, segments=[shm.Segment(p) for p in paths])
            if old is not None:
                entry.pending, entry.results = old.pending, old.results
            self._ranks[rank] = entry
        return {"ok": True, "paths": [str(p) for p in paths]}

    def _enqueue(self, rank: int, step: int | None) -> dict[str, Any]:
        if self.storage is None:  # refused now, not found out by the trainer's wait many steps later
            return {"ok": False, "error": NO_STORAGE}
        with self._cond:
            entry = self._ranks.get(rank)
            if entry is None:
                return {"ok": False, "error": f"rank {rank} has no shared memory on this node"}
            entry.pending += 1
            if step is not None:  # the agent's saves at breakpoint: the restarted workers may save already
                pin_queued(entry.segments, step)
        self._queue.put((rank, step))
        return {"ok": True}

    def _wait(self, rank: int, step: int | None, timeout: float | None) -> dict[str, Any]:
        deadline = None if timeout is None else time.monotonic() + float(timeout)
        with self._cond:
            entry = self._ranks.get(rank)
            if entry is None:
                return {"ok": True, "results": []}
            while entry.pending:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return {"ok": False, "error": f"persisting rank {rank} did not finish in {timeout}s"}
                self._cond.wait(left)
            results = [r for r in entry.results if step is None or r["step"] == step]
            entry.results = []
        errors = [r["error"] for r in results if r.get("error")]
        return {"ok": not errors, "error": "; ".join(errors), "results": results}

    def persist_now(self) -> dict[str, Any]:
        """Persists the newest complete snapshot of every rank on this node, and waits for it."""
        if self.storage is None:
            return {"ok": False, "error": NO_STORAGE}
        with self._cond:
            ranks = sorted(self._ranks)
        steps: dict[str, int] = {}
        errors: list[str] = []
        for rank in ranks:
            chosen = choose_slot(self._ranks[rank].segments, None)
            if chosen is None:
                continue
            self._enqueue(rank, chosen[1].step)
            reply = self._wait(rank, None, None)
            if reply["ok"]:
                steps[str(rank)] = chosen[1].step
            else:
                errors.append(reply["error"])
        return {"ok": not errors, "steps": steps, "errors": errors}

    # ---------------------------------------------------------------------------------------------
    # Background persistence

    def _persist_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:  # stop
                return
            rank, step = item
            result: dict[str, Any] = {"rank": rank, "step": step}
            try:
                if self.storage is None:
                    raise PersistError(NO_STORAGE)
                done: PersistResult = persist_shard(
                    segments=self._ranks[rank].segments,
                    store=self.storage,
                    step=step,
                    keep_last=self.keep_last,
                )
                result.update(step=done.step, path=done.path, committed=done.committed, size=done.size_bytes)
                if done.not_committed:
                    result["not_committed"] = done.not_committed
                log.info("persisted step %d of rank %d in %.2fs", done.step, rank, done.duration_s)
                if self.reporter is not None:
                    self.reporter.report(
                        step=done.step,
                        ranks=[rank],
                        world_size=done.world_size,
                        path=done.path,
                        size_bytes=done.size_bytes,
                        duration_s=done.duration_s,
                    )
            except Superseded as exc:  # the newer step is persisted at its own turn
                result["skipped"] = str(exc)
                log.info("persisting rank %d: %s", rank, exc)
            except Exception as exc:  # reported to the trainer and the master; persistence goes on
                result["error"] = (
                    str(exc) if isinstance(exc, PersistError) else f"{type(exc).__name__}: {exc}"
                )
                log.error("persisting step %s of rank %d failed: %s", step, rank, result["error"])
                if self.reporter is not None and isinstance(step, int):
                    self.reporter.report(step=step, ranks=[rank], world_size=0, error=result["error"])
            with self._cond:
                entry = self._ranks[rank]
                entry.results.append(result)
                del entry.results[:-MAX_RESULTS]  # a trainer that never waits must not grow the host
                entry.pending -= 1
                self._cond.notify_all()

    # ---------------------------------------------------------------------------------------------
    # Serving

    def _serve_client(self, conn: socket.socket) -> None:
        reader = protocol.LineReader(conn)
        try:
            while True:
                request = reader.read()
                if request is None:
                    return
                try:
                    reply = self.handle(request)
                except (KeyError, ValueError, TypeError) as exc:
                    reply = {"ok": False, "error": f"bad request: {exc}"}
                protocol.send(conn, reply)
        except OSError:
            return
        finally:
            conn.close()
            with self._cond:
                self._clients -= 1
                self._last_client = time.monotonic()

    def _adopt(self) -> None:
        """Maps the job's slots already in ``shm_dir``: a host that restarts (or takes over from the host
        of a SIGKILLed agent) keeps the snapshots a restarted training process loads from."""
        for rank, paths in shm.list_job_slots(self.shm_dir, self.job_id).items():
            if rank not in self._ranks:
                segments = [shm.Segment(p) for p in paths]
                for seg in segments:
                    # A pin left by a host that died mid-persist would hold that slot forever: every save
                    # would then overwrite the other one, the newest, and a save cut short would leave no
                    # snapshot to load. A lingering host that still persists the slot finds it changed.
                    shm.set_pin(seg.buf, 0)
                self._ranks[rank] = _Rank(paths=paths, segments=segments)

    def _superseded(self) -> bool:
        """Whether a newer host bound this host's socket path: the node's job memory is then the newer
        host's to keep or release, not this one's."""
        if self._socket_id is None:
            return False
        now = protocol.socket_identity(self.socket_path)
        return now is not None and now != self._socket_id

    def _should_exit(self) -> bool:
        if self._stopping.is_set():
            return True
        if self._superseded():
            log.warning(
                "another checkpoint host took over %s; exiting and leaving the job's memory to it",
                self.socket_path,
            )
            return True
        if self.parent_pid and os.getppid() != self.parent_pid:
            log.warning("the checkpoint host's parent %d is gone; releasing shared memory", self.parent_pid)
            return True
        with self._cond:
            idle = self._clients == 0 and time.monotonic() - self._last_client > self.idle_exit_s
        return bool(self.idle_exit_s) and idle

    def serve(self, ready: socket.socket | None = None) -> None:
        """Serves until stopped, then drains persistence and unlinks every segment of the job, unless a
        newer host took the job over meanwhile (see :meth:`_superseded`).

        A host whose agent was SIGKILLed lingers until its idle limit; the restarted agent's host must
        neither lose the snapshots to that host's release nor release what that host still writes. Both
        steps (adopt + bind here, check + release at exit) run under one lock on the shared-memory
        directory, so the old host either releases before the new one looks, or sees it was replaced."""
        private = shm.check_private_dir(shm.private_dir(self.shm_dir))  # before anything is read from it
        if self.socket_path.parent == protocol.socket_dir():
            shm.check_private_dir(self.socket_path.parent)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with shm.directory_lock(private):
            self._adopt()
            with contextlib.suppress(FileNotFoundError):
                self.socket_path.unlink()
            old_umask = os.umask(0o177)  # the socket is owner-only from the start (no thread runs yet)
            try:
                listener.bind(str(self.socket_path))
            finally:
                os.umask(old_umask)
            self._socket_id = protocol.socket_identity(self.socket_path)
        listener.listen(64)
        listener.settimeout(0.2)
        worker = threading.Thread(target=self._persist_loop, name="persister", daemon=True)
        worker.start()
        print(json.dumps({"ready": str(self.socket_path), "pid": os.getpid()}), flush=True)
        with contextlib.suppress(OSError):
            sys.stdout.close()  # the starter reads one line; a closed pipe must not kill a later print
        try:
            while not self._should_exit():
                try:
                    conn, _ = listener.accept()
                except TimeoutError:
                    continue
                conn.settimeout(None)
                if not self._trusted(conn):
                    continue
                with self._cond:
                    self._clients += 1
                threading.Thread(target=self._serve_client, args=(conn,), daemon=True).start()
        finally:
            listener.close()
            self._queue.put(None)
            worker.join(timeout=600)
            if self.reporter is not None:
                self.reporter.close()  # the last shards' reports, above all those of a save at breakpoint
            with shm.directory_lock(private):
                if self._superseded():
                    self._close_segments()
                else:
                    self.release()

    def _trusted(self, conn: socket.socket) -> bool:
        """Whether the peer may use this host (see :func:`protocol.peer_allowed`); closes it if not. The
        socket's directory and mode already keep other users out; this holds where a caller put the
        socket somewhere others can reach."""
        try:
            uid = protocol.peer_uid(conn)
        except OSError:
            uid = -1
        if protocol.peer_allowed(uid, os.geteuid()):
            return True
        log.warning(
            "refused a connection from uid %d: only uid %d (or root) may use this host", uid, os.geteuid()
        )
        conn.close()
        return False

    def _close_segments(self) -> None:
        for entry in self._ranks.values():
            for seg in entry.segments:
                seg.close()

    def release(self) -> None:
        """Unlinks the socket, every shared-memory segment of the job and the ``release_also`` files."""
        for path in [self.socket_path, *self.release_also]:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        self._close_segments()
        for paths in shm.list_job_slots(self.shm_dir, self.job_id).values():
            for path in paths:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()


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

    def _call(self, message: dict[str, Any], timeout_s: float | None) -> dict[str, Any]:
        client = protocol.HostClient(str(self.socket_path))
        try:
            return client.call(message, timeout_s=timeout_s)
        finally:
            client.close()

    def persist_now(self, *, timeout_s: float | None = 600.0) -> dict[str, Any]:
        """Persists the newest complete in-memory snapshot of every local rank; returns the host's reply
        (``ok``, ``steps`` by rank, ``errors``). Call it when workers failed, before restarting them."""
        return self._call({"op": "persist_now"}, timeout_s)

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
                self._call({"op": "stop"}, min(timeout_s, 10.0))  # answered at once; draining follows
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
