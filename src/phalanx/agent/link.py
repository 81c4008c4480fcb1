"""The agent's background link to the master: heartbeats (with per-rank progress) and log shipping.

It runs on its own thread so that a slow stop of workers or a long rendezvous poll never delays a
heartbeat, and a master that is away (restarting) only makes it back off: the workers keep running.
Actions from heartbeat responses are queued for the supervisor's loop; worker log lines are shipped by a
second thread.

Each heartbeat asks the master to hold its answer for up to one interval: an action (a new round) then
arrives the moment the master decides it. The heartbeats travel on one long-lived HeartbeatStream (one
message each way per beat, the token checked once), and the master learns that this process died from the
stream closing instead of from a heartbeat timeout. Against a master without HeartbeatStream (UNIMPLEMENTED)
each beat is a Heartbeat call, held the same way, so that a call is nearly always in flight; the stream is
tried again after the master was unreachable (it may come back upgraded). A stream that fails, or whose
answer is late, is dropped and the next beat opens a new one: a restarted master gets a new stream exactly
as it gets new calls. beat_now() and leave() come from other threads and use a call of their own.
"""

from __future__ import annotations

import collections
import collections.abc
import contextlib
import logging
import queue
import random
import threading
import time
from collections.abc import Callable

from phalanx.agent.client import (
    HeartbeatStream,
    MasterClient,
    MasterUnavailableError,
    UnimplementedError,
    UnknownNodeError,
    backoff_s,
)
from phalanx.api.errors import PhalanxError
from phalanx.api.settings import LogSettings
from phalanx.api.v1 import master_pb2 as pb

log = logging.getLogger("phalanx.agent")

HEARTBEAT_TIMEOUT_S = 2.0  # how long an answer may take beyond the hold, on a good network
MAX_HEARTBEAT_SLACK_S = 16.0  # past this the master declared the node lost long ago (default timeout 10 s)
LEAVE_TIMEOUT_S = 2.0  # the last heartbeat of an exiting agent; the master finds out by the timeout anyway


def heartbeat_slack(round_trips: collections.abc.Iterable[float]) -> float:
    """How long a heartbeat's answer may take beyond the master's hold: three times the slowest recent
    round trip, at least :data:`HEARTBEAT_TIMEOUT_S`. A fixed deadline would give up on every answer of a
    network slower than it, and with them on every action they carry."""
    return min(MAX_HEARTBEAT_SLACK_S, max([HEARTBEAT_TIMEOUT_S, *(3.0 * rtt for rtt in round_trips)]))


class LogShipper:
    """Bounded, rate-limited queue of worker lines for ReportLogs. Lines over the rate are dropped and
    counted, so a worker printing in a tight loop cannot flood the master."""

    def __init__(self, settings: LogSettings, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._settings = settings
        self._clock = clock
        self._lock = threading.Lock()
        self._lines: collections.deque[pb.LogLine] = collections.deque()
        self._dropped = 0
        self._tokens = float(settings.max_lines_per_s)
        self._last = clock()

    def offer(self, *, rank: int, local_rank: int, stream: int, text: str) -> None:
        with self._lock:
            now = self._clock()
            rate = float(self._settings.max_lines_per_s)
            self._tokens = min(rate, self._tokens + (now - self._last) * rate)
            self._last = now
            if self._tokens < 1.0 or len(self._lines) >= 10 * self._settings.max_lines_per_s:
                self._dropped += 1
                return
            self._tokens -= 1.0
            data = text.encode()[: self._settings.max_line_bytes].decode(errors="ignore")
            self._lines.append(
                pb.LogLine(
                    rank=rank,
                    local_rank=local_rank,
                    stream=stream,  # type: ignore[arg-type]
                    text=data,
                    unix_ns=time.time_ns(),
                )
            )

    def take(self, limit: int = 1000) -> tuple[list[pb.LogLine], int]:
        with self._lock:
            batch = [self._lines.popleft() for _ in range(min(limit, len(self._lines)))]
            dropped, self._dropped = self._dropped, 0
            return batch, dropped

    def put_back(self, batch: list[pb.LogLine], dropped: int) -> None:
        with self._lock:
            self._lines.extendleft(reversed(batch))
            self._dropped += dropped


class Link(threading.Thread):
    """Heartbeats every ``interval_s`` with the snapshot the supervisor last published."""

    def __init__(
        self,
        *,
        client: MasterClient,
        node_id: str,
        incarnation: str,
        interval_s: float,
        shipper: LogShipper,
        reregister: Callable[[], None],
    ) -> None:
        super().__init__(daemon=True, name="phalanx-link")
        self._client = client
        self._node_id = node_id
        self._incarnation = incarnation
        self.interval_s = interval_s
        self._shipper = shipper
        self._reregister = reregister
        self._lock = threading.Lock()
        self._state: int = pb.NODE_STATE_IDLE
        self._round = 0
        self._ranks: list[pb.RankProgress] = []
        self._restart_count = 0
        self._stop = threading.Event()
        self.actions: queue.Queue[pb.Action] = queue.Queue()
        self.master_round = 0
        self.last_ok = time.monotonic()
        self._rng = random.Random()
        self._acked_seq = 0
        """The highest one-shot action seq received; sent back so the master stops repeating them."""
        self._round_trips: collections.deque[float] = collections.deque(maxlen=8)
        self.slack_s = HEARTBEAT_TIMEOUT_S
        self._stream: HeartbeatStream | None = None
        """The open HeartbeatStream, used by this thread only; None until the next beat opens one."""
        self.streaming = True
        """False while the master answered HeartbeatStream with UNIMPLEMENTED (an older master)."""

    def publish(
        self,
        *,
        state: int,
        round: int,
        ranks: list[pb.RankProgress] | None = None,
        restart_count: int | None = None,
    ) -> None:
        with self._lock:
            self._state, self._round = state, round
            if ranks is not None:
                self._ranks = ranks
            if restart_count is not None:
                self._restart_count = restart_count

    def stop(self) -> None:
        self._stop.set()

    def leave(self) -> None:
        """Stops heartbeating and says so in one last heartbeat (NODE_STATE_LEAVING): an agent that exits
        while no heartbeat of it is held would otherwise be counted on until the heartbeat timeout."""
        self.stop()
        with self._lock:
            self._state = pb.NODE_STATE_LEAVING
        with contextlib.suppress(PhalanxError):  # a master that cannot be told finds out by the timeout
            self._beat(wait_s=0.0, timeout_s=LEAVE_TIMEOUT_S)

    def forget_acks(self) -> None:
        """After registering again: a master that forgot this node numbers its actions afresh."""
        with self._lock:
            self._acked_seq = 0

    def beat_now(self) -> None:
        self._beat(wait_s=0.0)

    def _send(self, req: pb.HeartbeatRequest, timeout_s: float) -> pb.HeartbeatResponse:
        """One beat of this thread: on the stream (opened if none is), else as a call."""
        if self.streaming:
            if self._stream is None:
                self._stream = self._client.heartbeat_stream()
            try:
                return self._stream.beat(req, timeout_s)
            except UnimplementedError:
                self.streaming = False
                log.info("the master has no HeartbeatStream; sending each heartbeat as a call")
            finally:
                if self._stream.closed:  # failed: the next beat opens a new one
                    self._stream = None
        try:
            return self._client.heartbeat(req, timeout=timeout_s)
        except MasterUnavailableError:
            self.streaming = True  # the master may come back as one that streams
            raise

    def _beat(self, *, wait_s: float, timeout_s: float | None = None, stream: bool = False) -> None:
        with self._lock:
            req = pb.HeartbeatRequest(
                node_id=self._node_id,
                incarnation=self._incarnation,
                state=self._state,  # type: ignore[arg-type]
                round=self._round,
                ranks=list(self._ranks),
                restart_count=self._restart_count,
                sent_unix_ns=time.time_ns(),
                wait_s=wait_s,
                acked_seq=self._acked_seq,
            )
        sent = time.monotonic()
        try:
            timeout = timeout_s or wait_s + self.slack_s
            resp = self._send(req, timeout) if stream else self._client.heartbeat(req, timeout=timeout)
        except MasterUnavailableError as exc:
            if exc.late:  # the round trip took at least the slack: count it as that long
                self._round_trips.append(self.slack_s)
                self.slack_s = heartbeat_slack(self._round_trips)
            raise
        self.last_ok = time.monotonic()
        self._round_trips.append(max(0.0, self.last_ok - sent - resp.held_s))
        self.slack_s = heartbeat_slack(self._round_trips)
        self.master_round = resp.round
        with self._lock:  # beat_now() may race the heartbeat thread: each seq is queued once
            for action in resp.actions:
                if action.kind in (pb.ACTION_KIND_NONE, pb.ACTION_KIND_UNSPECIFIED):
                    continue
                if action.seq:
                    if action.seq <= self._acked_seq:
                        continue  # repeated because our ack had not reached the master yet
                    self._acked_seq = action.seq
                self.actions.put(action)

    def _ship(self) -> None:
        batch, dropped = self._shipper.take()
        if not batch and not dropped:
            return
        try:
            self._client.report_logs(
                pb.ReportLogsRequest(
                    node_id=self._node_id, incarnation=self._incarnation, lines=batch, dropped=dropped
                )
            )
        except MasterUnavailableError:
            self._shipper.put_back(batch, dropped)
            raise

    def _ship_loop(self) -> None:
        # Apart from the heartbeats, so that shipping never leaves a gap without a held heartbeat.
        while not self._stop.wait(self.interval_s):
            with contextlib.suppress(PhalanxError):  # put back; the heartbeats report an unreachable master
                self._ship()

    def run(self) -> None:
        threading.Thread(target=self._ship_loop, daemon=True, name="phalanx-logs").start()
        failures = 0
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self._beat(wait_s=self.interval_s, stream=True)
                failures = 0
                wait = self.interval_s - (time.monotonic() - started)  # a held heartbeat waited already
            except UnknownNodeError:
                if self._stop.is_set():
                    break  # the master forgot a node that is leaving: nothing to register again for
                log.warning("master does not know this incarnation; registering again")
                try:
                    self._reregister()
                except PhalanxError as exc:
                    log.warning("registering again failed: %s", exc)
                failures += 1
                wait = backoff_s(failures, rng=self._rng)
            except PhalanxError as exc:
                if self._stop.is_set():
                    break  # the agent closed the channel under its last held heartbeat: not a failure
                failures += 1
                wait = min(self.interval_s, backoff_s(failures, rng=self._rng))
                if failures in (1, 5) or failures % 20 == 0:
                    log.warning("heartbeat failed (%d in a row): %s", failures, exc)
            self._stop.wait(wait)
        if self._stream is not None:
            self._stream.close()
