"""The job's writer, the one place that changes the job's state (:mod:`phalanx.master.state`).

The components of the job (:mod:`phalanx.master.job`) read the state and decide; what they decided
reaches the state as :mod:`~phalanx.master.job.effects`, which :meth:`JobCore.apply` carries out in order:
events, one-shot actions, rounds opened and completed, evictions, the end of the job, and what requests
tell of the nodes. ``tests/master/test_one_writer.py`` holds every component to it.

A job can be *suspended* (the ElasticJob's ``spec.suspend``, see
:meth:`phalanx.master.job.liveness.Liveness.suspend`): the operator then deletes the worker Pods, each of
which persists its newest in-memory checkpoint first. While suspended, a node that goes away (lost,
disconnected, or one the policy would evict) is forgotten, not evicted: its Pod was deleted on purpose, so
it spends no budget; no round completes and the min-nodes timeout does not run. On resume, a round whose
members are gone is opened again for the new Pods.

Every method takes ``now`` and does no I/O (see :mod:`phalanx.master.job`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

from phalanx.api.elasticjob import FINISHED_PHASES, Phase
from phalanx.api.v1 import master_pb2 as pb
from phalanx.api.verdicts import Eviction
from phalanx.master.decide import rendezvous as rdzv
from phalanx.master.job import effects as fx
from phalanx.master.job import restarts
from phalanx.master.job.answers import action
from phalanx.master.state.beat import BeatRanks
from phalanx.master.state.breakpoints import Breakpoint
from phalanx.master.state.events import EventKind
from phalanx.master.state.jobstate import JobState
from phalanx.master.state.nodes import ALIVE, EVICTED, LOST, Node

__all__ = ["FINISHED", "JobCore"]

log = logging.getLogger("phalanx.master")
rdzv_log = logging.getLogger("phalanx.rendezvous")
failure_log = logging.getLogger("phalanx.failures")

FINISHED = FINISHED_PHASES

LOSS_KINDS = frozenset({"heartbeat_timeout", "connection_closed"})
"""Evictions of a node whose agent is gone (its status becomes ``lost``), not taken out for what it did."""


class JobCore:
    """The writer of one :class:`JobState`, which the components of the job share."""

    def __init__(self, state: JobState) -> None:
        self.state = state

    def apply(self, effects: Iterable[fx.Effect], *, now: float) -> None:
        """Carries out what a decision asked for, in order."""
        s = self.state
        for e in effects:
            match e:  # every heartbeat's two effects first: each case before a match is an isinstance call
                case fx.Beat():
                    self._beat(e.req, e.ranks, heard=e.heard, now=now)
                case fx.Answered():
                    node = s.nodes[e.node_id]
                    node.last_seen = max(node.last_seen, now)  # connected all along while held
                    if node.pending:
                        node.sent_seq = max(node.sent_seq, node.pending[-1].seq)
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
                    self._tally(e)
                case fx.SeeNode():
                    node = s.nodes[e.node_id]
                    node.last_seen = now
                    if e.agent_version is not None:
                        node.agent_version = e.agent_version
                    if e.nproc is not None:
                        node.nproc = e.nproc
                case fx.Disconnected():
                    s.nodes[e.node_id].disconnected_at = now
                case fx.DropNodes():
                    for node_id in e.node_ids:
                        del s.nodes[node_id]
                case fx.AddNode():
                    s.nodes[e.node.node_id] = e.node
                    if e.replaces:
                        s.joiners.pop(e.node.node_id, None)
                case fx.Join():
                    s.joiners[e.joiner.node_id] = e.joiner
                case fx.CompleteRound():
                    self._complete_round(e.round, now=now)
                case fx.Completed():
                    s.completed.add(e.node_id)
                case fx.Scheduled():
                    s.scheduled_workers = e.workers
                case fx.SpecGeneration():
                    if e.generation != s.spec_generation:
                        s.spec_generation = e.generation
                        self.changed()  # published: the operator waits for the generation it acts on
                case fx.Suspend():
                    s.suspended = e.value
                    s.action_version += 1
                    self.changed(durable=True)
                case fx.MinNodesClock():
                    s.below_min_since = e.since
                case fx.Forget():
                    self.forget(s.nodes[e.node_id], now=now, why=e.why)
                case fx.LeaveOut():
                    node = s.nodes[e.node_id]
                    node.absence_handled = node.disconnected_at
                    s.joiners.pop(e.node_id, None)
                case fx.SettleBreakpoint():
                    self.settle_breakpoint(now=now, answered=e.answered)
                case fx.Persisted():
                    s.checkpoints.persisted(step=e.step, ranks=e.ranks, world_size=e.world_size)
                case fx.HeldInMemory():
                    node = s.nodes[e.node_id]
                    node.memory_checkpoint_step = max(node.memory_checkpoint_step, e.step)
                case fx.BreakpointReport():
                    self._breakpoint_report(e)
                case fx.NextProbe():
                    s.next_probe += 1
                case fx.Probed():
                    s.nodes[e.node_id].probes[e.kind] = list(e.results)
                case fx.DropProbeActions():
                    self._drop_probe_actions(e)
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

    def _tally(self, e: fx.Tally) -> None:
        stats = self.state.stats
        if e.label:
            counts: dict[str, int] = getattr(stats, e.counter)
            counts[e.label] = counts.get(e.label, 0) + 1
        else:
            setattr(stats, e.counter, getattr(stats, e.counter) + 1)

    def _beat(self, req: pb.HeartbeatRequest, ranks: BeatRanks, *, heard: bool, now: float) -> None:
        """What a heartbeat tells the job: the node's own state, the ranks' progress and activities, the
        job's newest step, the recovery's dates and the timeline; a node that must leave only counts."""
        s = self.state
        s.stats.heartbeats += 1
        if not heard:
            return
        node = s.nodes[req.node_id]
        s.stats.actions_repeated += node.heard(req, ranks.progress, now=now)
        if not ranks.progress:
            return
        activities = s.activities
        for rank, activity in ranks.activities:
            activities[rank] = (req.node_id, req.round, activity)
        top = ranks.top
        if top > s.max_step:
            s.max_step = top
            self.changed()
        if req.round == s.round_number and s.recovery.stepped(now=now, step=top):
            self.changed(durable=True)  # a recovery resumed or caught up: its dates are durable
        s.timeline.observe(req.node_id, ranks, now=now)

    def _complete_round(self, new: rdzv.Round, *, now: float) -> None:
        s = self.state
        s.round = new
        s.next_round = new.number + 1
        s.round_open = False
        s.joiners.clear()  # those left out get NOT_MEMBER and join the next round
        if s.breakpoint is not None and s.breakpoint.step is None:
            # Every node that saves at a breakpoint reports before it joins: whoever has not reported by now
            # regrouped in place or is gone, and the old snapshots will not stay in memory for long.
            s.breakpoint = None
        s.completed = set()
        s.round_failures = []
        s.phase = Phase.RUNNING
        self.event(
            "round_complete",
            now=now,
            round=new.number,
            message=f"world size {new.world_size}, members {', '.join(new.node_ids)}",
            log=rdzv_log.info,
        )
        s.round_version += 1
        self.changed(durable=True)

    def _breakpoint_report(self, e: fx.BreakpointReport) -> None:
        s = self.state
        bp = s.breakpoint
        if bp is None or bp.round < e.round:
            bp = s.breakpoint = Breakpoint(round=e.round, members=frozenset(s.members))
        bp.report(e.node_id, held=e.held, persisting=e.persisting)

    def _drop_probe_actions(self, e: fx.DropProbeActions) -> None:
        for node_id in e.node_ids:
            node = self.state.nodes.get(node_id)
            if node is not None:  # RUN_PROBE not yet delivered would start a probe nobody waits for
                node.pending[:] = [
                    a
                    for a in node.pending
                    if not (a.kind == pb.ACTION_KIND_RUN_PROBE and a.probe_round == e.probe_round)
                ]

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
        With ``log`` (a logger's method, such as ``failure_log.warning``) the master's log says it too, in the
        event's words. ``hang``: a hang report's evidence per rank, which the timeline keeps with the failure
        (not
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
        self.changed(durable=True)  # the event counter is durable (see snapshot.EVENT_SEQ_GAP)

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
        node.status = LOST if kind in LOSS_KINDS else EVICTED
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
        gone = set(s.absent(now=now))
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
