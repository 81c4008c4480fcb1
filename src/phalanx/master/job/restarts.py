"""When a restart's event is emitted, and which events date a recovery: pure decisions over the job's
state, which the job's writer (:meth:`~phalanx.master.job.core.JobCore.event`) follows.

A restart's event waits (:func:`phalanx.diagnostics.rootcause.settled`) for the round's other failure
reports, so that it names the root cause even when the echo's node reports first; any event that must come
after it (the next round completing, the job ending) emits it first, so the log stays in order. Every event
also dates the recoveries (:class:`~phalanx.master.state.recovery.RecoveryTracker`).

The pending restart (:class:`~phalanx.master.state.jobstate.PendingRestart`) is durable
(:mod:`phalanx.master.state.snapshot`): a master killed while one waits leaves it
in its last saved state, and the restarted master emits it once, into its new log, before its own
``master_resumed`` (a non-holding event, so the same rule as above). One save holds both the cleared
pending restart and the event counter past its event, so an event the old master emitted and saved is not
restored; only one emitted in the milliseconds between the emission and its save is emitted again, with a
seq past the gap, as the state of that moment is lost too. The restored event does not wait for the round's
other reports: a later one naming a better cause revises it with a ``root_cause`` event, as after the
settling window.
"""

from __future__ import annotations

from phalanx.diagnostics import rootcause
from phalanx.master.state.events import EventKind
from phalanx.master.state.jobstate import JobState

__all__ = ["HOLDS_RESTART_EVENT", "dates_a_new_recovery", "settled"]

HOLDS_RESTART_EVENT: frozenset[EventKind] = frozenset({"failure", "root_cause", "round_open"})
"""Events that may come before a pending restart event (the round's other reports, the round it opened);
any other event (the next round completing, the job ending) emits it first, so the log stays in order."""


def settled(state: JobState, *, now: float) -> bool:
    """Whether the pending restart's event may be emitted now: the round's root cause is settled."""
    pending = state.pending_restart
    if pending is None:
        return False
    reported = {r.node_id for r in state.round_failures} if pending.round == state.round_number else set()
    members = state.round.node_ids if state.round is not None and pending.round == state.round_number else []
    return rootcause.settled(waited_s=now - pending.at, reported=reported, members=members)


def dates_a_new_recovery(state: JobState, kind: EventKind) -> bool:
    """Whether an event of ``kind`` starts a recovery of its own: a round opened after the first that is not
    a restart's own (a node lost, evicted or added), whose recovery is dated from here."""
    if kind != "round_open" or state.round is None:
        return False
    cur = state.recovery.current
    return cur is None or cur.reformed > 0
