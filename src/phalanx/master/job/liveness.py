"""The job's component for everything that happens with time: heartbeat timeouts, absent nodes, the hang
analysis's timeout, the min-nodes timeout, and following the spec (suspend, resume, scheduled workers).

A suspended job forgets the nodes that go away instead of evicting them (see :mod:`phalanx.master.job.core`).
Pure: every method takes ``now`` and does no I/O.
"""

from __future__ import annotations

from phalanx.api.elasticjob import Phase
from phalanx.master.job.core import JobCore, failure_log, log
from phalanx.master.job.hangs import Hangs
from phalanx.master.job.rounds import Rounds
from phalanx.master.state.nodes import Node, expired

__all__ = ["Liveness"]


class Liveness:
    """Time-driven decisions over the job's state (:meth:`tick`) and the spec the job follows."""

    def __init__(self, core: JobCore, *, hangs: Hangs, rounds: Rounds) -> None:
        self.core = core
        self.state = core.state
        self.hangs = hangs
        self.rounds = rounds

    def follow_spec(
        self, *, suspend: bool, generation: int, now: float, scheduled_workers: int | None = None
    ) -> None:
        """Follows the ElasticJob's spec as the master last read it (generation ``generation``), and the
        operator's count of worker Pods the scheduler placed (None: not known)."""
        s = self.state
        s.scheduled_workers = scheduled_workers
        self.suspend(suspend, now=now)
        min_nodes = s.settings.rendezvous.min_nodes
        if scheduled_workers is not None and scheduled_workers < min_nodes:
            s.below_min_since = None
        elif s.below_min_since is None and not s.suspended and len(s.alive()) < min_nodes:
            s.below_min_since = now  # placed now: the nodes' time to join starts
        if generation != s.spec_generation:
            s.spec_generation = generation
            self.core.changed()  # published: the operator waits for the generation it acts on

    def suspend(self, value: bool, *, now: float) -> None:
        """Follows the job's ``spec.suspend`` (see :mod:`phalanx.master.job.core`); a finished job ignores
        it."""
        s = self.state
        if value == s.suspended or s.finished:
            return
        s.suspended = value
        if value:
            self.core.event(
                "job_suspended",
                now=now,
                message="nodes that leave now are forgotten, not evicted",
                log=log.info,
            )
        else:
            self.core.event(
                "job_resumed", now=now, message="waiting for the nodes of the resumed job", log=log.info
            )
            if any(m not in s.nodes for m in s.members):
                self.core.open_round("resumed after a suspension", now=now)
            alive = len(s.alive())
            s.below_min_since = now if alive < s.settings.rendezvous.min_nodes else None
        s.action_version += 1
        self.core.changed(durable=True)

    def tick(self, *, now: float) -> None:
        """Applies everything that happens with time: lost nodes, last calls, hang and min-nodes timeouts."""
        s, core = self.state, self.core
        if s.finished:
            return
        hb = s.settings.heartbeat
        if s.suspended:
            for node_id in expired(s.nodes.values(), now=now, timeout_s=hb.timeout_s):
                core.forget(s.nodes[node_id], now=now, why=f"no heartbeat for {hb.timeout_s:g}s")
            for node_id in core.absent(now=now):
                node = s.nodes[node_id]
                core.forget(node, now=now, why="its agent left" if node.leaving else "its connection closed")
            core.settle_breakpoint(now=now)
            s.below_min_since = None  # the min-nodes timeout starts again when the job resumes
            return
        for node_id in expired(s.nodes.values(), now=now, timeout_s=hb.timeout_s):
            self._lose(s.nodes[node_id], now=now)
            if s.finished:
                return
        for node_id in core.absent(now=now):
            self._leave_out(s.nodes[node_id], now=now)
        inquiry = s.hang
        if inquiry is not None and now - inquiry.requested_at > hb.timeout_s:
            self.hangs.conclude(now=now)
        core.settle_breakpoint(now=now)  # a member that went away is no longer waited for
        self.rounds.maybe_complete(now=now)
        rs = s.settings.rendezvous
        alive = len(s.alive())
        unplaced = s.scheduled_workers is not None and s.scheduled_workers < rs.min_nodes
        if alive >= rs.min_nodes or unplaced:
            s.below_min_since = None
        elif s.below_min_since is None:
            s.below_min_since = now
        elif now - s.below_min_since > rs.min_nodes_timeout_s:
            core.finish(
                Phase.FAILED,
                f"only {alive} of the {rs.min_nodes} required nodes for over {rs.min_nodes_timeout_s:g}s",
                now=now,
            )

    def _lose(self, node: Node, *, now: float) -> None:
        s = self.state
        timeout = s.settings.heartbeat.timeout_s
        self.core.event(
            "node_lost",
            now=now,
            node=node.node_id,
            message=f"no heartbeat for {timeout:g}s",
            log=failure_log.error,
        )
        reason = f"{node.node_id} sent no heartbeat for {timeout:g}s"
        self.core.evict_and_reopen(
            node, kind="heartbeat_timeout", reason=reason, why=f"{node.node_id} lost", now=now
        )

    def _leave_out(self, node: Node, *, now: float) -> None:
        """Stops waiting for an absent node, once per disconnection: a member's absence opens a new round at
        once instead of after the heartbeat timeout, and an open round completes without it. It stays alive:
        back within the heartbeat timeout, it joins again; silent until then, it is lost as usual."""
        if node.absence_handled == node.disconnected_at:
            return
        node.absence_handled = node.disconnected_at
        s = self.state
        self.core.event(
            "node_disconnected",
            now=now,
            node=node.node_id,
            message="its agent is leaving"
            if node.leaving
            else "its connection closed and it was not heard from since",
            log=failure_log.warning,
        )
        s.joiners.pop(node.node_id, None)
        if node.node_id in s.members and not s.finished:
            self.core.open_round(f"{node.node_id} disconnected", now=now)
