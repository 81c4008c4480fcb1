"""The job's bookkeeping, which every room of the job (:mod:`phalanx.master.job`) shares: versions, events,
one-shot actions, opening a round, evictions, finishing the job, and the views of its state.

A job can be *suspended* (the ElasticJob's ``spec.suspend``, see
:meth:`phalanx.master.liveness.Liveness.suspend`): the operator then deletes the worker Pods, each of which
persists its newest in-memory checkpoint first. While suspended, a node that goes away (lost, disconnected,
or one the policy would evict) is forgotten, not evicted: its Pod was deleted on purpose, so it spends no
budget; no round completes and the min-nodes timeout does not run. On resume, a round whose members are
gone is opened again for the new Pods.

Pure: every method takes ``now`` and does no I/O (see :mod:`phalanx.master.job`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from phalanx.api.elasticjob import FINISHED_PHASES, Phase
from phalanx.api.v1 import master_pb2 as pb
from phalanx.api.verdicts import Eviction
from phalanx.master.errors import RequestError
from phalanx.master.events import EventKind
from phalanx.master.jobstate import JobState
from phalanx.master.membership import ALIVE, EVICTED, LOST, Node, absent

__all__ = ["EVENT_SEQ_GAP", "FINISHED", "JobCore", "action"]

log = logging.getLogger("phalanx.master")
rdzv_log = logging.getLogger("phalanx.rendezvous")
failure_log = logging.getLogger("phalanx.failures")

FINISHED = FINISHED_PHASES
EVENT_SEQ_GAP = 1000


def action(kind: int, **fields: Any) -> pb.Action:
    """An Action for an agent (``kind`` is an ``ACTION_KIND_*`` value)."""
    return pb.Action(kind=kind, **fields)  # type: ignore[arg-type]


class JobCore:
    """The bookkeeping over one :class:`JobState` that the rooms of the job share."""

    def __init__(self, state: JobState) -> None:
        self.state = state
        self.before_event: Callable[[EventKind, float], None] | None = None
        """Called with (kind, now) before each event is recorded (the restart room holds its event back
        and dates recoveries with it)."""

    # ------------------------------------------------------------------------------------------------
    # Views

    def absent(self, *, now: float) -> list[str]:
        """Live nodes whose agent is most likely gone (see :func:`phalanx.master.membership.absent`); the
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
        """Records an event, after :attr:`before_event` had its say. With ``log`` (a logger's method, such
        as ``failure_log.warning``) the master's log says it too, in the event's words. ``hang``: a hang
        report's evidence per rank, which the timeline keeps with the failure (not durable)."""
        if self.before_event is not None:
            self.before_event(kind, now)
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
        """Records an event as it is (no :attr:`before_event`)."""
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
        node = self.state.nodes.get(node_id)
        if node is None:
            raise RequestError(
                f"node {node_id!r} is not registered; call RegisterNode first", code="not_found"
            )
        if node.incarnation != incarnation and incarnation not in node.old_incarnations:
            raise RequestError(f"unknown incarnation {incarnation!r} of node {node_id!r}")
        return node

    def exitaction(self, node: Node, incarnation: str) -> pb.Action | None:
        """EXIT for a finished job, an evicted or lost node, or a replaced incarnation; None otherwise."""
        s = self.state
        if s.finished:
            code = 0 if s.phase == Phase.SUCCEEDED else 1
            return action(pb.ACTION_KIND_EXIT, round=s.round_number, exit_code=code, reason=self.end_reason())
        if incarnation != node.incarnation:
            return action(
                pb.ACTION_KIND_EXIT, exit_code=1, reason="replaced by a newer incarnation of this node"
            )
        if node.status != ALIVE:
            return action(pb.ACTION_KIND_EXIT, exit_code=1, reason=node.exit_reason or f"node {node.status}")
        return None

    def end_reason(self) -> str:
        s = self.state
        return f"job {s.phase.lower()}: {s.reason}" if s.reason else f"job {s.phase.lower()}"

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
