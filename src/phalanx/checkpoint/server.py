"""The checkpoint host's server: the node's slots, the persist queue and the socket it answers on
(torch-free). :mod:`phalanx.checkpoint.host` starts it in a process of its own and is the API the agent
and the Checkpointer use; the requests it answers are :mod:`phalanx.checkpoint.messages`.

Each request kind has one handler (:attr:`HostServer.handlers`); a line that is no request of the protocol
is answered with an error that says why, and the host serves the next one.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import queue
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from phalanx.api.errors import PersistError
from phalanx.checkpoint import messages, protocol, shm
from phalanx.checkpoint.messages import AnyReply, Reply
from phalanx.checkpoint.persister import PersistResult, Superseded, choose_slot, persist_shard, pin_queued
from phalanx.checkpoint.storage import Storage

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
    """The host's state and request handling; :func:`phalanx.checkpoint.host.main` runs it in its own
    process."""

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
        self.handlers: dict[type[messages.Request], Callable[[Any], AnyReply]] = {
            messages.Alloc: self._on_alloc,
            messages.Persist: self._on_persist,
            messages.Wait: self._on_wait,
            messages.PersistNow: self._on_persist_now,
            messages.Ping: self._ping,
            messages.Stop: self._stop,
        }

    # ---------------------------------------------------------------------------------------------
    # Requests

    def handle(self, request: messages.Message) -> messages.Message:
        """Answers one decoded request; a malformed one gets an error reply that says what is wrong."""
        try:
            parsed = messages.parse_request(request)
        except messages.MalformedMessage as exc:
            return Reply.failed(f"bad request: {exc}").to_dict()
        return self.answer(parsed).to_dict()

    def answer(self, request: messages.Request) -> AnyReply:
        """Answers one request by the handler of its kind."""
        handler: Callable[[Any], AnyReply] = self.handlers[type(request)]
        return handler(request)

    def _ping(self, _request: messages.Ping) -> messages.Pong:
        return messages.Pong(pid=os.getpid(), storage=self.storage_location)

    def _on_alloc(self, request: messages.Alloc) -> AnyReply:
        return self._alloc(request.rank, request.size)

    def _on_persist(self, request: messages.Persist) -> Reply:
        return self._enqueue(request.rank, request.step)

    def _on_wait(self, request: messages.Wait) -> messages.Waited:
        return self._wait(request.rank, request.step, request.timeout)

    def _on_persist_now(self, _request: messages.PersistNow) -> AnyReply:
        return self._persist_now()

    def _stop(self, _request: messages.Stop) -> Reply:
        self._stopping.set()
        return Reply()

    def _alloc(self, rank: int, size: int) -> AnyReply:
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
            return Reply.failed(f"cannot allocate {size} bytes of shared memory in {self.shm_dir}: {exc}")
        with self._cond:
            old = self._ranks.get(rank)
            if old is not None and not old.pending:
                for seg in old.segments:
                    seg.close()
            # else a persist in flight still reads the old mappings (a restarted rank sizes its slots while
            # its save at breakpoint is written): they are unmapped when the persister lets go of them.
            entry = _Rank(paths=paths, segments=[shm.Segment(p) for p in paths])
            if old is not None:
                entry.pending, entry.results = old.pending, old.results
            self._ranks[rank] = entry
        return messages.Allocated(paths=[str(p) for p in paths])

    def _enqueue(self, rank: int, step: int | None) -> Reply:
        if self.storage is None:  # refused now, not found out by the trainer's wait many steps later
            return Reply.failed(NO_STORAGE)
        with self._cond:
            entry = self._ranks.get(rank)
            if entry is None:
                return Reply.failed(f"rank {rank} has no shared memory on this node")
            entry.pending += 1
            if step is not None:  # the agent's saves at breakpoint: the restarted workers may save already
                pin_queued(entry.segments, step)
        self._queue.put((rank, step))
        return Reply()

    def _wait(self, rank: int, step: int | None, timeout: float | None) -> messages.Waited:
        deadline = None if timeout is None else time.monotonic() + float(timeout)
        with self._cond:
            # The entry is looked up again after every wake-up: an allocation (a restarted rank sizing its
            # slots) replaces it, and the persister counts down the new one; waiting on the old one would
            # wait forever.
            while (entry := self._ranks.get(rank)) is not None and entry.pending:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return messages.Waited(
                        ok=False, error=f"persisting rank {rank} did not finish in {timeout}s"
                    )
                self._cond.wait(left)
            if entry is None:
                return messages.Waited(ok=True)
            results = [r for r in entry.results if step is None or r["step"] == step]
            entry.results = []
        errors = [r["error"] for r in results if r.get("error")]
        return messages.Waited(ok=not errors, error="; ".join(errors), results=results)

    def _persist_now(self) -> AnyReply:
        """Persists the newest complete snapshot of every rank on this node, and waits for it."""
        if self.storage is None:
            return Reply.failed(NO_STORAGE)
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
            if reply.ok:
                steps[str(rank)] = chosen[1].step
            else:
                errors.append(reply.error)
        return messages.PersistedNow(ok=not errors, steps=steps, errors=errors)

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
                try:
                    request = reader.read()
                except ValueError as exc:  # not JSON: the line is dropped, the connection goes on
                    protocol.send(conn, Reply.failed(f"bad request: {exc}").to_dict())
                    continue
                if request is None:
                    return
                try:
                    reply = self.handle(request)
                except (KeyError, ValueError, TypeError) as exc:  # a handler's own slip: answered, not fatal
                    reply = Reply.failed(f"bad request: {exc}").to_dict()
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
