"""The job's room for restart events and recovery dating.

A restart's event waits (:func:`phalanx.diagnostics.rootcause.settled`) for the round's other failure
reports, so that it names the root cause even when the echo's node reports first; any event that must come
after it (the next round completing, the job ending) emits it first, so the log stays in order. Every event
also passes here to date the recoveries (:class:`~phalanx.master.recovery.RecoveryTracker`).
"""

from __future__ import annotations

from dataclasses import dataclass

from phalanx.diagnostics import rootcause
from phalanx.master.core import JobCore

__all__ = ["HOLDS_RESTART_EVENT", "PendingRestart", "Restarts"]

HOLDS_RESTART_EVENT = frozenset({"failure", "root_cause", "round_open"})
"""Events that may come before a pending restart event (the round's other reports, the round it opened);
any other event (the next round completing, the job ending) emits it first, so the log stays in order."""


@dataclass
class PendingRestart:
    """A restart done and its event not yet emitted: it waits (:func:`rootcause.settled`) for the round's
    other reports, so that it names the root cause even when the echo's node reports first."""

    round: int
    at: float
    node: str
    rank: int
    message: str


class Restarts:
    """The pending restart event; hooks itself into the core's events (:attr:`JobCore.before_event`)."""

    def __init__(self, core: JobCore) -> None:
        self.core = core
        self.state = core.state
        self.pending: PendingRestart | None = None
        core.before_event = self.before_event

    def before_event(self, kind: str, now: float) -> None:
        """Emits the pending restart before an event that must follow it, and dates the recoveries."""
        if kind not in HOLDS_RESTART_EVENT:
            self.emit()
        recovery = self.state.recovery
        if kind == "round_complete":
            recovery.reformed(now=now)
        elif kind == "round_open" and self.state.round is not None:
            cur = recovery.current
            if cur is None or cur.reformed > 0:  # not a restart's own round: a node lost, evicted, added
                recovery.start(now=now, failed=0.0, step=self.state.max_step)

    def settle(self, *, now: float) -> None:
        """Emits the pending restart event once the round's root cause is settled."""
        pending = self.pending
        if pending is None:
            return
        s = self.state
        reported = {r.node_id for r in s.round_failures} if pending.round == s.round_number else set()
        members = s.round.node_ids if s.round is not None and pending.round == s.round_number else []
        if rootcause.settled(waited_s=now - pending.at, reported=reported, members=members):
            self.emit()

    def emit(self) -> None:
        """The pending restart event, dated when the restart was decided."""
        pending, self.pending = self.pending, None
        if pending is not None:
            self.core.record_event(
                "restart",
                now=pending.at,
                node=pending.node,
                rank=pending.rank,
                round=pending.round,
                message=pending.message,
            )
