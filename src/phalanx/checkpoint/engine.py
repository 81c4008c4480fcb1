"""The training-side flash checkpoint: :class:`Checkpointer`.

``save`` copies the state's tensors raw into this rank's shared-memory slot and returns; the node's
checkpoint host (see :mod:`phalanx.checkpoint.host`) persists it in the background when asked.
``load`` returns the newest step every rank holds, from memory when this node kept it, else from
storage (see :mod:`phalanx.checkpoint.restore`).

The Checkpointer composes three parts, each with one job: the connection to the host
(:class:`~phalanx.checkpoint.connection.HostConnection`), this rank's slots
(:class:`~phalanx.checkpoint.slots.RankMemory`) and the persist requests on their way to the host
(:class:`~phalanx.checkpoint.persist_queue.PersistQueue`). What is left here is the save itself (the
snapshot's layout, the copy, a copy behind training) and the checks that tie the parts together.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from phalanx.api import round as round_file
from phalanx.api.errors import CheckpointError, PersistError
from phalanx.checkpoint import codec, copier, protocol, restore, shm
from phalanx.checkpoint.autoprepare import OptimizerWatch
from phalanx.checkpoint.connection import HostConnection
from phalanx.checkpoint.persist_queue import PersistQueue
from phalanx.checkpoint.persister import pin_queued
from phalanx.checkpoint.slots import RankMemory
from phalanx.checkpoint.storage import Storage, canonical_location, committed_steps, open_storage, save_id


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value else default


def current_round() -> int:
    """The rendezvous round this process trains in, part of every save's id: the agent's round file
    (rewritten when a round regroups the running workers), else torchrun's restart count."""
    path = os.environ.get(round_file.ENV_VAR)
    if path:
        try:
            info = round_file.read(Path(path))
        except (OSError, ValueError, TypeError):
            info = None
        if info is not None:
            return info.round
    return _env_int("TORCHELASTIC_RESTART_COUNT", 0)


# On a 16-core host a copy still gets faster from 4 threads to 16, where it keeps up with DLRover's torch
# copy on its 16 intra-op threads (see docs/benchmarks.md): memory bandwidth caps a copy eventually, but later
# than 4 threads.
MAX_COPY_THREADS = 16


def copy_threads_for(*, local_world_size: int) -> int:
    """Copy threads per rank: the node's cores shared by its ranks, 1 to 16."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(MAX_COPY_THREADS, cores // max(1, local_world_size)))


@dataclasses.dataclass
class _Behind:
    """A ``blocking=False`` save whose copy is still running."""

    step: int
    persist: bool
    ready_next: list[int]  # slots to populate once the copy is done
    copy: copier.BackgroundCopy


def _slot_view(view: torch.Tensor, data_off: int, entry: dict[str, Any], like: torch.Tensor) -> torch.Tensor:
    """The part of a slot's byte view that holds the tensor of table ``entry``, typed and shaped like it."""
    start = data_off + entry["offset"]
    return view[start : start + entry["nbytes"]].view(like.dtype).view(like.shape)


class Checkpointer:
    """Saves a rank's training state to node-local shared memory and loads the newest consistent one.

    Ranks and the job come from the environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``PHALANX_CHECKPOINT_*``) unless given. Without a host advertised in the environment, local rank 0
    starts one (detached, so it survives the training process) and the other local ranks connect to it.
    ``copy_threads`` (0: the node's cores divided by its local ranks, at most 16) copy while training waits:
    a blocking save, and what a save behind training has left when :meth:`fence` is called.
    ``prepare_from_optimizer`` (on by default): a new process's slots are readied in the background at its
    optimizers' second step, so that its first save is a plain copy without :meth:`prepare`
    (:mod:`phalanx.checkpoint.autoprepare`).
    """

    def __init__(
        self,
        *,
        storage: str | None = None,
        keep_last: int = 2,
        rank: int | None = None,
        world_size: int | None = None,
        local_rank: int | None = None,
        job_id: str | None = None,
        shm_dir: str | None = None,
        host_socket: str | None = None,
        host_idle_exit_s: float = 300.0,
        copy_threads: int = 0,
        prepare_from_optimizer: bool = True,
    ) -> None:
        env = os.environ
        self.rank = rank if rank is not None else _env_int("RANK", 0)
        self.world_size = world_size if world_size is not None else _env_int("WORLD_SIZE", 1)
        self.local_rank = local_rank if local_rank is not None else _env_int("LOCAL_RANK", 0)
        self.job_id = job_id or protocol.job_id_from_env(env)
        # Who saves: written into every snapshot, so a step is committed only from shards of one save of
        # one job (see storage.try_commit), and the storage root is claimed by this job (storage.claim).
        self.job_name, self.job_uid = protocol.job_identity(env, fallback=self.job_id)
        self.resumed_from: dict[str, Any] | None = None
        """``{"job", "step"}`` when the last load took another job's committed step from storage: this job
        continues that one, and may take its storage over (see storage.claim_decision)."""
        self.shm_dir = Path(shm_dir or env.get(protocol.ENV_SHM_DIR) or "/dev/shm")
        # Slots the host allocates are found where the host keeps them: a process told to look elsewhere
        # (another node's memory, in a test) does not have the host size slots for it after a load.
        self._host_memory = self.shm_dir == Path(env.get(protocol.ENV_SHM_DIR) or "/dev/shm")
        location = storage if storage is not None else env.get(protocol.ENV_STORAGE, "")
        self.storage_location = location
        self.storage: Storage | None = open_storage(location) if location else None
        self.keep_last = keep_last
        self.host_socket = protocol.host_socket(env, job_id=self.job_id, given=host_socket)
        self.host_idle_exit_s = host_idle_exit_s
        # Training waits for the copy, so it may use this rank's share of the node's cores (two threads copy
        # faster than one; see docs/benchmarks.md); more would only fight the node's other ranks, which save
        # at the same moment.
        self.copy_threads = copy_threads or copy_threads_for(local_world_size=_env_int("LOCAL_WORLD_SIZE", 1))
        self._behind: _Behind | None = None
        self.host = HostConnection(
            socket_path=self.host_socket,
            local_rank=self.local_rank,
            host_args={
                "job_id": self.job_id,
                "storage": self.storage_location,
                "keep_last": self.keep_last,
                "shm_dir": self.shm_dir,
                "idle_exit_s": self.host_idle_exit_s,
            },
            on_host=self._host_met,
        )
        self.memory = RankMemory(
            shm_dir=self.shm_dir,
            job_id=self.job_id,
            rank=self.rank,
            allocate=lambda size: self.host.allocate(self.rank, size),
        )
        self.persists = PersistQueue(rank=self.rank, connection=self.host, unconfirmed=self._unconfirmed)
        # A restarted process: the host kept this rank's slots from the previous incarnation, so their size
        # is known before the first save. Their pages are mapped from now on, while the script imports, builds
        # its model and loads, so that its first save is a plain copy (see RankMemory.adopt).
        self.memory.adopt()
        # A new process: its slots are sized from its optimizers' state at their second step, in the
        # background, unless a save, load or prepare() came first (see autoprepare); as after a load, only
        # where the host keeps its memory where this process looks.
        self._optimizer_watch = (
            OptimizerWatch(self._prepare_from_optimizer)
            if prepare_from_optimizer and self._host_memory and self.memory.mapped is None
            else None
        )
        self._host_storage_checked = False
        self.last_load: dict[str, Any] = {}
        self.last_save: dict[str, Any] = {}

    @property
    def call_limit_s(self) -> float:
        """Longest a request to the host is waited for (see :data:`connection.CALL_LIMIT_S`)."""
        return self.host.call_limit_s

    @call_limit_s.setter
    def call_limit_s(self, value: float) -> None:
        self.host.call_limit_s = value

    def client(self) -> protocol.HostClient:
        """The connection to this node's checkpoint host, starting the host if this is local rank 0."""
        return self.host.client()

    def _host_met(self, pid: int) -> None:
        # The connection is made on the first request, after __init__ created the queue.
        self.persists.host_met(pid)

    def _unconfirmed(self, steps: list[int]) -> list[int]:
        """Those of ``steps`` that no committed step on storage covers: nothing older than the newest
        committed step is missed."""
        try:
            newest = max(committed_steps(self.storage), default=-1) if self.storage is not None else -1
        except OSError:
            newest = -1
        return [step for step in steps if step > newest]

    def prepare(self, state: Any) -> None:
        """Allocates and prefaults the slots for a state like ``state`` on a background thread, so that
        the first :meth:`save` costs what every later one does. Optional; call it as early as the
        state's shape is known (for Adam: after the first optimizer step). A process that finds its slots
        from a previous incarnation, or that loaded a state, is prepared already (see :meth:`load`)."""
        self.fence()  # a reallocation must not unmap a slot under a running copy
        self.memory.prepare(state)

    def _prepare_from_optimizer(self, estimated: Any) -> None:
        """The optimizer watch's call (on the training path, inside an optimizer step): prepares for
        ``estimated`` in the background unless this process has slots or a save is copying, and only where a
        host runs (see :meth:`_prepare_like`: a process that never saves starts none)."""
        if self.memory.mapped is None and self._behind is None:
            self._prepare_like(estimated)

    def wait_prepared(self) -> None:
        """Waits for a :meth:`prepare` in progress, and for the slot an unprepared first save readies in the
        background; raises CheckpointError if preparing failed."""
        self.memory.wait_prepared()

    def save(self, step: int, state: Any, *, persist: bool = False, blocking: bool = True) -> None:
        """Copies ``state`` into shared memory; returns once the copy is complete.

        With ``persist=True`` the host then writes this snapshot to storage in the background; see
        :meth:`wait`. A crash during the copy leaves the previous snapshot intact.

        With ``blocking=False`` the copy runs behind the caller, which may run its next forward and
        backward meanwhile but must call :meth:`fence` before it changes any saved tensor: before the
        optimizer step, and before a forward pass that updates buffers (BatchNorm's running statistics).
        Training then stalls only for whatever part of the copy the forward and backward did not cover.
        The next save, :meth:`load`, :meth:`persist` and :meth:`close` fence first themselves.
        """
        self.fence()
        started = time.perf_counter()
        flat = codec.flatten(state)
        described: dict[str, Any] = {
            "format": 1,
            "step": step,
            "rank": self.rank,
            "world_size": self.world_size,
            "save": save_id(job=self.job_name, uid=self.job_uid, round_no=current_round(), step=step),
            "skeleton": flat.skeleton,
            "tensors": flat.table,
        }
        if self.resumed_from is not None:
            described["resumed_from"] = self.resumed_from
        meta = json.dumps(described, separators=(",", ":")).encode()
        data_off = shm.align(shm.HEADER_SIZE + len(meta), shm.PAGE)
        slots, allocated = self.memory.ensure(data_off + flat.data_len)
        index, seq = self.memory.pick_slot(slots)
        slots.writable(index, threads=self.copy_threads)
        seg, view = slots.segments[index], slots.views[index]
        writing = shm.SlotHeader(
            state=shm.STATE_WRITING, seq=seq, step=step, rank=self.rank, world_size=self.world_size
        )
        shm.pack_header(seg.buf, writing)
        seg.buf[shm.HEADER_SIZE : shm.HEADER_SIZE + len(meta)] = meta
        if any(t.is_cuda for t in flat.tensors):
            slots.register_cuda(index)
        pairs = [(_slot_view(view, data_off, e, t), t) for t, e in zip(flat.tensors, flat.table, strict=True)]
        complete = shm.SlotHeader(
            state=shm.STATE_COMPLETE,
            seq=seq,
            step=step,
            meta_len=len(meta),
            data_off=data_off,
            data_len=flat.data_len,
            rank=self.rank,
            world_size=self.world_size,
        )
        self.last_save = {"step": step, "slot": index, "allocated": allocated, "overlapped": not blocking}
        # After an allocating save the next one writes the other slot: it is readied off the training path
        # once this copy is done (a populate beside the copy would only slow it).
        ready_next = [1 - index] if allocated else []
        if blocking:
            copier.copy_now(pairs, threads=self.copy_threads)
            shm.pack_header(seg.buf, complete)
            self.last_save["seconds"] = time.perf_counter() - started
            slots.populate_async(ready_next)
            if persist:
                self.persist(step)
            return
        copy = copier.BackgroundCopy(
            pairs, threads=self.copy_threads, on_done=lambda: shm.pack_header(seg.buf, complete)
        )
        self._behind = _Behind(step=step, persist=persist, ready_next=ready_next, copy=copy)
        self.last_save["seconds"] = time.perf_counter() - started

    def fence(self) -> None:
        """Waits for the copy of a ``blocking=False`` save (a no-op without one); after it the saved tensors
        may change. Raises CheckpointError if that copy failed: the snapshot is then not used, and the one
        before it stays the newest."""
        behind, self._behind = self._behind, None
        if behind is None:
            return
        started = time.perf_counter()
        try:
            behind.copy.wait()
        finally:
            waited = time.perf_counter() - started
            self.last_save.update(
                fence_wait_s=waited, copy_s=behind.copy.copy_s, behind_bytes=behind.copy.behind_bytes
            )
            self.last_save["seconds"] = self.last_save.get("seconds", 0.0) + waited
        if self.memory.mapped is not None:
            self.memory.mapped.populate_async(behind.ready_next)
        if behind.persist:
            self.persist(behind.step)

    def persist(self, step: int) -> None:
        """Asks the host to persist the in-memory snapshot of ``step`` in the background.

        The request goes out from a thread of this process, so a host that hangs never stalls training.
        A request the host refused or could not take is raised here, by the next persist, or by
        :meth:`wait` (its snapshot stays in memory); a misconfigured storage is raised at the first one."""
        self.fence()  # the snapshot of a save still copying is not complete yet
        if self.storage is None:
            raise PersistError(
                "persisting needs a checkpoint storage location (storage= or PHALANX_CHECKPOINT_STORAGE)"
            )
        self._check_host_storage()
        # Pin the slot now, not when the host gets to it: later saves then go to the other slot and
        # cannot overwrite this snapshot while it waits in the host's queue (unless the other slot is
        # being persisted: see RankMemory.pick_slot). The host unpins it.
        self.persists.put(step, pin_queued(self.memory_slots(self.rank), step))

    def _check_host_storage(self) -> None:
        """The host persists where it was told (by its agent, or by whoever started it) and this process
        loads from ``self.storage``: they must be the same place, or a replacement node would never find
        what was persisted. Checked once, at the first persist, so a misconfigured job fails at that step
        with what to fix instead of at its last :meth:`wait`."""
        if self._host_storage_checked:
            return
        try:
            self.client()
        except CheckpointError as exc:
            raise PersistError(f"{exc}; the snapshot stays in memory") from exc
        host = self.host.storage
        if not host:
            raise PersistError(
                f"this node's checkpoint host ({self.host_socket}) has no storage, so nothing can be "
                f"persisted; give phalanx-run --checkpoint-dir {self.storage_location} (or "
                "PHALANX_CHECKPOINT_STORAGE_PATH), or save without persist: the snapshot stays in memory"
            )
        mine = canonical_location(self.storage_location)
        if host != mine:
            raise PersistError(
                f"this node's checkpoint host persists to {host}, but this process loads from {mine}: a "
                "new node would not find the persisted steps; leave storage= unset to use the host's, or "
                f"give phalanx-run --checkpoint-dir {self.storage_location}"
            )
        self._host_storage_checked = True

    def wait(self, *, timeout_s: float | None = None) -> list[dict[str, Any]]:
        """Waits for this rank's pending persistence; raises PersistError if any of it failed (the
        memory snapshot and training are unaffected)."""
        return self.persists.wait(timeout_s=timeout_s)

    # ---------------------------------------------------------------------------------------------
    # Loading and closing

    def load(
        self,
        *,
        shard_rank: int | None = None,
        replica_group: Any = None,
        into: Any = None,
        replicated: bool = False,
    ) -> tuple[int, Any] | None:
        """The newest ``(step, state)`` every rank holds, or None; see :mod:`phalanx.checkpoint.restore`.

        ``shard_rank`` picks whose saved shard to load (default: this rank). With ``replica_group`` (a
        process group of ranks holding the same shard), one member reads from storage and broadcasts.
        ``into`` is a state shaped like the saved one (``{"model": model.state_dict(), ...}``): a read
        from memory copies each tensor straight into its counterpart there (same path, dtype and shape)
        and returns it, instead of allocating new memory for it.

        ``replicated=True`` says every rank saves the same state (plain data parallel, DDP): a rank may then
        load any rank's snapshot in this node's memory, and the newest step any rank holds is loaded, the
        ranks that lack it receiving it from one that has it. A round that renumbers the ranks (a node left,
        or joined) and a replacement node with empty memory then still load from memory, where each rank
        would otherwise find no snapshot of its own and the job would fall back to storage, or start over.
        """
        self.fence()
        preparing = False
        if into is not None and not self.memory.adopt():
            # A rank without slots on this node (a replacement node, a new job) that knows the state's shape:
            # its slots are populated while the load reads (from storage: seconds), not after it.
            preparing = self._prepare_like(into, now=True)
        source = restore.LoadSource(
            storage=self.storage,
            memory_slots=self.memory_slots,
            shm_dir=self.shm_dir,
            job_id=self.job_id,
            job_name=self.job_name,
            copy_threads=self.copy_threads,
        )
        report = restore.load(
            source,
            shard_rank=self.rank if shard_rank is None else shard_rank,
            replica_group=replica_group,
            into=into,
            replicated=replicated,
        )
        self.last_load = report.summary()
        if report.resumed_from is not None:
            self.resumed_from = report.resumed_from
        if report.loaded is not None:
            preparing = self._prepare_like(report.loaded[1]) or preparing
        if preparing:
            self.last_load["preparing"] = True
        return report.loaded

    def _prepare_like(self, state: Any, *, now: bool = False) -> bool:
        """A load tells the size of the next save (``into``, or the state saved last, by this job or the one
        it resumes): the slots are readied in the background from then on, where a first save would otherwise
        allocate and first-touch them on the training path, at far more than the copy costs (see
        docs/benchmarks.md). This serves a rank whose node lost its memory (a replacement node, a job resumed
        from storage), a rank renumbered onto slots it never had, and a new job that loads ``into`` its state
        before training; a restarted rank that kept its slots is ready already (see __init__). Only where a
        host runs, and keeps its memory where this process looks: a process that only loads must not start a
        host, nor take the node's shared memory. With ``now`` the host sizes the slots on this thread (see
        RankMemory.prepare). Whether it prepares."""
        if not self._host_memory or not Path(self.host_socket).exists():
            return False
        try:
            if self.memory.prepared_for(state):
                return False
            self.memory.prepare(state, allocate_now=now)
        except (CheckpointError, OSError, ValueError, TypeError):
            return False  # only a hint: the first save allocates for itself, and says why when it cannot
        return True

    def memory_slots(self, shard_rank: int) -> list[shm.Segment]:
        """The mapped slots holding ``shard_rank``'s snapshots on this node ([] when there are none)."""
        return self.memory.segments(shard_rank)

    def close(self, *, stop_host: bool = False) -> None:
        """Unmaps the slots; with ``stop_host`` also stops the host, which unlinks the job's memory."""
        if self._optimizer_watch is not None:
            self._optimizer_watch.stop()
        with contextlib.suppress(CheckpointError):  # never unmap under a running copy
            self.fence()
        self.persists.close()
        self.memory.close()
        self.host.close(stop_host=stop_host)
