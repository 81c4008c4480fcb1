"""Copying a state's tensors into a mapped slot: on the training thread, or behind the next step.

:func:`copy_now` blocks the caller for the copy, spread over ``threads`` of torch's intra-op pool.
:class:`BackgroundCopy` returns at once and copies while training runs the next forward and backward
(CheckFreq's pipelined snapshot); the caller must not change a saved tensor until
:meth:`BackgroundCopy.wait` returned, i.e. it waits before the optimizer step.

Device tensors are copied on a side CUDA stream that first waits for the work queued before the save, so
the copy engine moves them while the compute engines run the next step. Host tensors are copied in 8 MiB
chunks by ``memmove`` through ctypes (which releases the GIL and, unlike a torch copy on a second thread,
starts no second intra-op thread team) on a thread at idle priority: it only uses cores the training step
leaves idle, and :meth:`BackgroundCopy.wait` copies whatever is left at full speed on ``threads`` threads.
With a step that keeps every core busy, a background copy at normal priority costs training more per save
than a blocking copy, because the step has no idle core to give; at idle priority it costs about what a
blocking copy does, and with a core to spare less (see docs/benchmarks.md).
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import threading
import time
from collections.abc import Callable

import torch

from phalanx.api.errors import CheckpointError

Pair = tuple[torch.Tensor, torch.Tensor]  # (destination view in the slot, source tensor)


def copy_now(pairs: list[Pair], *, threads: int) -> None:
    """Copies every pair on the calling thread, with ``threads`` intra-op threads; waits for device copies."""
    on_device = any(src.is_cuda for _, src in pairs)
    before = torch.get_num_threads()
    if threads and before != threads:
        torch.set_num_threads(threads)
    try:
        for dst, src in pairs:
            dst.copy_(src, non_blocking=on_device)
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)
    if on_device:
        torch.cuda.synchronize()


CHUNK = 8 << 20  # small enough that the idle-priority thread's last chunk ends soon after the fence


def _idle_priority() -> None:
    """Moves the calling thread to SCHED_IDLE: it then runs only on cores nothing else wants."""
    with contextlib.suppress(AttributeError, OSError):  # not Linux, or a policy forbids it: normal priority
        os.sched_setscheduler(threading.get_native_id(), os.SCHED_IDLE, os.sched_param(0))


class BackgroundCopy:
    """One save's copy, running behind training; ``on_done`` runs once every byte is in place (it marks the
    snapshot complete), on whichever thread copied the last of it, and never after a failure."""

    def __init__(self, pairs: list[Pair], *, threads: int, on_done: Callable[[], None]) -> None:
        self._threads = max(1, threads)
        self._on_done = on_done
        self._started = time.perf_counter()
        self.copy_s = 0.0
        self.behind_bytes = 0  # bytes the background copied before the fence took over
        # The chunks are raw addresses: the pairs are held here so that neither the source tensors nor the
        # slot's views can be freed while a thread still copies between them.
        self._pairs = pairs
        self._chunks: list[tuple[int, int, int]] = []  # (destination address, source address, bytes)
        self._other: list[Pair] = []
        for dst, src in pairs:
            if src.is_cuda or not (src.is_contiguous() and dst.is_contiguous()):
                self._other.append((dst, src))
                continue
            size = src.numel() * src.element_size()
            for offset in range(0, size, CHUNK):
                self._chunks.append(
                    (dst.data_ptr() + offset, src.data_ptr() + offset, min(CHUNK, size - offset))
                )
        self._claim = itertools.count()  # next() on it is atomic under the GIL: each chunk is copied once
        self._lock = threading.Lock()
        self._left = len(self._chunks) + (1 if self._other else 0)
        self._errors: list[BaseException] = []
        self._ready: torch.cuda.Event | None = None
        if any(src.is_cuda for _, src in self._other):
            # The side stream must not read a tensor before the kernels queued so far have written it.
            self._ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
            self._ready.record()
        if self._left == 0:
            self._finish(0)
        self._thread = threading.Thread(target=self._background, name="phalanx-ckpt-copy", daemon=True)
        self._thread.start()

    def _finish(self, units: int) -> None:
        with self._lock:
            self._left -= units
            if self._left or self._errors:
                return
            self.copy_s = time.perf_counter() - self._started
            try:
                self._on_done()
            except BaseException as exc:
                self._errors.append(exc)

    def _copy_chunks(self, *, counting: bool = False) -> None:
        try:
            for index in self._claim:
                if index >= len(self._chunks):
                    return
                dst, src, length = self._chunks[index]
                ctypes.memmove(dst, src, length)
                if counting:
                    self.behind_bytes += length
                self._finish(1)
        except BaseException as exc:  # reported by wait(); the snapshot stays incomplete
            self._errors.append(exc)

    def _copy_other(self) -> None:
        try:
            if self._ready is None:
                for dst, src in self._other:
                    dst.copy_(src)
            else:
                stream = torch.cuda.Stream(device=self._other[0][1].device)  # type: ignore[no-untyped-call]
                stream.wait_event(self._ready)
                with torch.cuda.stream(stream):
                    for dst, src in self._other:
                        dst.copy_(src, non_blocking=src.is_cuda)
                stream.synchronize()
        except BaseException as exc:
            self._errors.append(exc)
            return
        self._finish(1)

    def _background(self) -> None:
        if self._other:
            self._copy_other()  # at normal priority: on a GPU this mostly waits for the copy engine
        _idle_priority()
        self._copy_chunks(counting=True)

    def done(self) -> bool:
        """Whether every byte is in place, or the copy failed."""
        with self._lock:
            return self._left == 0 or bool(self._errors)

    def wait(self) -> None:
        """Copies what the background has not on ``threads`` threads (this one among them), then returns
        once the copy is complete; raises CheckpointError if it failed."""
        helpers = [
            threading.Thread(target=self._copy_chunks, name="phalanx-ckpt-copy")
            for _ in range(0 if self.done() else self._threads - 1)  # none when the background finished
        ]
        for helper in helpers:
            helper.start()
        self._copy_chunks()
        for helper in helpers:
            helper.join()
        self._thread.join()  # its last chunk, at most CHUNK bytes; the cores are free for it now
        if self._errors:
            raise CheckpointError(f"the checkpoint copy failed: {self._errors[0]}") from self._errors[0]
