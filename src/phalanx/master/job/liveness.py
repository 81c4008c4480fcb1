"""The job's component for everything that happens with time: heartbeat timeouts, absent nodes, the hang
analysis's timeout, the min-nodes timeout, and following the spec (suspend, resume, scheduled workers).

A suspended job forgets the nodes that go away instead of evicting them (see :mod:`phalanx.master.job.core`).
Pure: every method takes ``now`` and does no I/O.
"""

from __future__ import annotations

from phalanx.api.elasticjob import Phase
from phalanx.master.job import effects as fx
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
        self.core.apply([fx.Scheduled(scheduled_workers)], now=now)
        self.suspend(suspend, now=now)
        min_nodes = s.settings.rendezvous.min_nodes
        if scheduled_workers is not None and scheduled_workers < min_nodes:
            self.core.apply([fx.MinNodesClock(None)], now=now)
        elif s.below_min_since is None and not s.suspended and len(s.alive()) < min_nodes:
            self.core.apply([fx.MinNodesClock(now)], now=now)  # placed now: the nodes' time to join starts
        self.core.apply([fx.SpecGeneration(generation)], now=now)

    def suspend(self, value: bool, *, now: float) -> None:
        """Follows the job's ``spec.suspend`` (see :mod:`phalanx.master.job.core`); a finished job ignores
        it."""
        s = self.state
        if value == s.suspended or s.finished:
            return
        if value:
            message = "nodes that leave now are forgotten, not evicted"
            self.core.apply([fx.Suspend(True), fx.Emit("job_suspended", message, log=log.info)], now=now)
            return
        effects: list[fx.Effect] = [
            fx.Suspend(False),
            fx.Emit("job_resumed", "waiting for the nodes of the resumed job", log=log.info),
        ]
        if any(m not in s.nodes for m in s.members):
            effects.append(fx.OpenRound("resumed after a suspension"))
        alive = len(s.alive())
        effects.append(fx.MinNodesClock(now if alive < s.settings.rendezvous.min_nodes else None))
        self.core.apply(effects, now=now)

    def tick(self, *, now: float) -> None:
        """Applies everything that happens with time: lost nodes, last calls, hang and min-nodes timeouts."""
        s, core = self.state, self.core
        if s.finished:
            return
        hb = s.settings.heartbeat
        if s.suspended:
            silent = f"no heartbeat for {hb.timeout_s:g}s"
            core.apply(
                [fx.Forget(n, silent) for n in expired(s.nodes.values(), now=now, timeout_s=hb.timeout_s)],
                now=now,
            )
            core.apply(
                [
                    fx.Forget(n, "its agent left" if s.nodes[n].leaving else "its connection closed")
                    for n in s.absent(now=now)
                ],
                now=now,
            )
            # The min-nodes timeout starts again when the job resumes.
            core.apply([fx.SettleBreakpoint(), fx.MinNodesClock(None)], now=now)
            return
        for node_id in expired(s.nodes.values(), now=now, timeout_s=hb.timeout_s):
            self._lose(s.nodes[node_id], now=now)
            if s.finished:
                return
        for node_id in s.gone(now=now):
            self._lose(s.nodes[node_id], now=now, closed=True)
            if s.finished:
                return
        for node_id in s.absent(now=now):
            self._leave_out(s.nodes[node_id], now=now)
        inquiry = s.hang
        if inquiry is not None and now - inquiry.requested_at > hb.timeout_s:
            self.hangs.conclude(now=now)
        core.apply([fx.SettleBreakpoint()], now=now)  # a member that went away is no longer waited for
        self.rounds.maybe_complete(now=now)
        rs = s.settings.rendezvous
        alive = len(s.alive())
        unplaced = s.scheduled_workers is not None and s.scheduled_workers < rs.min_nodes
        if alive >= rs.min_nodes or unplaced:
            core.apply([fx.MinNodesClock(None)], now=now)
        elif s.below_min_since is None:
            core.apply([fx.MinNodesClock(now)], now=now)
        elif now - s.below_min_since > rs.min_nodes_timeout_s:
            why = f"only {alive} of the {rs.min_nodes} required nodes for over {rs.min_nodes_timeout_s:g}s"
            core.apply([fx.Finish(Phase.FAILED, why)], now=now)

    def _lose(self, node: Node, *, now: float, closed: bool = False) -> None:
        """Declares ``node`` lost: silent for the heartbeat timeout, or (``closed``) silent since its
        connection closed for :meth:`~phalanx.master.state.jobstate.JobState.gone_after_s`."""
        s, n = self.state, node.node_id
        if closed:
            kind, why = "connection_closed", f"connection closed, silent for {s.gone_after_s():g}s"
            reason = f"{n}'s {why}"
        else:
            kind, why = "heartbeat_timeout", f"no heartbeat for {s.settings.heartbeat.timeout_s:g}s"
            reason = f"{n} sent {why}"
        lost = fx.Emit("node_lost", why, node=n, log=failure_log.error)
        evict = fx.Evict(n, kind, reason, reopen_why=f"{n} lost")
        self.core.apply([lost, evict], now=now)

    def _leave_out(self, node: Node, *, now: float) -> None:
        """Stops waiting for an absent node, once per disconnection: a member's absence opens a new round at
        once instead of after the heartbeat timeout, and an open round completes without it. It stays alive:
        back within a few intervals, it joins again; silent until then, it is lost (:meth:`_lose`)."""
        if node.absence_handled == node.disconnected_at:
            return
        s = self.state
        why = (
            "its agent is leaving"
            if node.leaving
            else "its connection closed and it was not heard from since"
        )
        effects: list[fx.Effect] = [
            fx.LeaveOut(node.node_id),
            fx.Emit("node_disconnected", why, node=node.node_id, log=failure_log.warning),
        ]
        if node.node_id in s.members and not s.finished:
            effects.append(fx.OpenRound(f"{node.node_id} disconnected"))
        self.core.apply(effects, now=now)
