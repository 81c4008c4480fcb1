"""The job's room for restart events and recovery dating.

A restart's event waits (:func:`phalanx.diagnostics.rootcause.settled`) for the round's other failure
reports, so that it names the root cause even when the echo's node reports first; any event that must come
after it (the next round completing, the job ending) emits it first, so the log stays in order. Every event
also passes here to date the recoveries (:class:`~phalanx.master.recovery.RecoveryTracker`).

The pending restart is durable (:mod:`phalanx.master.snapshot`): a master killed while one waits leaves it
in its last saved state, and the restarted master emits it once, into its new log, before its own
``master_resumed`` (a non-holding event, so the same rule as above). One save holds both the cleared
pending restart and the event counter past its event, so an event the old master emitted and saved is not
restored; only one emitted in the milliseconds between the emission and its save is emitted again, with a
seq past the gap, as the state of that moment is lost too. The restored event does not wait for the round's
other reports: a later one naming a better cause revises it with a ``root_cause`` event, as after the
settling window.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

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

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, saved: Mapping[str, Any]) -> PendingRestart:
        """Raises KeyError, TypeError or ValueError for a malformed one."""
        return cls(
            round=int(saved["round"]),
            at=float(saved["at"]),
            node=str(saved["node"]),
            rank=int(saved["rank"]),
            message=str(saved["message"]),
        )


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
