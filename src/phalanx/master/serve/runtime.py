"""The master's executor: owns the job and carries out what its decisions need in the outside world.

One asyncio event loop runs everything; job methods are synchronous and never await, so no lock is
needed around the job. After every request and every tick, :meth:`Runtime.after` looks at the job's
version counters and

* wakes GetRendezvous long-polls when a round completed (``round_version``) and held heartbeats when
  some node may have a new action (``action_version``),
* hands the durable state to the saver task when it changed (``durable_version``): the saver writes the
  newest snapshot in a worker thread, at most every :data:`SAVE_GAP_S` unless someone waits for it, so a
  burst of changes costs a few writes, never one per change,
* and the publisher task sends the status to the :class:`~phalanx.master.store.stores.StatusSink` at most
  twice a second when it changed (``status_version``), and has the job follow the spec as the sink reads
  it (:meth:`~phalanx.master.job.liveness.Liveness.follow_spec`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time

from phalanx.api.errors import MasterFenced, StateStoreError
from phalanx.master.job import Job
from phalanx.master.serve.logstore import LogStore
from phalanx.master.serve.metrics import MasterMetrics
from phalanx.master.store.stores import StateStore, StatusSink

__all__ = ["Runtime"]

log = logging.getLogger("phalanx.master")

PUBLISH_INTERVAL_S = 0.5
# How long a COMPLETE answer waits for the round to be durable before going out anyway: a broken state
# store must not stop training, it only weakens what a master restart can recover.
SAVE_WAIT_S = 5.0
SAVE_GAP_S = 0.05
"""The least time between two saves nobody waits for: a burst of changes (a thousand nodes registering) is
written a few times, not once per change; a save someone waits for (a round before its COMPLETE answer)
goes at once."""
LAG_WINDOW_S = 10.0
FENCE_CHECK_S = 2.0
"""How often a master asks whether it still holds the job's state: a replaced master (its node stopped
answering, its process still running) stops within this of the replacement's claim."""
FENCE_LEASE_S = 60.0
"""A master that cannot tell whether it still holds the state for this long (cut off from the API server)
stops: its replacement may be running, and the kubelet restarts it if not."""


class Wakeup:
    """Coroutines waiting for the next change, each with a time limit, woken all at once. One future and
    one timer per waiter: every held heartbeat waits here, and ``asyncio.wait_for`` on an event would add a
    task, and a cancellation when the limit passes, to each."""

    def __init__(self) -> None:
        self._waiting: set[asyncio.Future[None]] = set()

    def wake(self) -> None:
        waiting, self._waiting = self._waiting, set()
        for future in waiting:
            if not future.done():
                future.set_result(None)

    async def wait(self, limit_s: float) -> None:
        """Returns at the next :meth:`wake`, or after ``limit_s`` seconds."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        self._waiting.add(future)
        timer = loop.call_later(limit_s, _resolve, future)
        try:
            await future
        finally:
            timer.cancel()
            self._waiting.discard(future)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class Runtime:
    def __init__(self, *, job: Job, logs: LogStore, store: StateStore, sink: StatusSink) -> None:
        self.job = job
        self.logs = logs
        self.store = store
        self.sink = sink
        self.metrics = MasterMetrics(
            job, logs, loop_lag=self.loop_lag_s, save_failures=lambda: self.save_failures
        )
        self._round_wakeup = Wakeup()
        self._seen_round = job.round_version
        self._action_wakeup = Wakeup()
        self._seen_actions = job.action_version
        self._dirty = asyncio.Event()
        self._urgent = asyncio.Event()
        """Someone waits for a save (:meth:`wait_saved`): the saver skips its gap."""
        # Saved at once, a resumed job too: resuming moved the event counter (and may have emitted a restored
        # restart), and a master killed again before its next change must not reuse those seqs or repeat it.
        self._saved_version = -1
        self._saved = asyncio.Condition()
        self._published = -1
        self._lags: collections.deque[tuple[float, float]] = collections.deque(maxlen=256)
        self.stopping = asyncio.Event()
        self.save_failures = 0
        """Saves of the durable state that failed (the previous state was kept), for /metrics."""
        self.fenced = ""
        """Why this master stopped for another (:meth:`fence`); it then writes nothing more."""

    @staticmethod
    def now() -> float:
        return time.time()

    def after(self) -> None:
        """Reacts to what the last job call changed (see the module docstring)."""
        state = self.job.state  # read directly: this runs after every request
        if state.round_version != self._seen_round:
            self._seen_round = state.round_version
            self._round_wakeup.wake()
        if state.action_version != self._seen_actions:
            self._seen_actions = state.action_version
            self._action_wakeup.wake()
        if state.durable_version != self._saved_version:
            self._dirty.set()

    async def round_changed(self, limit_s: float) -> None:
        """Returns when a round completes or the job ends, or after ``limit_s`` seconds."""
        await self._round_wakeup.wait(limit_s)

    async def actions_changed(self, limit_s: float) -> None:
        """Returns when some node may have a new action, or after ``limit_s`` seconds."""
        await self._action_wakeup.wait(limit_s)

    async def wait_saved(self, version: int) -> None:
        if self._saved_version < version:
            self._urgent.set()
        async with self._saved:
            try:
                await asyncio.wait_for(
                    self._saved.wait_for(lambda: self._saved_version >= version), SAVE_WAIT_S
                )
            except TimeoutError:
                log.warning("answering before the state store confirmed version %d", version)

    async def save_now(self) -> None:
        """Writes the current durable state (the saver's step, also used at shutdown)."""
        version = self.job.durable_version
        snapshot = self.job.durable()
        await asyncio.to_thread(self.store.save, snapshot)
        async with self._saved:
            self._saved_version = max(self._saved_version, version)
            self._saved.notify_all()

    async def saver(self) -> None:
        while not self.fenced:
            await self._dirty.wait()
            self._dirty.clear()
            if self.job.durable_version == self._saved_version:
                continue
            try:
                await self.save_now()
                if not self._urgent.is_set():
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._urgent.wait(), SAVE_GAP_S)
                self._urgent.clear()
            except MasterFenced as exc:
                self.step_down(str(exc))
                return
            except StateStoreError as exc:  # a full disk: the previous state is kept; say so, try again
                self.save_failures += 1
                log.error("%s; retrying in 1s", exc)
                await asyncio.sleep(1.0)
                self._dirty.set()
            except Exception:  # a failing store must not kill the master; retry with the next change
                self.save_failures += 1
                log.exception("saving the master state failed; retrying in 1s")
                await asyncio.sleep(1.0)
                self._dirty.set()

    async def ticker(self, interval_s: float) -> None:
        while True:
            self.job.tick(now=self.now())
            self.after()
            try:
                self.logs.flush()
            except OSError:
                log.exception("writing the job log failed")
            before = time.monotonic()
            await asyncio.sleep(interval_s)
            after = time.monotonic()
            self._lags.append((after, after - before - interval_s))

    def loop_lag_s(self, window_s: float = LAG_WINDOW_S) -> float:
        """Largest event-loop delay of the last ``window_s``: how late the master answers when busy."""
        since = time.monotonic() - window_s
        return max((lag for at, lag in self._lags if at >= since), default=0.0)

    async def fence(self) -> None:
        """Stops this master once another holds the job's state, or once it could not tell for
        :data:`FENCE_LEASE_S`: two masters of one job would each evict the nodes that talk to the other."""
        confirmed = time.monotonic()
        while True:
            await asyncio.sleep(FENCE_CHECK_S)
            try:
                held = await asyncio.to_thread(self.store.holds)
            except MasterFenced as exc:
                self.step_down(str(exc))
                return
            except Exception as exc:  # the API server's hiccup: the lease covers it
                if time.monotonic() - confirmed > FENCE_LEASE_S:
                    self.step_down(f"could not tell for {FENCE_LEASE_S:.0f} s whether it still holds the "
                                   f"job's state ({exc})")  # fmt: skip
                    return
                continue
            if not held:
                self.step_down("another master took over the job's state")
                return
            confirmed = time.monotonic()

    def step_down(self, why: str) -> None:
        if self.fenced:
            return
        log.error("%s: stopping, writing nothing more", why)
        self.fenced = why
        self.stopping.set()

    async def publisher(self) -> None:
        while not self.fenced:
            if self.job.status_version != self._published:
                self._published = self.job.status_version
                try:
                    await asyncio.to_thread(self.sink.publish, self.job.status())
                except Exception:
                    log.exception("publishing the job status failed")
            try:
                view = await asyncio.to_thread(self.sink.spec)
            except Exception:
                log.exception("reading the job's spec failed")
                view = None
            if view is not None:
                self.job.follow_spec(
                    suspend=view.suspend,
                    generation=view.generation,
                    scheduled_workers=view.scheduled_workers,
                    now=self.now(),
                )
                self.after()
            await asyncio.sleep(PUBLISH_INTERVAL_S)
