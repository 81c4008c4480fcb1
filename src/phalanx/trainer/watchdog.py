"""Aborting a step stuck on a lost peer, for backends whose collectives do not fail by themselves.

gloo fails a collective as soon as a peer's sockets close. NCCL does not: a collective with a dead peer
waits for the group's timeout (``ElasticConfig.collective_timeout_s``), and the trainer would regroup only
after it. While a step is in flight, :class:`RoundWatch` checks the round file on a thread; when the agent
writes a new round (the master saw a node go) it aborts the process groups (``ncclCommAbort``), so the
collective raises at once and the trainer takes its usual failed-step path into the new round.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from types import TracebackType

import torch.distributed as dist

POLL_S = 0.05


def abort_all_groups() -> None:
    """Aborts every process group of this process (pending collectives raise); safe to call twice."""
    with contextlib.suppress(RuntimeError, ValueError, AssertionError, dist.DistError):
        dist.distributed_c10d._abort_process_group()


class RoundWatch:
    """``with watch:`` around a step: if ``changed()`` turns true during it, ``abort()`` is called once."""

    def __init__(
        self, *, changed: Callable[[], bool], abort: Callable[[], None], poll_s: float = POLL_S
    ) -> None:
        self._changed = changed
        self._abort = abort
        self._poll_s = poll_s
        self._in_step = threading.Event()
        self._closed = threading.Event()
        self._lock = threading.Lock()  # a step never ends between the check and the abort
        self.aborted = 0
        """How many steps this watch aborted."""
        self._thread = threading.Thread(target=self._run, name="phalanx-round-watch", daemon=True)
        self._thread.start()

    def __enter__(self) -> RoundWatch:
        self._in_step.set()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        with self._lock:
            self._in_step.clear()

    def _run(self) -> None:
        while not self._closed.is_set():
            if not self._in_step.wait(self._poll_s):
                continue
            with self._lock:
                if self._in_step.is_set() and self._changed():
                    self._abort()
                    self.aborted += 1
                    self._in_step.clear()  # one abort per step
            self._closed.wait(self._poll_s)

    def close(self) -> None:
        self._closed.set()
        self._thread.join()
