"""A training process's persist requests (torch-free): :class:`PersistQueue`.

Requests go out to the host from a thread of their own, so a host that hangs never stalls training; what
became of each is kept until :meth:`PersistQueue.wait`: refused by the host, taken by it, or taken by a
host that went away before it confirmed them (lost: its replacement adopted the memory, not the queue).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from phalanx.api.errors import CheckpointError, PersistError
from phalanx.checkpoint import messages, shm
from phalanx.checkpoint.connection import HostConnection

MAX_PENDING_STEPS = 1000  # persisted steps remembered between waits, to tell which a lost host took along


class PersistQueue:
    """The persists of ``rank`` on its way to the host of ``connection``, and what they became.

    ``unconfirmed(steps)`` says which of ``steps`` no committed step on storage covers: a lost host's steps
    that are covered were persisted, or superseded, anyway."""

    def __init__(
        self, *, rank: int, connection: HostConnection, unconfirmed: Callable[[list[int]], list[int]]
    ) -> None:
        self.rank = rank
        self._connection = connection
        self._unconfirmed = unconfirmed
        self._lock = threading.Lock()
        self._persisting: dict[int, int] = {}  # step -> pid of the host that took it (0: not sent yet)
        self._lost: list[int] = []  # steps taken by a host that went away before it confirmed them
        self._refused: list[str] = []  # persist requests the host refused or could not take
        self._outbox: queue.Queue[tuple[int, shm.Segment | None] | None] = queue.Queue()
        self._unsent = 0
        self._sent = threading.Condition(self._lock)
        self._sender: threading.Thread | None = None

    def put(self, step: int, pinned: shm.Segment | None) -> None:
        """Sends the persist of ``step`` (whose slot ``pinned`` the caller pinned, None when none) from the
        sender thread; raises the requests refused so far."""
        with self._lock:
            self._persisting[step] = 0
            for old in list(self._persisting)[:-MAX_PENDING_STEPS]:  # a job that never waits
                del self._persisting[old]
            self._unsent += 1
        self._outbox.put((step, pinned))
        if self._sender is None:
            self._sender = threading.Thread(target=self._send, name="phalanx-ckpt-persist", daemon=True)
            self._sender.start()
        self.raise_refused()

    def _send(self) -> None:
        while True:
            item = self._outbox.get()
            if item is None:
                return
            step, pinned = item
            try:
                reply = self._connection.call(
                    messages.Persist(rank=self.rank, step=step), timeout_s=self._connection.call_limit_s
                )
            except CheckpointError as exc:
                reply = {"ok": False, "error": str(exc)}
            with self._lock:
                if reply.get("ok"):
                    if step in self._persisting:
                        self._persisting[step] = self._connection.pid
                else:
                    self._persisting.pop(step, None)
                    self._refused.append(f"step {step} ({reply.get('error')})")
                    if pinned is not None:
                        header = pinned.header()
                        if header.step == step and header.pin == shm.PIN_QUEUED:
                            shm.set_pin(pinned.buf, 0)
                self._unsent -= 1
                self._sent.notify_all()

    def host_met(self, pid: int) -> None:
        """Persists queued on a host that has since been replaced are lost: the new host adopted the memory,
        not the old one's queue."""
        with self._lock:
            gone = [step for step, by in self._persisting.items() if by and by != pid]
            for step in gone:
                del self._persisting[step]
        if gone:
            unconfirmed = self._unconfirmed(gone)
            with self._lock:
                self._lost += unconfirmed

    def raise_refused(self) -> None:
        """Raises PersistError naming the requests the host refused or could not take since the last call."""
        with self._lock:
            refused, self._refused = self._refused, []
        if refused:
            raise PersistError(
                f"the checkpoint host did not take the persist of {'; '.join(refused)}; those snapshots "
                "stay in memory"
            )

    def wait(self, *, timeout_s: float | None = None) -> list[dict[str, Any]]:
        """See :meth:`phalanx.checkpoint.engine.Checkpointer.wait`."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._lock:
            while self._unsent:  # each request is answered, or refused, within call_limit_s
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise PersistError(f"{self._unsent} persist requests were not sent in {timeout_s}s")
                self._sent.wait(left)
            pending = bool(self._persisting)
        self.raise_refused()
        reply: messages.Message = {"ok": True, "results": []}
        if pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            request = messages.Wait(rank=self.rank, step=None, timeout=left)
            limit = None if left is None else left + self._connection.call_limit_s
            try:
                reply = self._connection.call(request, timeout_s=limit)
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
        return messages.Waited.from_dict(reply).results

    def close(self) -> None:
        """Stops the sender thread once the requests before it are sent (each within the call limit)."""
        if self._sender is not None:
            self._outbox.put(None)
            self._sender.join(timeout=self._connection.call_limit_s + 1.0)
            self._sender = None
