"""The training-side flash checkpoint: :class:`Checkpointer`.

``save`` copies the state's tensors raw into this rank's shared-memory slot and returns; the node's
checkpoint host (see :mod:`phalanx.checkpoint.host`) persists it in the background when asked.
``load`` returns the newest step every rank holds, from memory when this node kept it, else from
storage (see :mod:`phalanx.checkpoint.restore`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import queue
import socket
import threading
import time
from pathlib import Path
from typing import Any

import torch

from phalanx.api import round as round_file
from phalanx.api.errors import CheckpointError, PersistError
from phalanx.checkpoint import codec, copier, protocol, shm
from phalanx.checkpoint.persister import pin_queued
from phalanx.checkpoint.storage import Storage, canonical_location, committed_steps, open_storage, save_id

_GROWTH = 1.1  # headroom when a slot is (re)allocated, so a slightly bigger state does not reallocate
CALL_LIMIT_S = 5.0
"""Longest a training process waits for its host to answer a request. Answers take milliseconds (storage
is written on the host's own thread); a host that takes longer is hung, and its agent replaces it, so a
save or persist then fails with an error instead of stalling training."""
MAX_PENDING_STEPS = 1000  # persisted steps remembered between waits, to tell which a lost host took along
SILENT_HOLD_S = 30.0
"""How long a host that did not answer is not asked again while it has not been replaced, so that a hung
host stalls training once, not at every persist (its agent replaces it within seconds)."""


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


# Measured on a 16-core host: 1 GiB in 0.061 s with 4 threads, 0.033 s with 16 (DLRover's torch copy on its
# 16 intra-op threads: 0.034 s). Memory bandwidth caps a copy eventually, but later than 4 threads.
MAX_COPY_THREADS = 16


def copy_threads_for(*, local_world_size: int) -> int:
    """Copy threads per rank: the node's cores shared by its ranks, 1 to 16."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(MAX_COPY_THREADS, cores // max(1, local_world_size)))


class _Slots:
    """This rank's two slots, mapped, with a uint8 tensor view over each.

    A slot is written only once all its memory is allocated (:meth:`writable`): a write into a page that
    tmpfs cannot allocate would kill the process with SIGBUS instead of raising."""

    def __init__(self, paths: list[Path]) -> None:
        self.segments = [shm.Segment(p) for p in paths]
        self.views = [torch.frombuffer(s.buf, dtype=torch.uint8) for s in self.segments]
        self.size = min(s.size for s in self.segments)
        self._registered: set[int] = set()
        self._register_lock = threading.Lock()
        self._populating: dict[int, threading.Thread] = {}
        # Set once a save copied device tensors: the slots readied off the training path are then pinned
        # there too (pinning 4 GiB takes ~0.19 s on an H200's host, over twice the copy itself).
        self.pin_for_cuda = False

    def populate_async(self, indices: list[int]) -> None:
        """Allocates and maps some slots (and pins them for a GPU's copies, see :attr:`pin_for_cuda`), each
        on a background thread of its own, while training goes on; a failure shows again, with its cause,
        when a save needs that slot (:meth:`writable`)."""
        for i in indices:
            if i in self._populating:
                continue
            thread = threading.Thread(target=self._populate_quietly, args=(i,), name="phalanx-ckpt-populate")
            thread.daemon = True
            thread.start()
            self._populating[i] = thread

    def wait_populated(self) -> None:
        """Waits for the background populates started so far (a failure shows again at :meth:`writable`)."""
        for thread in self._populating.values():
            thread.join()
        self._populating.clear()

    def _populate_quietly(self, index: int) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.segments[index].populate()
            if self.pin_for_cuda:
                with contextlib.suppress(RuntimeError):  # the save pins it again, and raises then
                    self.register_cuda(index)

    def writable(self, index: int, *, threads: int) -> None:
        """Returns once slot ``index`` has all its memory (populating it on ``threads`` threads if the
        background has not); raises CheckpointError when the node's shared memory cannot hold it."""
        pending = self._populating.pop(index, None)
        if pending is not None:
            pending.join()
        seg = self.segments[index]
        if seg.allocated():
            return
        try:
            seg.populate(threads=threads)
        except OSError as exc:
            raise CheckpointError(
                f"cannot allocate {seg.size} bytes of shared memory for the checkpoint slot {seg.path}: "
                f"{exc.strerror}; give the node more shared memory (/dev/shm, or the Pod's memory-backed "
                "emptyDir) or checkpoint less state"
            ) from exc

    def register_cuda(self, index: int) -> None:
        """Pins a slot for fast device-to-host copies (cudaHostRegister); a pinned slot stays pinned."""
        with self._register_lock:
            if index in self._registered or not torch.cuda.is_available():
                return
            self.pin_for_cuda = True
            view = self.views[index]
            torch.cuda.cudart().cudaHostRegister(  # type: ignore[no-untyped-call]
                view.data_ptr(), view.numel(), 0
            )
            self._registered.add(index)

    def close(self) -> None:
        self.wait_populated()  # never unmap under a running madvise
        for index in self._registered:
            with contextlib.suppress(RuntimeError):
                torch.cuda.cudart().cudaHostUnregister(  # type: ignore[no-untyped-call]
                    self.views[index].data_ptr()
                )
        self._registered.clear()
        self.views.clear()  # the buffer exports must go before the mmaps can close
        for seg in self.segments:
            seg.close()


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
    ``copy_threads`` (0: the node's cores divided by its local ranks, at most 4) copy while training waits:
    a blocking save, and what a save behind training has left when :meth:`fence` is called.
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
        location = storage if storage is not None else env.get(protocol.ENV_STORAGE, "")
        self.storage_location = location
        self.storage: Storage | None = open_storage(location) if location else None
        self.keep_last = keep_last
        self.host_socket = host_socket or env.get(protocol.ENV_SOCKET) or self._default_socket()
        self.host_idle_exit_s = host_idle_exit_s
        # Training waits for the copy, so it may use this rank's share of the node's cores (two threads
        # copied 1 GiB in 0.09-0.12 s against 0.13-0.17 s for one here); more would only fight the
        # node's other ranks, which save at the same moment.
        self.copy_threads = copy_threads or copy_threads_for(local_world_size=_env_int("LOCAL_WORLD_SIZE", 1))
        self._behind: _Behind | None = None
        self._client: protocol.HostClient | None = None
        self._client_lock = threading.Lock()
        self._host_pid = 0  # of the host this process is connected to, to notice it was replaced
        self._host_storage = ""  # where that host persists (canonical), "" for nowhere
        self._host_lost = False  # a host went away since this process first met one
        self.call_limit_s = CALL_LIMIT_S
        self._silent: tuple[tuple[int, int, int], float] | None = None  # (socket, until) of a hung host
        self._own_host: Any = None  # the HostHandle of a host this process started
        self._slots: _Slots | None = None
        self._prepare: threading.Thread | None = None
        self._prepare_error: BaseException | None = None
        # Persist requests go out from a thread of their own (see persist); what they became is kept here.
        self._lock = threading.Lock()
        self._persisting: dict[int, int] = {}  # step -> pid of the host that took it (0: not sent yet)
        self._lost: list[int] = []  # steps taken by a host that went away before it confirmed them
        self._refused: list[str] = []  # persist requests the host refused or could not take
        self._outbox: queue.Queue[tuple[int, shm.Segment | None] | None] = queue.Queue()
        self._unsent = 0
        self._sent = threading.Condition(self._lock)
        self._sender: threading.Thread | None = None
        self._host_storage_checked = False
        self.last_load: dict[str, Any] = {}
        self.last_save: dict[str, Any] = {}

    def _default_socket(self) -> str:
        return str(protocol.socket_path(self.job_id))

    # ---------------------------------------------------------------------------------------------
    # The host

    def client(self) -> protocol.HostClient:
        """The connection to this node's checkpoint host, starting the host if this is local rank 0."""
        with self._client_lock:
            if self._client is None:
                self._client = self._connect()
                self._met_host(self._client)
            return self._client

    def _connect(self) -> protocol.HostClient:
        try:
            return protocol.HostClient(self.host_socket, timeout_s=2.0)
        except CheckpointError:
            if self.local_rank != 0 or protocol.ENV_SOCKET in os.environ:
                # At first the host may still be starting. Later, a host that went away is not waited
                # for: the agent replaces it, and the next request connects to the new one.
                if self._host_lost:
                    raise
                return self._connect_retry()
        from phalanx.checkpoint import host

        self._own_host = host.start(
            job_id=self.job_id,
            storage=self.storage_location,
            keep_last=self.keep_last,
            shm_dir=self.shm_dir,
            socket_path=self.host_socket,
            idle_exit_s=self.host_idle_exit_s,
            watch_parent=False,
            detach=True,
        )
        return self._connect_retry()

    def _connect_retry(self, timeout_s: float = 30.0) -> protocol.HostClient:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return protocol.HostClient(self.host_socket, timeout_s=2.0)
            except CheckpointError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def _met_host(self, client: protocol.HostClient) -> None:
        """Learns who the host is. Persists queued on a host that has since been replaced are lost: the new
        host adopted the memory, not the old one's queue."""
        try:
            reply = client.call({"op": "ping"}, timeout_s=self.call_limit_s)
        except CheckpointError:
            client.close()
            raise
        self._host_pid = int(reply.get("pid", 0))
        self._host_storage = str(reply.get("storage", ""))
        with self._lock:
            gone = [step for step, pid in self._persisting.items() if pid and pid != self._host_pid]
            for step in gone:
                del self._persisting[step]
        if gone:
            unconfirmed = self._unconfirmed(gone)
            with self._lock:
                self._lost += unconfirmed

    def _unconfirmed(self, steps: list[int]) -> list[int]:
        """Those of ``steps`` that no committed step on storage covers: nothing older than the newest
        committed step is missed."""
        try:
            newest = max(committed_steps(self.storage), default=-1) if self.storage is not None else -1
        except OSError:
            newest = -1
        return [step for step in steps if step > newest]

    def _drop_client(self) -> None:
        with self._client_lock:
            if self._client is not None:
                self._client.close()
                self._client = None
            self._host_lost = True

    def _call(self, message: protocol.Message, *, timeout_s: float | None) -> protocol.Message:
        """One request to the host. A connection the host closed is made again once: the host died, and
        its agent may have replaced it already. A host that does not answer is not asked again, so the
        caller learns of it within ``timeout_s``, and is told at once while that host was not replaced (see
        :data:`SILENT_HOLD_S`)."""
        self._refuse_a_silent_host()
        try:
            return self.client().call(message, timeout_s=timeout_s)
        except protocol.HostTimeoutError:
            self._drop_client()
            identity = protocol.socket_identity(self.host_socket)
            if identity is not None:
                self._silent = (identity, time.monotonic() + SILENT_HOLD_S)
            raise
        except CheckpointError:
            self._drop_client()
        try:
            return self.client().call(message, timeout_s=timeout_s)
        except CheckpointError:
            self._drop_client()
            raise

    def _refuse_a_silent_host(self) -> None:
        if self._silent is None:
            return
        identity, until = self._silent
        if protocol.socket_identity(self.host_socket) == identity and time.monotonic() < until:
            raise protocol.HostTimeoutError(
                f"the checkpoint host at {self.host_socket} did not answer within {self.call_limit_s}s "
                "and has not been replaced yet"
            )
        self._silent = None  # a new host bound the socket, or it is time to ask the old one again

    # ---------------------------------------------------------------------------------------------
    # Memory

    def _open_existing(self) -> _Slots | None:
        paths = [shm.slot_path(self.shm_dir, self.job_id, self.rank, s) for s in range(shm.SLOTS)]
        if not all(p.exists() for p in paths):
            return None
        try:
            return _Slots(paths)
        except (OSError, ValueError):
            return None

    def _allocate(self, size: int) -> _Slots:
        """New slots of ``size`` bytes from the host; their pages are allocated by whoever populates them."""
        reply = self._call({"op": "alloc", "rank": self.rank, "size": size}, timeout_s=self.call_limit_s)
        if not reply.get("ok"):
            raise CheckpointError(str(reply.get("error")))
        slots = _Slots([Path(p) for p in reply["paths"]])
        old, self._slots = self._slots, slots
        if old is not None:
            old.close()
        return slots

    def _needed(self, flat: codec.Flat, meta_len: int) -> int:
        return shm.align(shm.HEADER_SIZE + meta_len, shm.PAGE) + flat.data_len

    def prepare(self, state: Any) -> None:
        """Allocates and prefaults the slots for a state like ``state`` on a background thread, so that
        the first :meth:`save` costs what every later one does. Optional; call it as early as the
        state's shape is known (for Adam: after the first optimizer step)."""
        self.fence()  # a reallocation must not unmap a slot under a running copy
        flat = codec.flatten(state)
        size = int(self._needed(flat, 2 * len(json.dumps(flat.skeleton)) + 65536) * _GROWTH)
        on_device = any(t.is_cuda for t in flat.tensors)

        def run() -> None:
            try:
                if self._slots is None:
                    self._slots = self._open_existing()
                slots = self._slots
                if slots is None or slots.size < size:
                    slots = self._allocate(size)
                for index, seg in enumerate(slots.segments):  # one thread: training runs beside it
                    seg.populate()
                    if on_device:
                        slots.register_cuda(index)
            except BaseException as exc:
                self._prepare_error = exc

        self._prepare = threading.Thread(target=run, name="phalanx-ckpt-prepare", daemon=True)
        self._prepare.start()

    def wait_prepared(self) -> None:
        """Waits for a :meth:`prepare` in progress, and for the slot an unprepared first save readies in the
        background; raises CheckpointError if preparing failed."""
        self._join_prepare()
        if self._slots is not None:
            self._slots.wait_populated()

    def _join_prepare(self) -> None:
        """Waits for a :meth:`prepare` in progress (a save's own slot is readied by the save itself)."""
        if self._prepare is not None:
            self._prepare.join()
            self._prepare = None
        if self._prepare_error is not None:
            error, self._prepare_error = self._prepare_error, None
            raise CheckpointError(f"preparing the checkpoint memory failed: {error}") from error

    def _ensure(self, size: int) -> tuple[_Slots, bool]:
        """This rank's slots, big enough for ``size`` bytes, and whether this call had to allocate them
        (then the save also pays for first-touching the memory: see :meth:`prepare`)."""
        self._join_prepare()
        if self._slots is None:
            self._slots = self._open_existing()
        if self._slots is not None and self._slots.size >= size:
            return self._slots, False
        return self._allocate(int(size * _GROWTH)), True

    def _pick_slot(self, slots: _Slots) -> tuple[int, int]:
        """The slot to write and the next sequence number: never the one the persister reads, then not one
        whose persist waits, then the one not holding the newest complete snapshot.

        When storage is slower than the persist interval, one slot is being persisted while the other
        waits for its turn; the save then takes the waiting one, and that persist is superseded by the
        newer save (persisted at its own persist). A save never waits for storage."""
        headers = [seg.header() for seg in slots.segments]
        seq = max(h.seq for h in headers) + 1

        def preference(i: int) -> tuple[bool, bool, bool, int]:
            h = headers[i]
            return (h.pin == shm.PIN_WRITING, bool(h.pin), h.complete, h.seq)

        return min(range(len(headers)), key=preference), seq

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
        slots, allocated = self._ensure(data_off + flat.data_len)
        index, seq = self._pick_slot(slots)
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
        if self._slots is not None:
            self._slots.populate_async(behind.ready_next)
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
        # being persisted: see _pick_slot). The host unpins it.
        pinned = pin_queued(self.memory_slots(self.rank), step)
        with self._lock:
            self._persisting[step] = 0
            for old in list(self._persisting)[:-MAX_PENDING_STEPS]:  # a job that never waits
                del self._persisting[old]
            self._unsent += 1
        self._outbox.put((step, pinned))
        if self._sender is None:
            self._sender = threading.Thread(
                target=self._send_persists, name="phalanx-ckpt-persist", daemon=True
            )
            self._sender.start()
        self._raise_refused()

    def _send_persists(self) -> None:
        while True:
            item = self._outbox.get()
            if item is None:
                return
            step, pinned = item
            try:
                reply = self._call(
                    {"op": "persist", "rank": self.rank, "step": step}, timeout_s=self.call_limit_s
                )
            except CheckpointError as exc:
                reply = {"ok": False, "error": str(exc)}
            with self._lock:
                if reply.get("ok"):
                    if step in self._persisting:
                        self._persisting[step] = self._host_pid
                else:
                    self._persisting.pop(step, None)
                    self._refused.append(f"step {step} ({reply.get('error')})")
                    if pinned is not None:
                        header = pinned.header()
                        if header.step == step and header.pin == shm.PIN_QUEUED:
                            shm.set_pin(pinned.buf, 0)
                self._unsent -= 1
                self._sent.notify_all()

    def _raise_refused(self) -> None:
        with self._lock:
            refused, self._refused = self._refused, []
        if refused:
            raise PersistError(
                f"the checkpoint host did not take the persist of {'; '.join(refused)}; those snapshots "
                "stay in memory"
            )

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
        host = self._host_storage
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
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._lock:
            while self._unsent:  # each request is answered, or refused, within call_limit_s
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise PersistError(f"{self._unsent} persist requests were not sent in {timeout_s}s")
                self._sent.wait(left)
            pending = bool(self._persisting)
        self._raise_refused()
        reply: protocol.Message = {"ok": True, "results": []}
        if pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            message = {"op": "wait", "rank": self.rank, "step": None, "timeout": left}
            try:
                reply = self._call(message, timeout_s=None if left is None else left + self.call_limit_s)
            except CheckpointError as exc:
                with self._lock:
                    unknown = sorted(set(self._lost) | set(self._persisting))
                    self._lost, self._persisting = [], {}
                raise PersistError(f"whether steps {unknown} were persisted is unknown: {exc}") from exc
        with self._lock:
            lost = sorted(set(self._lost))
            self._lost = []
            self._persisting.clear()
        if lost:
            raise PersistError(
                f"steps {lost} were taken by a checkpoint host that went away before they were committed; "
                "their snapshots stay in memory, and later persists go to the host that replaced it"
            )
        if not reply.get("ok"):
            raise PersistError(f"persisting the checkpoint failed: {reply.get('error')}")
        results: list[dict[str, Any]] = reply.get("results", [])
        return results

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
        from phalanx.checkpoint import restore

        self.fence()
        return restore.load(
            self,
            shard_rank=self.rank if shard_rank is None else shard_rank,
            replica_group=replica_group,
            into=into,
            replicated=replicated,
        )

    def memory_slots(self, shard_rank: int) -> list[shm.Segment]:
        """The mapped slots holding ``shard_rank``'s snapshots on this node ([] when there are none)."""
        if shard_rank == self.rank:
            if self._slots is None:
                self._slots = self._open_existing()
                if self._slots is not None:  # a restarted process: get the mapping ready for its saves
                    self._slots.populate_async([0, 1])
            return list(self._slots.segments) if self._slots else []
        segments = []
        for s in range(shm.SLOTS):
            with contextlib.suppress(OSError, ValueError):  # missing, or refused (see shm.open_owned)
                segments.append(shm.Segment(shm.slot_path(self.shm_dir, self.job_id, shard_rank, s)))
        return segments

    def close(self, *, stop_host: bool = False) -> None:
        """Unmaps the slots; with ``stop_host`` also stops the host, which unlinks the job's memory."""
        with contextlib.suppress(CheckpointError):  # never unmap under a running copy
            self.fence()
        if self._sender is not None:
            self._outbox.put(None)
            self._sender.join(timeout=self.call_limit_s + 1.0)
            self._sender = None
        if self._prepare is not None:
            self._prepare.join()
        if self._slots is not None:
            self._slots.close()
            self._slots = None
        if self._client is not None:
            if stop_host:
                with contextlib.suppress(CheckpointError):
                    self._client.call({"op": "stop"}, timeout_s=self.call_limit_s)
            self._client.close()
            self._client = None
            if stop_host and self._own_host is not None:
                self._own_host.stop()
        elif stop_host:
            with contextlib.suppress(CheckpointError, socket.error):
                client = protocol.HostClient(self.host_socket, timeout_s=2.0)
                client.call({"op": "stop"}, timeout_s=self.call_limit_s)
                client.close()
