"""Copying a state's tensors into a mapped slot: on the training thread, or behind the next step.

:func:`copy_now` blocks the caller for the copy, spread over ``threads`` of torch's intra-op pool.
:class:`BackgroundCopy` returns at once and copies on threads of its own while training runs the next
forward and backward (CheckFreq's pipelined snapshot): the caller must not change a saved tensor until
:meth:`BackgroundCopy.wait` returned, i.e. it waits before the optimizer step. Host tensors are copied by
``memmove`` through ctypes, which releases the GIL and, unlike a torch copy on a second thread, does not
start a second intra-op thread team beside the one the training step uses. Device tensors are copied on a
side CUDA stream that first waits for the work queued before the save, so the copy engine moves them
while the compute engines run the next step.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable

import torch

from phalanx.api.errors import CheckpointError

Pair = tuple[torch.Tensor, torch.Tensor]  # (destination view in the slot, source tensor)
Span = tuple[int, int, int]  # (pair index, byte offset in the tensor, bytes)


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


def split(sizes: list[int], parts: int) -> list[list[Span]]:
    """Splits the byte ranges of tensors of ``sizes`` bytes into ``parts`` runs of (nearly) equal bytes,
    cutting a tensor where a run ends; empty runs are dropped."""
    total = sum(sizes)
    parts = max(1, min(parts, total or 1))
    per = -(-total // parts)
    runs: list[list[Span]] = [[] for _ in range(parts)]
    run, room = 0, per
    for index, size in enumerate(sizes):
        offset = 0
        while offset < size:
            take = min(size - offset, room)
            runs[run].append((index, offset, take))
            offset += take
            room -= take
            if room == 0 and run < parts - 1:
                run, room = run + 1, per
    return [r for r in runs if r]


class BackgroundCopy:
    """One save's copy, running behind training; ``on_done`` runs on the copy's thread once every byte is
    in place (it marks the snapshot complete), never after a failure."""

    def __init__(self, pairs: list[Pair], *, threads: int, on_done: Callable[[], None]) -> None:
        self._on_done = on_done
        self._error: BaseException | None = None
        self.copy_s = 0.0
        host = [(d, s) for d, s in pairs if not s.is_cuda and s.is_contiguous() and d.is_contiguous()]
        self._other = [(d, s) for d, s in pairs if s.is_cuda or not (s.is_contiguous() and d.is_contiguous())]
        self._host = host
        self._runs = split([s.numel() * s.element_size() for _, s in host], threads)
        self._ready: torch.cuda.Event | None = None
        if any(s.is_cuda for _, s in self._other):
            # The side stream must not read a tensor before the kernels queued so far have written it.
            self._ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
            self._ready.record()
        self._thread = threading.Thread(target=self._run, name="phalanx-ckpt-copy", daemon=True)
        self._thread.start()

    def _memmove(self, run: list[Span]) -> None:
        for index, offset, length in run:
            dst, src = self._host[index]
            ctypes.memmove(dst.data_ptr() + offset, src.data_ptr() + offset, length)

    def _copy_other(self) -> None:
        if self._ready is None:
            for dst, src in self._other:
                dst.copy_(src)
            return
        stream = torch.cuda.Stream(device=self._other[0][1].device)  # type: ignore[no-untyped-call]
        stream.wait_event(self._ready)
        with torch.cuda.stream(stream):
            for dst, src in self._other:
                dst.copy_(src, non_blocking=src.is_cuda)
        stream.synchronize()

    def _run(self) -> None:
        started = time.perf_counter()
        errors: list[BaseException] = []

        def guarded(fn: Callable[[], None]) -> None:
            try:
                fn()
            except BaseException as exc:  # reported by wait(); the snapshot stays incomplete
                errors.append(exc)

        helpers = [
            threading.Thread(target=guarded, args=(lambda r=run: self._memmove(r),), name="phalanx-ckpt-copy")
            for run in self._runs[1:]
        ]
        for helper in helpers:
            helper.start()
        if self._runs:
            guarded(lambda: self._memmove(self._runs[0]))
        if self._other:
            guarded(self._copy_other)
        for helper in helpers:
            helper.join()
        self.copy_s = time.perf_counter() - started
        if errors:
            self._error = errors[0]
            return
        guarded(self._on_done)
        if errors:
            self._error = errors[0]

    def done(self) -> bool:
        """Whether the copy has finished (successfully or not)."""
        return not self._thread.is_alive()

    def wait(self) -> None:
        """Returns once the copy is complete; raises CheckpointError if it failed."""
        self._thread.join()
        if self._error is not None:
            raise CheckpointError(f"the checkpoint copy failed: {self._error}") from self._error
