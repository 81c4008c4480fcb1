"""The job's state, its bookkeeping and everything that happens with time (heartbeat timeouts, last
calls, hang-analysis and min-nodes timeouts, absent nodes). :class:`phalanx.master.job.Job` adds the agent
requests.

A job can be *suspended* (the ElasticJob's ``spec.suspend``, see :meth:`JobCore.suspend`): the operator
then deletes the worker Pods, each of which persists its newest in-memory checkpoint first. While
suspended, a node that goes away (lost, disconnected, or one the policy would evict) is forgotten, not
evicted: its Pod was deleted on purpose, so it spends no budget; no round completes and the min-nodes
timeout does not run. On resume, a round whose members are gone is opened again for the new Pods.

Pure: every method takes ``now`` and does no I/O (see :mod:`phalanx.master.job`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from phalanx.api.elasticjob import FINISHED_PHASES, Phase
from phalanx.api.settings import MasterSettings
from phalanx.api.v1 import master_pb2 as pb
from phalanx.api.verdicts import Eviction, HangAnalysis
from phalanx.diagnostics.hang import blame, stopped_ranks
from phalanx.diagnostics.stacks import compare_stacks
from phalanx.master import rendezvous as rdzv
from phalanx.master import snapshot
from phalanx.master.breakpoints import Breakpoint
from phalanx.master.checkpoints import CheckpointTracker
from phalanx.master.errors import RequestError
from phalanx.master.events import EventLog
from phalanx.master.membership import ALIVE, EVICTED, LOST, Node, absent, expired, unheard_since_restore
from phalanx.master.policy import FailureRecord
from phalanx.master.stats import JobStats
from phalanx.master.timeline import Timeline

__all__ = ["EVENT_SEQ_GAP", "FINISHED", "HangInquiry", "JobCore", "action"]

log = logging.getLogger("phalanx.master")
rdzv_log = logging.getLogger("phalanx.rendezvous")
failure_log = logging.getLogger("phalanx.failures")

FINISHED = FINISHED_PHASES
EVENT_SEQ_GAP = 1000
RESTORE_GRACE_INTERVALS = 3
"""Heartbeat intervals within which a live agent reaches a restarted master (it retries every interval,
and gRPC reconnects within a second)."""


def action(kind: int, **fields: Any) -> pb.Action:
    """An Action for an agent (``kind`` is an ``ACTION_KIND_*`` value)."""
    return pb.Action(kind=kind, **fields)  # type: ignore[arg-type]


@dataclass(kw_only=True)
class HangInquiry:
    """A hang being analysed: the members of its round were asked for their stacks."""

    round: int
    node: str
    """The node whose agent found the hang."""
    requested_at: float
    members: list[str]
    stacks: dict[str, dict[int, pb.RankStacks]] = field(default_factory=dict)
    """Node -> rank -> stack dump and process state, as they arrive."""
    charged: str = ""
    """The node the hang was counted against when it was reported ("": none, nothing singled one out)."""
    suspect_nodes: list[str] = field(default_factory=list)
    """The nodes of the interval recorder's suspects when it was reported."""


class JobCore:
    """The job's state, bookkeeping helpers and time-driven decisions (:meth:`tick`)."""

    def __init__(
        self, *, settings: MasterSettings, now: float, saved: Mapping[str, Any] | None = None
    ) -> None:
        self.settings = settings
        self.job_id = settings.job_id
        self.phase: str = Phase.PENDING
        self.reason = ""
        self.started_unix = now
        self.round: rdzv.Round | None = None
        self.next_round = 1
        self.round_open = True
        self.opened_at = now
        self.joiners: dict[str, rdzv.Joiner] = {}
        self.restart_count = 0
        self.evictions: list[Eviction] = []
        self.checkpoints = CheckpointTracker()
        self.breakpoint: Breakpoint | None = None
        """The save at breakpoint of the newest broken round (not durable: a restarted master only misses
        the correction of a straddled step)."""
        self.nodes: dict[str, Node] = {}
        self.completed: set[str] = set()
        self.round_failures: list[FailureRecord] = []
        self.root_cause: dict[str, Any] | None = None
        self.hang_counts: dict[str, int] = {}
        self.activities: dict[int, tuple[str, int, pb.RankActivity]] = {}
        """Each global rank's last ``RankActivity`` from heartbeats: rank -> (node, round, activity). Where
        the ranks are when a hang is reported: the ones that never entered the collective the others wait in
        are the suspects (not durable: a restarted master learns them again within a heartbeat)."""
        self.hang: HangInquiry | None = None
        """The pending hang analysis of a round."""
        self.early_stacks: tuple[int, dict[str, dict[int, pb.RankStacks]]] = (0, {})
        """Stacks of the current round that came before any hang analysis asked for them (round, node ->
        rank -> dump): an agent that detects a hang sends its stacks first and then reports the failure
        that starts the analysis, and so may every node whose ranks block in the same collective."""
        self.last_hang_analysis: HangAnalysis | None = None
        self.max_step = -1
        self.below_min_since: float | None = now
        self.scheduled_workers: int | None = None
        """How many worker Pods the Kubernetes scheduler placed, as the operator last said (None outside
        Kubernetes). Fewer than min_nodes: the missing nodes wait for capacity (a queue, an autoscaler), so
        the min-nodes timeout does not run; it starts when they could be scheduled."""
        self.stats = JobStats()
        self.events = EventLog()
        self.timeline = Timeline()
        """The ranks' recent intervals and the failures, for ``phalanx timeline`` (not durable)."""
        self.durable_version = 0
        self.status_version = 0
        self.round_version = 0
        self.action_version = 0
        """Moves whenever some node may have a new action (a round opened, one-shot actions, EXIT): held
        heartbeats wake up on it."""
        self.action_seq = 0
        """The seq of the newest one-shot action (:meth:`_push`); durable, so seqs grow across restarts."""
        self.suspended = False
        """Whether the job's spec asks it to be suspended (:meth:`suspend`); durable."""
        self.spec_generation = 0
        """The generation of the ElasticJob spec the job follows (0: none, outside Kubernetes); published so
        the operator knows an acknowledgement is of the spec it sees. Not durable: a restarted master
        reads the spec again."""
        if saved is not None:
            self._restore(saved, now=now)
            # Events after the last save died with the old master; skipping ahead keeps every seq a poller
            # saw below the new ones, so `since=<last seen>` never hides a new event.
            self.events = EventLog(first_seq=int(saved.get("event_seq", 1)) + EVENT_SEQ_GAP)
            # Likewise an action pushed after the last save must not reuse a seq an agent already acked.
            self.action_seq = int(saved.get("action_seq", 0)) + EVENT_SEQ_GAP
            self._event(
                "master_resumed", now=now, round=self.round_number, message=f"resumed in phase {self.phase}"
            )
        else:
            self._event("job_started", now=now, message=f"job {self.job_id} started")
            self._changed(durable=True)

    # ------------------------------------------------------------------------------------------------
    # Views

    @property
    def round_number(self) -> int:
        return self.round.number if self.round else 0

    @property
    def finished(self) -> bool:
        return self.phase in FINISHED

    @property
    def shown_phase(self) -> str:
        """The phase people and the operator see: Suspended while the job is (the decisions use ``phase``,
        which the suspension leaves as it was)."""
        return Phase.SUSPENDED if self.suspended and not self.finished else self.phase

    @property
    def members(self) -> list[str]:
        return self.round.node_ids if self.round else []

    _member_set: tuple[rdzv.Round | None, frozenset[str]] = (None, frozenset())

    def is_member(self, node_id: str) -> bool:
        """``node_id in self.members`` without building the list: every heartbeat asks, and with a thousand
        nodes the list cost more than the rest of the beat. A completed round never changes (frozen), so
        the set is made once per round."""
        round = self.round
        if round is None:
            return False
        if self._member_set[0] is not round:
            self._member_set = (round, frozenset(round.node_ids))
        return node_id in self._member_set[1]

    def alive(self) -> list[Node]:
        return [n for n in self.nodes.values() if n.status == ALIVE]

    def status(self) -> dict[str, Any]:
        """The ``/v1/job`` JSON (see :mod:`phalanx.master.http` for the field list)."""
        return {
            "job_id": self.job_id,
            "phase": self.shown_phase,
            "suspended": self.suspended,
            "spec_generation": self.spec_generation,
            "reason": self.reason,
            "round": self.round_number,
            "open_round": self.next_round if self.round_open else None,
            "world_size": self.round.world_size if self.round else 0,
            "members": self.members,
            "waiting": sorted(self.joiners),
            "min_nodes": self.settings.rendezvous.min_nodes,
            "max_nodes": self.settings.rendezvous.max_nodes,
            "nodes_alive": len(self.alive()),
            "restart_count": self.restart_count,
            "max_restarts": self.settings.restart.max_restarts,
            "eviction_count": len(self.evictions),
            "max_evictions": self.settings.restart.max_evictions,
            "evictions": [e.to_dict() for e in self.evictions],
            "committed_checkpoint_step": self.checkpoints.committed,
            "max_step": self.max_step,
            "root_cause": self.root_cause,
            "hang_analysis": self.last_hang_analysis.to_dict() if self.last_hang_analysis else None,
            "started_unix": self.started_unix,
            "completed": sorted(self.completed),
        }

    def durable(self) -> dict[str, Any]:
        """The state a restarted master resumes from (JSON); see :mod:`phalanx.master.snapshot`."""
        return snapshot.durable(self)

    def _restore(self, saved: Mapping[str, Any], *, now: float) -> None:
        snapshot.restore(self, saved, now=now)

    # ------------------------------------------------------------------------------------------------
    # Bookkeeping helpers

    def _changed(self, *, durable: bool = False) -> None:
        self.status_version += 1
        if durable:
            self.durable_version += 1

    def _push(self, node: Node, actions: list[pb.Action]) -> None:
        """Queues one-shot actions for ``node``'s heartbeat responses, each with a fresh seq; they are
        repeated until a heartbeat acknowledges them (see :meth:`Job.heartbeat`)."""
        for a in actions:
            self.action_seq += 1
            a.seq = self.action_seq
            node.pending.append(a)
        self.action_version += 1
        self._changed(durable=True)  # the seq counter is durable

    def _event(
        self, kind: str, *, now: float, node: str = "", rank: int = -1, round: int = -1, message: str = ""
    ) -> None:
        event = self.events.add(
            kind,
            now=now,
            node=node,
            rank=rank,
            round=self.round_number if round < 0 else round,
            message=message,
        )
        self.timeline.note_event(event)
        self._changed(durable=True)  # the event counter is durable (see EVENT_SEQ_GAP)

    def _node(self, node_id: str, incarnation: str) -> Node:
        node = self.nodes.get(node_id)
        if node is None:
            raise RequestError(
                f"node {node_id!r} is not registered; call RegisterNode first", code="not_found"
            )
        if node.incarnation != incarnation and incarnation not in node.old_incarnations:
            raise RequestError(f"unknown incarnation {incarnation!r} of node {node_id!r}")
        return node

    def _exitaction(self, node: Node, incarnation: str) -> pb.Action | None:
        """EXIT for a finished job, an evicted or lost node, or a replaced incarnation; None otherwise."""
        if self.finished:
            code = 0 if self.phase == Phase.SUCCEEDED else 1
            return action(
                pb.ACTION_KIND_EXIT, round=self.round_number, exit_code=code, reason=self._end_reason()
            )
        if incarnation != node.incarnation:
            return action(
                pb.ACTION_KIND_EXIT, exit_code=1, reason="replaced by a newer incarnation of this node"
            )
        if node.status != ALIVE:
            return action(pb.ACTION_KIND_EXIT, exit_code=1, reason=node.exit_reason or f"node {node.status}")
        return None

    def _end_reason(self) -> str:
        return f"job {self.phase.lower()}: {self.reason}" if self.reason else f"job {self.phase.lower()}"

    def _finish(self, phase: str, reason: str, *, now: float) -> None:
        if self.finished:
            return
        self.phase = phase
        self.reason = reason
        self.round_open = False
        self.joiners.clear()
        self._event("job_succeeded" if phase == Phase.SUCCEEDED else "job_failed", now=now, message=reason)
        (log.info if phase == Phase.SUCCEEDED else failure_log.error)(
            "job %s: %s", phase.lower(), reason, extra={"round": self.round_number}
        )
        self.round_version += 1
        self.action_version += 1
        self._changed(durable=True)

    def _open_round(self, why: str, *, now: float) -> None:
        """Opens the next round: survivors get REJOIN in their next heartbeat response."""
        if self.round_open or self.finished:
            return
        self.round_open = True
        self.opened_at = now
        if self.round is not None:
            self.phase = Phase.RESTARTING
        self._event("round_open", now=now, round=self.next_round, message=why)
        rdzv_log.info("round %d open: %s", self.next_round, why, extra={"round": self.next_round})
        self.action_version += 1
        self._changed(durable=True)

    def _request_eviction(self, node: Node, *, kind: str, reason: str, now: float) -> bool:
        """Records an eviction request; False (and the job fails) when the budget is spent. A suspended job
        evicts nothing: it forgets the node and returns False (no new round either)."""
        if self.suspended:
            self._forget(node, now=now, why=f"left the suspended job ({reason})")
            return False
        node.status = EVICTED if kind != "heartbeat_timeout" else LOST
        node.exit_reason = f"evicted: {reason}"
        self.action_version += 1  # its agent, if still there, is told to exit
        self.joiners.pop(node.node_id, None)
        if len(self.evictions) >= self.settings.restart.max_evictions:
            self._finish(
                Phase.FAILED,
                f"{reason}, and the eviction budget ({self.settings.restart.max_evictions}) is spent",
                now=now,
            )
            return False
        self.evictions.append(
            Eviction(node_id=node.node_id, machine=node.machine, reason=reason, kind=kind, requested_at=now)
        )
        self.stats.evictions[kind] = self.stats.evictions.get(kind, 0) + 1
        self._event("eviction_requested", now=now, node=node.node_id, message=reason)
        failure_log.warning(
            "eviction of %s requested: %s",
            node.node_id,
            reason,
            extra={"node": node.node_id, "round": self.round_number},
        )
        self._changed(durable=True)
        return True

    def _analyze_hang(self, *, now: float) -> None:
        hang, self.hang = self.hang, None
        if hang is None:
            return
        texts = {n: {r: s.stacks for r, s in ranks.items()} for n, ranks in hang.stacks.items()}
        verdict = compare_stacks(texts)  # no fallback to the reporter: two stacks that tie name nobody
        states = {n: {r: s.process_state for r, s in ranks.items()} for n, ranks in hang.stacks.items()}
        found = blame(
            members=hang.members,
            stopped=stopped_ranks(states),
            suspect_nodes=hang.suspect_nodes,
            odd_nodes=verdict.odd_nodes,
        )
        counted = f"counted against {found.node}" if found.node else "counted against no node"
        reason = f"{verdict.reason}; {counted}: {found.why}"
        self.last_hang_analysis = HangAnalysis(
            round=hang.round,
            hung_node=hang.node,
            odd_nodes=list(verdict.odd_nodes),
            odd_ranks=sorted(verdict.odd_ranks),
            nodes_reported=sorted(hang.stacks),
            reason=reason,
            blamed=found.node,
        )
        self._event("hang_analysis", now=now, node=found.node, round=hang.round, message=reason)
        failure_log.warning("hang analysis: %s", reason, extra={"node": hang.node, "round": hang.round})
        if found.node != hang.charged:
            # The evidence of every node's stacks moves the hang to the node it singles out, or off the node
            # charged when it was reported.
            if hang.charged:
                self.hang_counts[hang.charged] = max(0, self.hang_counts.get(hang.charged, 0) - 1)
            if found.node:
                self._charge_hang(found.node, why=found.why, now=now)
        self._changed(durable=True)

    def _charge_hang(self, node_id: str, *, why: str, now: float) -> None:
        """Counts a hang against ``node_id`` after the stack analysis; its second evicts it."""
        count = self.hang_counts[node_id] = self.hang_counts.get(node_id, 0) + 1
        culprit = self.nodes.get(node_id)
        if count >= 2 and culprit is not None and culprit.status == ALIVE:
            was_member = node_id in self.members or node_id in self.joiners
            reason = f"{node_id} hung {count} times ({why})"
            if self._request_eviction(culprit, kind="hang", reason=reason, now=now) and was_member:
                self._open_round(f"evicted {node_id}: {reason}", now=now)

    # ------------------------------------------------------------------------------------------------
    # Time

    def follow_spec(
        self, *, suspend: bool, generation: int, now: float, scheduled_workers: int | None = None
    ) -> None:
        """Follows the ElasticJob's spec as the master last read it (generation ``generation``), and the
        operator's count of worker Pods the scheduler placed (None: not known)."""
        self.scheduled_workers = scheduled_workers
        self.suspend(suspend, now=now)
        min_nodes = self.settings.rendezvous.min_nodes
        if scheduled_workers is not None and scheduled_workers < min_nodes:
            self.below_min_since = None
        elif self.below_min_since is None and not self.suspended and len(self.alive()) < min_nodes:
            self.below_min_since = now  # placed now: the nodes' time to join starts
        if generation != self.spec_generation:
            self.spec_generation = generation
            self._changed()  # published: the operator waits for the generation it acts on

    def suspend(self, value: bool, *, now: float) -> None:
        """Follows the job's ``spec.suspend`` (see the module docstring); a finished job ignores it."""
        if value == self.suspended or self.finished:
            return
        self.suspended = value
        if value:
            self._event("job_suspended", now=now, message="nodes that leave now are forgotten, not evicted")
            log.info("job suspended", extra={"round": self.round_number})
        else:
            self._event("job_resumed", now=now, message="waiting for the nodes of the resumed job")
            log.info("job resumed", extra={"round": self.round_number})
            if any(m not in self.nodes for m in self.members):
                self._open_round("resumed after a suspension", now=now)
            alive = len(self.alive())
            self.below_min_since = now if alive < self.settings.rendezvous.min_nodes else None
        self.action_version += 1
        self._changed(durable=True)

    def _forget(self, node: Node, *, now: float, why: str) -> None:
        """Drops a node that left a suspended job. Its agent, if it is still there, is told it is not
        registered at its next request and registers again."""
        self.nodes.pop(node.node_id, None)
        self.joiners.pop(node.node_id, None)
        self.completed.discard(node.node_id)
        self._event("node_left", now=now, node=node.node_id, message=why)
        log.info("node left the suspended job: %s", why, extra={"node": node.node_id})
        self._settle_breakpoint(now=now)  # whoever still persists no longer waits for it

    def tick(self, *, now: float) -> None:
        """Applies everything that happens with time: lost nodes, last calls, hang and min-nodes timeouts."""
        if self.finished:
            return
        hb = self.settings.heartbeat
        if self.suspended:
            for node_id in expired(self.nodes.values(), now=now, timeout_s=hb.timeout_s):
                self._forget(self.nodes[node_id], now=now, why=f"no heartbeat for {hb.timeout_s:g}s")
            for node_id in self.absent(now=now):
                node = self.nodes[node_id]
                self._forget(node, now=now, why="its agent left" if node.leaving else "its connection closed")
            self._settle_breakpoint(now=now)
            self.below_min_since = None  # the min-nodes timeout starts again when the job resumes
            return
        for node_id in expired(self.nodes.values(), now=now, timeout_s=hb.timeout_s):
            self._lose(self.nodes[node_id], now=now)
            if self.finished:
                return
        for node_id in self.absent(now=now):
            self._leave_out(self.nodes[node_id], now=now)
        if self.hang is not None and now - self.hang.requested_at > hb.timeout_s:
            self._analyze_hang(now=now)
        self._settle_breakpoint(now=now)  # a member that went away is no longer waited for
        self._maybe_complete(now=now)
        rs = self.settings.rendezvous
        alive = len(self.alive())
        unplaced = self.scheduled_workers is not None and self.scheduled_workers < rs.min_nodes
        if alive >= rs.min_nodes or unplaced:
            self.below_min_since = None
        elif self.below_min_since is None:
            self.below_min_since = now
        elif now - self.below_min_since > rs.min_nodes_timeout_s:
            self._finish(
                Phase.FAILED,
                f"only {alive} of the {rs.min_nodes} required nodes for over {rs.min_nodes_timeout_s:g}s",
                now=now,
            )

    def _lose(self, node: Node, *, now: float) -> None:
        timeout = self.settings.heartbeat.timeout_s
        was_member = node.node_id in self.members
        self._event("node_lost", now=now, node=node.node_id, message=f"no heartbeat for {timeout:g}s")
        failure_log.error(
            "node lost: no heartbeat for %gs",
            timeout,
            extra={"node": node.node_id, "round": self.round_number},
        )
        reason = f"{node.node_id} sent no heartbeat for {timeout:g}s"
        if self._request_eviction(node, kind="heartbeat_timeout", reason=reason, now=now) and was_member:
            self._open_round(f"{node.node_id} lost", now=now)

    def absent(self, *, now: float) -> list[str]:
        """Live nodes whose agent is most likely gone (see :func:`phalanx.master.membership.absent`); the
        grace is one heartbeat interval, within which a live agent whose connection broke heartbeats again."""
        return absent(self.nodes.values(), now=now, grace_s=self.settings.heartbeat.interval_s)

    def _expected(self, *, now: float) -> list[str]:
        """The nodes an open round waits for: the live ones, less the absent, and less those not heard from
        since this master restarted (a few heartbeat intervals ago). Such a node, one that died while the
        master was down, say, would otherwise hold every round until its heartbeat timeout. Only a round
        open for another reason completes without it: the timeout still decides whether it is lost, so a
        live one slow to come back costs no round, and joins the next one if it missed this."""
        grace = RESTORE_GRACE_INTERVALS * self.settings.heartbeat.interval_s
        left_out = set(unheard_since_restore(self.nodes.values(), now=now, grace_s=grace))
        left_out.update(self.absent(now=now))
        # One set, built once: this runs at every join; a union per node is quadratic at thousands of nodes.
        return [n.node_id for n in self.nodes.values() if n.status == ALIVE and n.node_id not in left_out]

    def _leave_out(self, node: Node, *, now: float) -> None:
        """Stops waiting for an absent node, once per disconnection: a member's absence opens a new round at
        once instead of after the heartbeat timeout, and an open round completes without it. It stays alive:
        back within the heartbeat timeout, it joins again; silent until then, it is lost as usual."""
        if node.absence_handled == node.disconnected_at:
            return
        node.absence_handled = node.disconnected_at
        self._event(
            "node_disconnected",
            now=now,
            node=node.node_id,
            message="its agent is leaving"
            if node.leaving
            else "its connection closed and it was not heard from since",
        )
        failure_log.warning(
            "node disconnected: leaving it out of the rendezvous",
            extra={"node": node.node_id, "round": self.round_number},
        )
        self.joiners.pop(node.node_id, None)
        if node.node_id in self.members and not self.finished:
            self._open_round(f"{node.node_id} disconnected", now=now)

    def _settle_breakpoint(self, *, now: float, answered: str = "") -> None:
        """Agrees on the breakpoint's step once every reachable member reported, and asks the nodes that
        persist another step to persist it (``answered`` learns it from its own response)."""
        bp = self.breakpoint
        if bp is None or bp.step is not None:
            return
        gone = set(self.absent(now=now))
        reachable = [n.node_id for n in self.alive() if n.node_id not in gone]
        ask = bp.settle(reachable=reachable, committed=self.checkpoints.committed)
        if bp.step is None:
            return
        self._event(
            "checkpoint_breakpoint",
            now=now,
            round=bp.round,
            message=f"step {bp.step}: the newest every node of round {bp.round} holds in memory",
        )
        log.info("save at breakpoint of round %d: step %d", bp.round, bp.step, extra={"round": bp.round})
        for node_id in ask:
            node = self.nodes.get(node_id)
            if node_id == answered or node is None or node.status != ALIVE:
                continue
            reason = f"persist step {bp.step}, the newest every node of round {bp.round} holds"
            persist = action(pb.ACTION_KIND_PERSIST_CHECKPOINT, step=bp.step, round=bp.round, reason=reason)
            self._push(node, [persist])

    def _maybe_complete(self, *, now: float) -> None:
        if not self.round_open or self.finished or self.suspended or not self.joiners:
            return
        rs = self.settings.rendezvous
        if rdzv.usable(len(self.joiners), rs) < rs.min_nodes:
            # should_complete's first test, made before the expected nodes are listed: while thousands of
            # nodes join one by one, listing them at every join would make the rendezvous quadratic.
            return
        if not rdzv.should_complete(
            joiners=self.joiners,
            expected=self._expected(now=now),
            opened_at=self.opened_at,
            now=now,
            settings=self.settings.rendezvous,
            straggler_wait_s=self.settings.heartbeat.timeout_s,
            previous=self.members,
        ):
            return
        new = rdzv.form_round(
            number=self.next_round,
            joiners=self.joiners,
            previous=self.members,
            settings=self.settings.rendezvous,
            now=now,
        )
        self.round = new
        self.next_round = new.number + 1
        self.round_open = False
        self.joiners.clear()  # those left out get NOT_MEMBER and join the next round
        if self.breakpoint is not None and self.breakpoint.step is None:
            # Every node that saves at a breakpoint reports before it joins: whoever has not reported by now
            # regrouped in place or is gone, and the old snapshots will not stay in memory for long.
            self.breakpoint = None
        self.completed = set()
        self.round_failures = []
        self.phase = Phase.RUNNING
        self._event(
            "round_complete",
            now=now,
            round=new.number,
            message=f"world size {new.world_size}, members {', '.join(new.node_ids)}",
        )
        rdzv_log.info(
            "round %d complete: %d nodes, world size %d",
            new.number,
            len(new.members),
            new.world_size,
            extra={"round": new.number},
        )
        self.round_version += 1
        self._changed(durable=True)
