"""The job's writer, which every component of the job (:mod:`phalanx.master.job`) shares: versions, events,
one-shot actions, opening a round, evictions, finishing the job, and the views of its state.

A component that decides returns what to do as :mod:`phalanx.master.job.effects`, and :meth:`JobCore.apply`
carries them out,
in order: the one place where a decision changes the job's state.

A job can be *suspended* (the ElasticJob's ``spec.suspend``, see
:meth:`phalanx.master.job.liveness.Liveness.suspend`): the operator then deletes the worker Pods, each of
which
persists its newest in-memory checkpoint first. While suspended, a node that goes away (lost, disconnected,
or one the policy would evict) is forgotten, not evicted: its Pod was deleted on purpose, so it spends no
budget; no round completes and the min-nodes timeout does not run. On resume, a round whose members are
gone is opened again for the new Pods.

Pure: every method takes ``now`` and does no I/O (see :mod:`phalanx.master.job`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

from phalanx.api.elasticjob import FINISHED_PHASES, Phase
from phalanx.api.v1 import master_pb2 as pb
from phalanx.api.verdicts import Eviction
from phalanx.master.job import effects as fx
from phalanx.master.job import restarts
from phalanx.master.state.events import EventKind
from phalanx.master.state.jobstate import JobState
from phalanx.master.state.nodes import ALIVE, EVICTED, LOST, Node, absent

__all__ = ["EVENT_SEQ_GAP", "FINISHED", "JobCore", "action", "end_reason", "ending", "exit_action"]

log = logging.getLogger("phalanx.master")
rdzv_log = logging.getLogger("phalanx.rendezvous")
failure_log = logging.getLogger("phalanx.failures")

FINISHED = FINISHED_PHASES
EVENT_SEQ_GAP = 1000


def action(kind: int, **fields: Any) -> pb.Action:
    """An Action for an agent (``kind`` is an ``ACTION_KIND_*`` value)."""
    return pb.Action(kind=kind, **fields)  # type: ignore[arg-type]


def ending(phase: Phase, reason: str) -> str:
    """Why the job ended, as its agents are told."""
    return f"job {phase.lower()}: {reason}" if reason else f"job {phase.lower()}"


def end_reason(state: JobState) -> str:
    return ending(state.phase, state.reason)


def exit_action(state: JobState, node: Node, incarnation: str) -> pb.Action | None:
    """EXIT for a finished job, an evicted or lost node, or a replaced incarnation; None otherwise."""
    if state.finished:
        code = 0 if state.phase == Phase.SUCCEEDED else 1
        return action(pb.ACTION_KIND_EXIT, round=state.round_number, exit_code=code, reason=end_reason(state))
    if incarnation != node.incarnation:
        return action(pb.ACTION_KIND_EXIT, exit_code=1, reason="replaced by a newer incarnation of this node")
    if node.status != ALIVE:
        return action(pb.ACTION_KIND_EXIT, exit_code=1, reason=node.exit_reason or f"node {node.status}")
    return None


class JobCore:
    """The writer of one :class:`JobState`, which the components of the job share."""

    def __init__(self, state: JobState) -> None:
        self.state = state

    def apply(self, effects: Iterable[fx.Effect], *, now: float) -> None:
        """Carries out what a decision asked for, in order."""
        s = self.state
        for e in effects:
            match e:
                case fx.Emit():
                    self.event(
                        e.kind,
                        now=now,
                        node=e.node,
                        rank=e.rank,
                        round=e.round,
                        message=e.message,
                        log=e.log,
                        hang=e.hang,
                    )
                case fx.Tally():
                    counts = getattr(s.stats, e.counter)
                    counts[e.label] = counts.get(e.label, 0) + 1
                case fx.SeeNode():
                    s.nodes[e.node_id].last_seen = now
                case fx.NoteFailures():
                    s.round_failures.extend(e.records)
                case fx.SetRootCause():
                    s.root_cause = e.cause
                    if e.job_reason is not None:
                        s.reason = e.job_reason
                case fx.AmendRestart():
                    self._amend_restart(e)
                case fx.Restart():
                    s.restart_count += 1
                    s.recovery.start(now=now, failed=e.failed, step=s.max_step)
                case fx.HoldRestart():
                    self.emit_pending_restart()  # one still waiting from an earlier round goes first
                    s.pending_restart = e.pending
                case fx.SettleRestart():
                    self.settle_restart(now=now)
                case fx.OpenRound():
                    self.open_round(e.why, now=now)
                case fx.Evict():
                    self._evict(e, now=now)
                case fx.Finish():
                    self.finish(e.phase, e.reason, now=now)
                case fx.Push():
                    self.push(s.nodes[e.node_id], list(e.actions))
                case fx.AskStacks():
                    self._ask_stacks(e, now=now)
                case fx.KeepStacks():
                    self._keep_stacks(e)
                case fx.RecordHangAnalysis():
                    s.hang = None
                    s.last_hang_analysis = e.analysis
                case fx.ChargeHang():
                    s.hang_counts[e.node_id] = max(0, s.hang_counts.get(e.node_id, 0) + e.delta)
                case fx.Saved():
                    self.changed(durable=e.durable)

    def _amend_restart(self, e: fx.AmendRestart) -> None:
        pending, recovery = self.state.pending_restart, self.state.recovery.current
        if pending is None:
            return
        pending.node, pending.rank, pending.message = e.node, e.rank, e.message
        if recovery is not None and e.failed > 0:
            recovery.failed = min(e.failed, recovery.started)

    def _evict(self, e: fx.Evict, *, now: float) -> None:
        s = self.state
        node = s.nodes.get(e.node_id)
        if node is None:
            return
        was_member = e.node_id in s.members or (e.joiners_too and e.node_id in s.joiners)
        if self.request_eviction(node, kind=e.kind, reason=e.reason, now=now) and was_member:
            self.open_round(e.reopen_why, now=now)

    def _keep_stacks(self, e: fx.KeepStacks) -> None:
        s = self.state
        if s.hang is not None and s.hang.round == e.round:
            s.hang.stacks[e.node_id] = e.stacks
            return
        early_round, early = s.early_stacks
        s.early_stacks = (e.round, {**(early if early_round == e.round else {}), e.node_id: e.stacks})

    def _ask_stacks(self, e: fx.AskStacks, *, now: float) -> None:
        s, inquiry = self.state, e.inquiry
        if inquiry.charged:
            s.hang_counts[inquiry.charged] = s.hang_counts.get(inquiry.charged, 0) + 1
        s.early_stacks = (0, {})
        s.hang = inquiry
        for member in e.ask:
            self.push(s.nodes[member], [e.dump])
        self.event("hang", now=now, node=inquiry.charged or inquiry.node, message=e.message)

    # ------------------------------------------------------------------------------------------------
    # Views

    def absent(self, *, now: float) -> list[str]:
        """Live nodes whose agent is most likely gone (see :func:`phalanx.master.state.nodes.absent`); the
        grace is one heartbeat interval, within which a live agent whose connection broke heartbeats again."""
        return absent(self.state.nodes.values(), now=now, grace_s=self.state.settings.heartbeat.interval_s)

    def round_step(self) -> int:
        """The newest step a rank of the running round reported (-1: none yet). Not ``max_step``: after
        a restore from an older step, the job is behind it until the lost steps are trained again."""
        s = self.state
        top = -1
        for node_id in s.members:
            node = s.nodes.get(node_id)
            if node is not None and node.hb_round == s.round_number:
                for r in node.ranks:
                    top = max(top, r.step)
        return top

    # ------------------------------------------------------------------------------------------------
    # Bookkeeping

    def changed(self, *, durable: bool = False) -> None:
        self.state.status_version += 1
        if durable:
            self.state.durable_version += 1

    def push(self, node: Node, actions: list[pb.Action]) -> None:
        """Queues one-shot actions for ``node``'s heartbeat responses, each with a fresh seq; they are
        repeated until a heartbeat acknowledges them (see :meth:`Job.heartbeat`)."""
        for a in actions:
            self.state.action_seq += 1
            a.seq = self.state.action_seq
            node.pending.append(a)
        self.state.action_version += 1
        self.changed(durable=True)  # the seq counter is durable

    def event(
        self,
        kind: EventKind,
        *,
        now: float,
        node: str = "",
        rank: int = -1,
        round: int = -1,
        message: str = "",
        log: Callable[..., None] | None = None,
        hang: list[dict[str, Any]] | None = None,
    ) -> None:
        """Records an event. A restart event still waiting for the round's root cause goes first unless this
        one may come before it, and the event dates the recoveries (see :mod:`phalanx.master.job.restarts`).
        With ``log``
        (a logger's method, such as ``failure_log.warning``) the master's log says it too, in the event's
        words. ``hang``: a hang report's evidence per rank, which the timeline keeps with the failure (not
        durable)."""
        s = self.state
        if kind not in restarts.HOLDS_RESTART_EVENT:
            self.emit_pending_restart()
        if kind == "round_complete":
            s.recovery.reformed(now=now)
        elif restarts.dates_a_new_recovery(s, kind):
            s.recovery.start(now=now, failed=0.0, step=s.max_step)
        self.record_event(kind, now=now, node=node, rank=rank, round=round, message=message, hang=hang)
        if log is not None:
            extra: dict[str, Any] = {"round": self.state.round_number if round < 0 else round}
            if node:
                extra["node"] = node
            log("%s: %s", kind.replace("_", " "), message, extra=extra)

    def record_event(
        self,
        kind: EventKind,
        *,
        now: float,
        node: str = "",
        rank: int = -1,
        round: int = -1,
        message: str = "",
        hang: list[dict[str, Any]] | None = None,
    ) -> None:
        """Records an event as it is (no restart event goes first, no recovery is dated)."""
        s = self.state
        event = s.events.add(
            kind,
            now=now,
            node=node,
            rank=rank,
            round=s.round_number if round < 0 else round,
            message=message,
        )
        s.timeline.note_event(event, hang=hang)
        self.changed(durable=True)  # the event counter is durable (see EVENT_SEQ_GAP)

    def node(self, node_id: str, incarnation: str) -> Node:
        """The node's record; RequestError for an unknown node or incarnation."""
        return self.state.node(node_id, incarnation)

    def exitaction(self, node: Node, incarnation: str) -> pb.Action | None:
        return exit_action(self.state, node, incarnation)

    def end_reason(self) -> str:
        return end_reason(self.state)

    def settle_restart(self, *, now: float) -> None:
        """Emits the pending restart event once the round's root cause is settled."""
        if restarts.settled(self.state, now=now):
            self.emit_pending_restart()

    def emit_pending_restart(self) -> None:
        """The pending restart event, dated when the restart was decided."""
        s = self.state
        pending, s.pending_restart = s.pending_restart, None
        if pending is not None:
            self.record_event(
                "restart",
                now=pending.at,
                node=pending.node,
                rank=pending.rank,
                round=pending.round,
                message=pending.message,
            )

    def finish(self, phase: Phase, reason: str, *, now: float) -> None:
        s = self.state
        if s.finished:
            return
        s.phase = phase
        s.reason = reason
        s.round_open = False
        s.joiners.clear()
        if phase == Phase.SUCCEEDED:
            self.event("job_succeeded", now=now, message=reason, log=log.info)
        else:
            self.event("job_failed", now=now, message=reason, log=failure_log.error)
        s.round_version += 1
        s.action_version += 1
        self.changed(durable=True)

    def open_round(self, why: str, *, now: float) -> None:
        """Opens the next round: survivors get REJOIN in their next heartbeat response."""
        s = self.state
        if s.round_open or s.finished:
            return
        s.round_open = True
        s.opened_at = now
        if s.round is not None:
            s.phase = Phase.RESTARTING
        self.event("round_open", now=now, round=s.next_round, message=why, log=rdzv_log.info)
        s.action_version += 1
        self.changed(durable=True)

    def request_eviction(self, node: Node, *, kind: str, reason: str, now: float) -> bool:
        """Records an eviction request; False (and the job fails) when the budget is spent. A suspended job
        evicts nothing: it forgets the node and returns False (no new round either)."""
        s = self.state
        if s.suspended:
            self.forget(node, now=now, why=f"left the suspended job ({reason})")
            return False
        node.status = EVICTED if kind != "heartbeat_timeout" else LOST
        node.exit_reason = f"evicted: {reason}"
        s.action_version += 1  # its agent, if still there, is told to exit
        s.joiners.pop(node.node_id, None)
        if len(s.evictions) >= s.settings.restart.max_evictions:
            self.finish(
                Phase.FAILED,
                f"{reason}, and the eviction budget ({s.settings.restart.max_evictions}) is spent",
                now=now,
            )
            return False
        s.evictions.append(
            Eviction(node_id=node.node_id, machine=node.machine, reason=reason, kind=kind, requested_at=now)
        )
        s.stats.evictions[kind] = s.stats.evictions.get(kind, 0) + 1
        self.event("eviction_requested", now=now, node=node.node_id, message=reason, log=failure_log.warning)
        self.changed(durable=True)
        return True

    def evict_and_reopen(self, node: Node, *, kind: str, reason: str, why: str, now: float) -> bool:
        """:meth:`request_eviction`, then a new round when ``node`` was a member of the running one."""
        was_member = node.node_id in self.state.members
        if self.request_eviction(node, kind=kind, reason=reason, now=now):
            if was_member:
                self.open_round(why, now=now)
            return True
        return False

    def forget(self, node: Node, *, now: float, why: str) -> None:
        """Drops a node that left a suspended job. Its agent, if it is still there, is told it is not
        registered at its next request and registers again."""
        s = self.state
        s.nodes.pop(node.node_id, None)
        s.joiners.pop(node.node_id, None)
        s.completed.discard(node.node_id)
        self.event("node_left", now=now, node=node.node_id, message=why, log=log.info)
        self.settle_breakpoint(now=now)  # whoever still persists no longer waits for it

    def settle_breakpoint(self, *, now: float, answered: str = "") -> None:
        """Agrees on the breakpoint's step once every reachable member reported, and asks the nodes that
        persist another step to persist it (``answered`` learns it from its own response)."""
        s = self.state
        bp = s.breakpoint
        if bp is None or bp.step is not None:
            return
        gone = set(self.absent(now=now))
        reachable = [n.node_id for n in s.alive() if n.node_id not in gone]
        ask = bp.settle(reachable=reachable, committed=s.checkpoints.committed)
        if bp.step is None:
            return
        self.event(
            "checkpoint_breakpoint",
            now=now,
            round=bp.round,
            message=f"step {bp.step}: the newest every node of round {bp.round} holds in memory",
            log=log.info,
        )
        for node_id in ask:
            node = s.nodes.get(node_id)
            if node_id == answered or node is None or node.status != ALIVE:
                continue
            reason = f"persist step {bp.step}, the newest every node of round {bp.round} holds"
            persist = action(pb.ACTION_KIND_PERSIST_CHECKPOINT, step=bp.step, round=bp.round, reason=reason)
            self.push(node, [persist])
