"""The node's flash-checkpoint host, owned by the agent.

The agent starts one :mod:`phalanx.checkpoint.host` process when it starts, so the shared-memory
snapshots outlive every training process it restarts: a restarted worker loads its last step from memory
instead of storage. Workers find the host through the environment (:meth:`NodeCheckpointHost.env`). When
workers fail, the newest complete snapshot of every local rank is persisted: it is pinned and queued
(:meth:`NodeCheckpointHost.queue_at_breakpoint`) before they are restarted, and written while they run.
:meth:`NodeCheckpointHost.stop` drains persistence and unlinks every segment when the agent exits for any
reason. The host runs detached and holds on to its memory only while the agent (or a worker) is
connected: an agent killed with SIGKILL leaves a host that releases everything :data:`IDLE_EXIT_S` later.

:class:`phalanx.agent.breakpoints.Breakpoints` settles the step of a save at breakpoint with the master,
so that nodes straddling a step all persist the one they share (see :mod:`phalanx.master.state.breakpoints`).

A host that cannot start is not fatal: the agent logs one error and runs without it, and the workers'
Checkpointer then falls back to starting its own host on local rank 0.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from phalanx.api.errors import CheckpointError
from phalanx.api.settings import CheckpointSettings
from phalanx.checkpoint import messages, protocol, shm

IDLE_EXIT_S = 10.0  # a host whose agent and workers are all gone (SIGKILL) releases the memory this late
PERSIST_NOW_LIMIT_S = 120.0  # longest a failure waits for the breakpoint save before restarting
STOP_LIMIT_S = 60.0  # longest the agent waits for the host to drain and exit
START_LIMIT_S = 30.0
WATCH_INTERVAL_S = 1.0  # how often the agent checks that its host lives and answers
PING_LIMIT_S = 10.0  # a host that does not answer a ping this long is hung (its answers take milliseconds)

_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")

Agree = Callable[[list[int], list[int], int], "int | None"]
"""(ranks, steps they all hold, the step this node would persist) -> the step the master says every node
of the broken round holds, or None while it does not know."""


def _safe(name: str) -> str:
    return _UNSAFE.sub("_", name) or "x"


def node_job_id(*, job_id: str, node_id: str, scope: str | None = None) -> str:
    """The id the node's host and workers name their segments and socket by: per node, because several
    agents of one job may share a machine (``phalanx local``) and global ranks move between them across
    rounds; and per ``scope`` (the job's uid or namespace, from the environment when not given: see
    :func:`protocol.job_scope`), because two jobs of one name in two namespaces may share a node. Flat
    names in the user's shared-memory directory, so a host that releases its segments leaves nothing."""
    scope = protocol.job_scope(os.environ) if scope is None else scope
    return ".".join(_safe(part) for part in (scope, job_id, node_id) if part)


def node_socket_path(*, job_id: str, node_id: str, scope: str | None = None) -> Path:
    """The host's control socket (named in one place: :func:`protocol.socket_path`)."""
    return protocol.socket_path(node_job_id(job_id=job_id, node_id=node_id, scope=scope))


def remove_node_segments(shm_dir: Path, *, job_id: str, node_id: str) -> list[Path]:
    """Unlinks the shared-memory segments of a node whose host was killed with it, and returns them. A host
    unlinks its segments when it exits, and a host whose agent was killed still does so
    :data:`IDLE_EXIT_S` later; a host killed too cannot (``phalanx local`` kills whatever is left in the
    cgroup or network namespace of a node it removes). The node's memory goes with the node."""
    return remove_segments(shm_dir, node_job=node_job_id(job_id=job_id, node_id=node_id))


def remove_segments(shm_dir: Path, *, node_job: str) -> list[Path]:
    """Unlinks every shared-memory segment of ``node_job`` (a :func:`node_job_id`) and returns them."""
    removed = []
    for segment in shm.job_files(shm_dir, node_job):
        with contextlib.suppress(FileNotFoundError):
            segment.unlink()
            removed.append(segment)
    return removed


def held_steps(shm_dir: Path, *, job_id: str, ranks: list[int]) -> dict[int, set[int]]:
    """The steps each of ``ranks`` holds complete in this node's shared memory (torch-free)."""
    slots = shm.list_job_slots(shm_dir, job_id)
    held: dict[int, set[int]] = {}
    for rank in ranks:
        steps: set[int] = set()
        for path in slots.get(rank, []):
            try:
                seg = shm.Segment(path)
            except (OSError, ValueError):
                continue
            try:
                header = seg.header()
                if header.complete:
                    steps.add(header.step)
            finally:
                seg.close()
        held[rank] = steps
    return held


def breakpoint_ranks(*, local_ranks: list[int], slot_ranks: list[int]) -> list[int]:
    """Whose snapshots a save at breakpoint persists: this node's ranks that have slots, or, when none has
    (the trainer names its slots by model shard, not by rank), every slot owner on this node."""
    mine = [r for r in local_ranks if r in slot_ranks]
    return mine or sorted(slot_ranks)


def agreed_step(held: dict[int, set[int]]) -> int | None:
    """The newest step every rank holds, or None (no ranks, or nothing in common)."""
    if not held:
        return None
    common = set.intersection(*held.values())
    return max(common) if common else None


@dataclass
class QueuedBreakpoint:
    """A save at breakpoint the host queued (and pinned) but may still be writing."""

    reason: str
    step: int
    ranks: list[int]
    started: float  # time.monotonic()
    timeout_s: float
    errors: list[str] = field(default_factory=list)


class NodeCheckpointHost:
    """Lifecycle of the agent's checkpoint host; every method is safe to call when it is not running."""

    def __init__(self, say: Callable[[str], None]) -> None:
        self._say = say
        self.handle: Any = None  # a phalanx.checkpoint.host.HostHandle while the host runs
        self.shm_dir: Path | None = None
        self._keepalive: protocol.HostClient | None = None
        self.last_persist: dict[str, Any] = {}
        self.replaced = 0
        """How many times the host died or hung and was replaced."""
        self._start_args: dict[str, Any] = {}
        self._lock = threading.Lock()  # the handle and the keepalive connection, against the watcher
        self._stopping = threading.Event()
        self._watcher: threading.Thread | None = None

    def start(
        self,
        *,
        settings: CheckpointSettings,
        shm_root: Path,
        job_id: str,
        node_id: str,
        master_addr: str,
        token_file: str,
        incarnation: str,
        release_also: Sequence[Path] = (),
    ) -> bool:
        """Starts the host; returns False (after logging why) when it could not start. ``release_also``:
        the node's files the host removes when it exits (it outlives a SIGKILLed agent)."""
        self._start_args = dict(
            job_id=node_job_id(job_id=job_id, node_id=node_id),
            storage=settings.storage_path,
            keep_last=settings.keep_last,
            shm_dir=shm_root,
            socket_path=node_socket_path(job_id=job_id, node_id=node_id),
            master_addr=master_addr,
            token_file=token_file,
            node_id=node_id,
            incarnation=incarnation,
            idle_exit_s=IDLE_EXIT_S,
            watch_parent=False,
            detach=True,
            timeout_s=START_LIMIT_S,
            release_also=release_also,
        )
        try:
            if not shm_root.is_dir():
                raise CheckpointError(f"{shm_root} is not a directory")
            self._launch()
        except (CheckpointError, OSError) as exc:
            self._say(
                f"error: the flash-checkpoint host did not start ({exc}); running without it "
                "(workers start their own host)"
            )
            return False
        self.shm_dir = shm_root
        where = settings.storage_path or "no storage"
        self._say(
            f"flash-checkpoint host running (pid {self.handle.pid}, shared memory in {shm_root}, "
            f"storage {where})"
        )
        self._stopping.clear()
        self._watcher = threading.Thread(target=self._watch, name="checkpoint-host-watch", daemon=True)
        self._watcher.start()
        return True

    def _launch(self) -> None:
        """Starts the host with :attr:`_start_args`; on failure nothing is left running."""
        # The host module is torch-free; importing it here keeps agents that never checkpoint lean.
        from phalanx.checkpoint import host

        # Detached (its own session), so a signal to the agent's process group cannot take the host down
        # before it released the memory. The agent holds a connection for its whole life: when the agent
        # and its workers are gone, even by SIGKILL, the host exits after IDLE_EXIT_S and unlinks every
        # segment. A host started after a host died adopts the node's segments, snapshots included.
        self.handle = host.start(**self._start_args)
        try:
            self._keepalive = protocol.HostClient(str(self.handle.socket_path), timeout_s=5.0)
        except CheckpointError:
            with contextlib.suppress(CheckpointError, OSError):
                self.handle.stop(timeout_s=5.0)
            self.handle = None
            raise

    def _watch(self) -> None:
        """Replaces a host that died or hangs, keeping the node's snapshots: without a host, every persist
        of every worker fails, and the restarted workers' would too."""
        failed_starts = 0
        next_try = 0.0
        while not self._stopping.wait(WATCH_INTERVAL_S):
            with self._lock:
                if self._stopping.is_set() or time.monotonic() < next_try:
                    continue
                problem = self._problem()
                if not problem or self._stopping.is_set():
                    continue
                if self._replace(problem):
                    failed_starts = 0
                else:  # back off: a host that cannot start now will not in a second either
                    failed_starts += 1
                    next_try = time.monotonic() + min(60.0, 2.0**failed_starts)

    def _problem(self) -> str:
        """Why the host needs replacing ("" when it is fine)."""
        if self.handle is None:
            return "is not running"
        if not self.handle.alive():
            return f"(pid {self.handle.pid}) exited"
        try:
            if self._keepalive is None:
                raise CheckpointError("no connection")
            self._keepalive.call(messages.Ping(), timeout_s=PING_LIMIT_S)
        except CheckpointError as exc:
            return f"(pid {self.handle.pid}) does not answer ({exc})"
        return ""

    def _replace(self, problem: str) -> bool:
        """Kills the host and starts another; returns whether it started."""
        old = self.handle
        if self._keepalive is not None:
            self._keepalive.close()
            self._keepalive = None
        if old is not None:
            old.kill()  # a stopped or stuck host too: it must not write once the new one adopted the memory
        try:
            self._launch()
        except (CheckpointError, OSError) as exc:
            self.handle = None
            self._say(f"error: the flash-checkpoint host {problem}, and a new one did not start ({exc})")
            return False
        self.replaced += 1
        self._say(
            f"the flash-checkpoint host {problem}; replaced it (pid {self.handle.pid}), with the node's "
            "snapshots"
        )
        return True

    @property
    def running(self) -> bool:
        """Whether a host was started and still runs."""
        return self.handle is not None and bool(self.handle.alive())

    def env(self) -> dict[str, str]:
        """Environment variables that point training processes at the host ({} without one)."""
        return dict(self.handle.env()) if self.handle is not None else {}

    def save_at_breakpoint(
        self,
        reason: str,
        *,
        ranks: list[int],
        step: int | None = None,
        agree: Agree | None = None,
        timeout_s: float = PERSIST_NOW_LIMIT_S,
    ) -> dict[str, Any]:
        """:meth:`queue_at_breakpoint`, then :meth:`finish_breakpoint`: returns once the step is on
        storage, or failed, or ``timeout_s`` passed. Logs and returns ``{"ok", "step", "errors"}`` ({}
        when nothing was queued)."""
        queued = self.queue_at_breakpoint(reason, ranks=ranks, step=step, agree=agree, timeout_s=timeout_s)
        return self.finish_breakpoint(queued) if queued is not None else {}

    def queue_at_breakpoint(
        self,
        reason: str,
        *,
        ranks: list[int],
        step: int | None = None,
        agree: Agree | None = None,
        timeout_s: float = PERSIST_NOW_LIMIT_S,
    ) -> QueuedBreakpoint | None:
        """Queues the persist of the newest step that every one of ``ranks`` (this node's current ranks;
        see :func:`breakpoint_ranks`) holds complete in memory, or of ``step`` when given. Returns once the
        host queued it, which pins those snapshots: the next workers' saves cannot overwrite them, so they
        may start at once while storage is written. None without a host, storage or a common step.

        The host's own ``persist_now`` takes each rank's newest snapshot, which differ by one step when a
        rank died mid-save; a step is committed on storage only when every rank wrote it, so the ranks
        must agree on the step first. Across nodes the master settles it: ``agree`` reports what the
        ranks hold and returns the step every node of the broken round holds, or None while the master
        does not know it yet (see :mod:`phalanx.master.state.breakpoints`)."""
        if not self.running or not self.handle.storage or self.shm_dir is None:
            return None
        slot_ranks = sorted(shm.list_job_slots(self.shm_dir, self.handle.job_id))
        ranks = breakpoint_ranks(local_ranks=ranks, slot_ranks=slot_ranks)
        held = held_steps(self.shm_dir, job_id=self.handle.job_id, ranks=ranks)
        chosen = (
            agreed_step(held) if step is None else (step if all(step in s for s in held.values()) else None)
        )
        if step is None and chosen is not None and agree is not None:
            common = sorted(set.intersection(*held.values()))
            told = agree(ranks, common, chosen)
            if told is not None and told != chosen:
                self._say(f"save at breakpoint ({reason}): step {told}, which every node holds, not {chosen}")
                chosen = told
        if chosen is None:
            self._say(f"save at breakpoint ({reason}): no step that ranks {ranks} all hold in memory")
            return None
        queued = QueuedBreakpoint(
            reason=reason, step=chosen, ranks=ranks, started=time.monotonic(), timeout_s=timeout_s
        )
        try:
            client = protocol.HostClient(str(self.handle.socket_path), timeout_s=5.0)
            try:
                for rank in ranks:
                    msg = messages.Persist(rank=rank, step=chosen)
                    reply = client.call(msg, timeout_s=min(timeout_s, PING_LIMIT_S))  # queued at once
                    if not reply.get("ok"):
                        queued.errors.append(str(reply.get("error")))
            finally:
                client.close()
        except CheckpointError as exc:
            queued.errors.append(str(exc))
        return queued

    def finish_breakpoint(self, queued: QueuedBreakpoint) -> dict[str, Any]:
        """Waits until the queued step is on storage (or failed, or its time limit passed); logs and
        returns ``{"ok", "step", "errors"}``."""
        errors = queued.errors
        if not errors and self.handle is not None:
            try:
                client = protocol.HostClient(str(self.handle.socket_path), timeout_s=5.0)
                try:
                    for rank in queued.ranks:
                        left = max(0.1, queued.timeout_s - (time.monotonic() - queued.started))
                        msg = messages.Wait(rank=rank, step=queued.step, timeout=left)
                        reply = client.call(msg, timeout_s=left + 5.0)
                        if not reply.get("ok"):
                            errors.append(str(reply.get("error")))
                        # Overwritten before it was written (the slot was not pinned in time): not on storage.
                        errors += [str(r["skipped"]) for r in reply.get("results", []) if r.get("skipped")]
                finally:
                    client.close()
            except CheckpointError as exc:
                errors.append(str(exc))
        took = time.monotonic() - queued.started
        what = f"save at breakpoint ({queued.reason})"
        if errors:
            self._say(f"{what} of step {queued.step} failed after {took:.2f}s: {errors}")
        else:
            self._say(f"{what}: persisted step {queued.step} of ranks {queued.ranks} in {took:.2f}s")
        self.last_persist = {"ok": not errors, "step": queued.step, "errors": errors}
        return self.last_persist

    def stop(self) -> None:
        """Drains persistence, stops the host and removes the node's shared memory."""
        self._stopping.set()
        if self._watcher is not None:
            self._watcher.join()
            self._watcher = None
        handle, self.handle = self.handle, None
        if handle is not None:
            try:
                code = handle.stop(timeout_s=STOP_LIMIT_S)
            except (CheckpointError, OSError) as exc:
                self._say(f"stopping the flash-checkpoint host failed: {exc}")
                code = -1
            if code != 0:
                self._say(f"the flash-checkpoint host exited with code {code}")
        if self._start_args:
            # A host that died (crashed, killed after the watcher's last look, hung and killed above)
            # released nothing, and the node's memory must not outlive its agent.
            removed = remove_segments(Path(self._start_args["shm_dir"]), node_job=self._start_args["job_id"])
            with contextlib.suppress(FileNotFoundError):
                Path(self._start_args["socket_path"]).unlink()
            if removed:
                self._say(f"removed {len(removed)} shared-memory segments the host left behind")
        if self._keepalive is not None:
            self._keepalive.close()
            self._keepalive = None
        self.shm_dir = None
