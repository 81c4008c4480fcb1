"""The job's event log: what happened, in order, for ``/v1/events`` and the job summary.

Every event has a ``seq`` that increases by one per event (so a poller asks for ``since=<last seq>`` and
misses nothing while the log still holds it), the wall-clock ``unix`` time, a ``kind`` (see
:data:`KINDS`), and ``node``, ``rank``, ``round`` and ``message``. The log keeps the newest
``capacity`` events in memory; it is not durable: a restarted master starts a new log whose ``seq``
continues from the saved counter plus a gap (events after the last save died with the old master), so
``seq`` only ever grows and a poller never sees a number twice.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Literal, get_args

from phalanx.api import views

__all__ = ["KINDS", "Event", "EventKind", "EventLog"]

MAX_MESSAGE = 2000

EventKind = Literal[
    "job_started",
    "master_resumed",
    "node_registered",
    "node_replaced",
    "node_joined",
    "round_open",
    "round_complete",
    "node_disconnected",
    "node_lost",
    "failure",
    "restart",
    "root_cause",
    "eviction_requested",
    "hang",
    "hang_analysis",
    "checkpoint_breakpoint",
    "checkpoint_committed",
    "checkpoint_failed",
    "node_completed",
    "job_succeeded",
    "job_failed",
    "probe_started",
    "probe_finished",
    "probe_failed",
    "straggler",
    "slow_steps",
    "job_suspended",
    "job_resumed",
    "node_left",
]
"""What an event says happened: a typo is a type error (mypy), not an event no poller filters on."""

KINDS: tuple[EventKind, ...] = get_args(EventKind)


@dataclass(frozen=True)
class Event:
    seq: int
    unix: float
    kind: EventKind
    node: str
    rank: int
    round: int
    message: str

    def view(self) -> views.EventView:
        return views.EventView(
            seq=self.seq, unix=self.unix, kind=self.kind, node=self.node, rank=self.rank, round=self.round,
            message=self.message,
        )  # fmt: skip


class EventLog:
    """A bounded, ordered log of events."""

    def __init__(self, *, capacity: int = 20_000, first_seq: int = 1) -> None:
        self._events: deque[Event] = deque(maxlen=capacity)
        self._next = first_seq

    @property
    def next_seq(self) -> int:
        return self._next

    def add(
        self,
        kind: EventKind,
        *,
        now: float,
        node: str = "",
        rank: int = -1,
        round: int = 0,
        message: str = "",
    ) -> Event:
        # Messages carry agent-supplied text (errors, paths): cap them so the log's memory stays bounded.
        event = Event(
            seq=self._next,
            unix=now,
            kind=kind,
            node=node,
            rank=rank,
            round=round,
            message=message[:MAX_MESSAGE],
        )
        self._next += 1
        self._events.append(event)
        return event

    def since(self, seq: int, *, limit: int = 1000) -> list[Event]:
        """Events with a ``seq`` above ``seq``, oldest first, at most ``limit``."""
        if not self._events or seq >= self._events[-1].seq:
            return []
        start = max(0, seq - self._events[0].seq + 1)
        out = []
        for i in range(start, len(self._events)):
            out.append(self._events[i])
            if len(out) >= limit:
                break
        return out

    def of_kind(self, kind: EventKind) -> list[Event]:
        return [e for e in self._events if e.kind == kind]
