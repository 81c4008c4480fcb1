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

    def _open_existing(self) -> Slots | None:
        paths = [shm.slot_path(self.shm_dir, self.job_id, self.rank, s) for s in range(shm.SLOTS)]
        if not all(p.exists() for p in paths):
            return None
        try:
            return Slots(paths)
        except (OSError, ValueError):
            return None

    def _allocate(self, size: int) -> Slots:
        """New slots of ``size`` bytes from the host; their pages are allocated by whoever populates them."""
        slots = Slots(self._allocate_paths(size))
        old, self.mapped = self.mapped, slots
        if old is not None:
            old.close()
        return slots

    def prepare(self, state: Any) -> None:
        """See :meth:`phalanx.checkpoint.engine.Checkpointer.prepare` (the caller fenced first)."""
        flat = codec.flatten(state)
        meta_len = 2 * len(json.dumps(flat.skeleton)) + 65536
        size = int((shm.align(shm.HEADER_SIZE + meta_len, shm.PAGE) + flat.data_len) * GROWTH)
        on_device = any(t.is_cuda for t in flat.tensors)

        def run() -> None:
            try:
                if self.mapped is None:
                    self.mapped = self._open_existing()
                slots = self.mapped
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
        if self.mapped is not None:
            self.mapped.wait_populated()

    def _join_prepare(self) -> None:
        """Waits for a :meth:`prepare` in progress (a save's own slot is readied by the save itself)."""
        if self._prepare is not None:
            self._prepare.join()
            self._prepare = None
        if self._prepare_error is not None:
            error, self._prepare_error = self._prepare_error, None
            raise CheckpointError(f"preparing the checkpoint memory failed: {error}") from error

    def ensure(self, size: int) -> tuple[Slots, bool]:
        """This rank's slots, big enough for ``size`` bytes, and whether this call had to allocate them
        (then the save also pays for first-touching the memory: see :meth:`prepare`)."""
        self._join_prepare()
        if self.mapped is None:
            self.mapped = self._open_existing()
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
            if self.mapped is None:
                self.mapped = self._open_existing()
                if self.mapped is not None:  # a restarted process: get the mapping ready for its saves
                    self.mapped.populate_async([0, 1])
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
