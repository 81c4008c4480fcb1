"""A rank's shared-memory slots, as a training process sees them: :class:`Slots` maps a pair and readies
its memory; :class:`RankMemory` finds this rank's pair (or has the host allocate it), prepares it in the
background, and picks the slot a save writes."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from phalanx.api.errors import CheckpointError
from phalanx.checkpoint import codec, shm

GROWTH = 1.1  # headroom when a slot is (re)allocated, so a slightly bigger state does not reallocate


def prepared_size(flat: codec.Flat) -> int:
    """The slot size :meth:`RankMemory.prepare` readies for a flattened state: its data, a generous guess at
    its metadata (the tensor table grows with the names, which the skeleton does not hold), and headroom."""
    meta_len = 2 * len(json.dumps(flat.skeleton)) + 65536
    return int((shm.align(shm.HEADER_SIZE + meta_len, shm.PAGE) + flat.data_len) * GROWTH)


class Slots:
    """This rank's two slots, mapped, with a uint8 tensor view over each.

    A slot is written only once all its memory is allocated (:meth:`writable`): a write into a page that
    tmpfs cannot allocate would kill the process with SIGBUS instead of raising."""

    def __init__(self, paths: list[Path]) -> None:
        self.segments = [shm.Segment(p) for p in paths]
        self.views = [torch.frombuffer(s.buf, dtype=torch.uint8) for s in self.segments]
        self.size = min(s.size for s in self.segments)
        self._registered: set[int] = set()
        self._register_lock = threading.Lock()
        # Per slot, set once a background populate of it is over; a save waits only for the slot it writes.
        self._populating: dict[int, threading.Event] = {}
        self._threads: list[threading.Thread] = []
        self.populate_errors: dict[int, BaseException] = {}  # of background populates, shown by wait_prepared
        # Set once a save copied device tensors: the slots readied off the training path are then pinned
        # there too (pinning takes longer than the device-to-host copy itself; see docs/benchmarks.md).
        self.pin_for_cuda = False

    def populate_async(self, indices: list[int], *, in_order: bool = False) -> None:
        """Allocates and maps some slots (and pins them for a GPU's copies, see :attr:`pin_for_cuda`) in the
        background while training goes on: each on a thread of its own, or with ``in_order`` one after the
        other on a single thread (one core's worth, beside a training step that may want the others). A
        failure shows again, with its cause, when a save needs that slot (:meth:`writable`)."""
        todo = [i for i in indices if i not in self._populating]
        if not todo:
            return
        done = {i: threading.Event() for i in todo}
        self._populating.update(done)

        def run(order: list[int]) -> None:
            for i in order:
                try:
                    self._populate_quietly(i)
                finally:
                    done[i].set()

        for group in [todo] if in_order else [[i] for i in todo]:
            thread = threading.Thread(target=run, args=(group,), name="phalanx-ckpt-populate", daemon=True)
            thread.start()
            self._threads.append(thread)

    def wait_populated(self) -> None:
        """Waits for the background populates started so far (a failure shows again at :meth:`writable`)."""
        for thread in self._threads:
            thread.join()
        self._threads.clear()
        self._populating.clear()

    def _populate_quietly(self, index: int) -> None:
        try:
            self.segments[index].populate()
        except (OSError, ValueError) as exc:
            self.populate_errors[index] = exc
            return
        if self.pin_for_cuda:
            with contextlib.suppress(RuntimeError):  # the save pins it again, and raises then
                self.register_cuda(index)

    def writable(self, index: int, *, threads: int) -> None:
        """Returns once slot ``index`` has all its memory (populating it on ``threads`` threads if the
        background has not); raises CheckpointError when the node's shared memory cannot hold it."""
        pending = self._populating.pop(index, None)
        if pending is not None:
            pending.wait()
        seg = self.segments[index]
        if seg.allocated() and index not in self.populate_errors:
            return
        try:
            seg.populate(threads=threads)
            self.populate_errors.pop(index, None)
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


class RankMemory:
    """This rank's slots (opened when a restarted process finds them, else allocated by the host when a
    save needs them) and the other ranks' slots on this node, for loading.

    ``allocate(size)`` asks the host for this rank's two slots of ``size`` bytes and returns their paths."""

    def __init__(
        self, *, shm_dir: Path, job_id: str, rank: int, allocate: Callable[[int], list[Path]]
    ) -> None:
        self.shm_dir = shm_dir
        self.job_id = job_id
        self.rank = rank
        self._allocate_paths = allocate
        self.mapped: Slots | None = None
        self._prepare: threading.Thread | None = None
        self._prepare_error: BaseException | None = None
        self._lock = threading.Lock()

    def _open_existing(self) -> Slots | None:
        paths = [shm.slot_path(self.shm_dir, self.job_id, self.rank, s) for s in range(shm.SLOTS)]
        if not all(p.exists() for p in paths):
            return None
        try:
            return Slots(paths)
        except (OSError, ValueError):
            return None

    def adopt(self) -> bool:
        """Maps this rank's slots when an earlier incarnation of it left them on this node (the host keeps
        them across restarts), and maps their pages in the background, the slot the next save writes first:
        a new process would otherwise take a page fault per 4 KiB page in its first save, at several times
        the cost of the copy (see docs/benchmarks.md). Whether there were slots to adopt."""
        with self._lock:  # a prepare's thread may adopt or allocate meanwhile
            if self.mapped is None:
                self.mapped = self._open_existing()
                if self.mapped is not None:
                    target, _ = self.pick_slot(self.mapped)
                    self.mapped.populate_async([target, 1 - target], in_order=True)
            return self.mapped is not None

    def _allocate(self, size: int) -> Slots:
        """New slots of ``size`` bytes from the host; their pages are allocated by whoever populates them."""
        slots = Slots(self._allocate_paths(size))
        with self._lock:
            old, self.mapped = self.mapped, slots
        if old is not None:
            old.close()
        return slots

    def prepare(self, state: Any, *, allocate_now: bool = False) -> None:
        """See :meth:`phalanx.checkpoint.engine.Checkpointer.prepare` (the caller fenced first). The slots
        are sized by the host on a background thread, or with ``allocate_now`` on this one (milliseconds, or
        a CheckpointError here), and their pages populated behind it either way."""
        flat = codec.flatten(state)
        size = prepared_size(flat)
        on_device = any(t.is_cuda for t in flat.tensors)

        def run() -> None:
            self.adopt()
            slots = self.mapped
            if slots is None or slots.size < size:
                slots = self._allocate(size)
            if on_device:
                slots.pin_for_cuda = True
            # One thread (training runs beside it), the slot the next save writes first (slot 0 of a new
            # pair): that save waits only for its own.
            target, _ = self.pick_slot(slots)
            slots.populate_async([target, 1 - target], in_order=True)

        if allocate_now:
            run()
            return

        def in_background() -> None:
            try:
                run()
            except BaseException as exc:
                self._prepare_error = exc

        self._prepare = threading.Thread(target=in_background, name="phalanx-ckpt-prepare", daemon=True)
        self._prepare.start()

    def prepared_for(self, state: Any) -> bool:
        """Whether this rank's mapped slots hold a state like ``state`` (or a prepare is on its way)."""
        if self._prepare is not None:
            return True
        return self.mapped is not None and self.mapped.size >= prepared_size(codec.flatten(state))

    def wait_prepared(self) -> None:
        """Waits for a :meth:`prepare` in progress, and for the slot an unprepared first save readies in the
        background; raises CheckpointError if preparing failed."""
        self._join_prepare()
        if self.mapped is not None:
            self.mapped.wait_populated()
            errors, self.mapped.populate_errors = self.mapped.populate_errors, {}
            if errors:
                error = next(iter(errors.values()))
                raise CheckpointError(f"preparing the checkpoint memory failed: {error}") from error

    def _join_prepare(self, *, raise_error: bool = True) -> None:
        """Waits for a :meth:`prepare` in progress to have the slots sized and mapped (their pages are
        populated behind it: a save waits only for the slot it writes, see :meth:`Slots.writable`)."""
        if self._prepare is not None:
            self._prepare.join()
            self._prepare = None
        if self._prepare_error is not None and raise_error:
            error, self._prepare_error = self._prepare_error, None
            raise CheckpointError(f"preparing the checkpoint memory failed: {error}") from error

    def ensure(self, size: int) -> tuple[Slots, bool]:
        """This rank's slots, big enough for ``size`` bytes, and whether this call had to allocate them
        (then the save also pays for first-touching the memory: see :meth:`prepare`). A prepare that failed
        does not fail the save, which allocates what it needs itself (and says why when it cannot); the
        failure stays for :meth:`wait_prepared`: a prepare sized from a load may ask more than the save."""
        self._join_prepare(raise_error=False)
        self.adopt()
        if self.mapped is not None and self.mapped.size >= size:
            return self.mapped, False
        return self._allocate(int(size * GROWTH)), True

    @staticmethod
    def pick_slot(slots: Slots) -> tuple[int, int]:
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

    def segments(self, shard_rank: int) -> list[shm.Segment]:
        """The mapped slots holding ``shard_rank``'s snapshots on this node ([] when there are none)."""
        if shard_rank == self.rank:
            self.adopt()
            return list(self.mapped.segments) if self.mapped else []
        segments = []
        for s in range(shm.SLOTS):
            with contextlib.suppress(OSError, ValueError):  # missing, or refused (see shm.open_owned)
                segments.append(shm.Segment(shm.slot_path(self.shm_dir, self.job_id, shard_rank, s)))
        return segments

    def close(self) -> None:
        """Waits for a :meth:`prepare` in progress, then unmaps this rank's slots."""
        if self._prepare is not None:
            self._prepare.join()
        if self.mapped is not None:
            self.mapped.close()
            self.mapped = None
