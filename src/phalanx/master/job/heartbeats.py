"""The job's component for heartbeats: what a node's beat tells the job (liveness, progress, where its ranks
are) and what the job answers (one-shot actions until acknowledged, REJOIN, EXIT).

Pure: every method takes ``now`` and does no I/O.
"""

from __future__ import annotations

from phalanx.api.v1 import master_pb2 as pb
from phalanx.master.job.core import JobCore, action
from phalanx.master.job.rounds import Rounds
from phalanx.master.job.stepchecks import StepChecks
from phalanx.master.state.nodes import ALIVE

__all__ = ["Heartbeats"]


class Heartbeats:
    """Heartbeats in, actions out."""

    def __init__(self, core: JobCore, *, steps: StepChecks, rounds: Rounds) -> None:
        self.core = core
        self.state = core.state
        self.steps = steps
        self.rounds = rounds

    def heartbeat(self, req: pb.HeartbeatRequest, *, now: float) -> pb.HeartbeatResponse:
        s = self.state
        node = self.core.node(req.node_id, req.incarnation)
        s.stats.heartbeats += 1
        if self.core.exitaction(node, req.incarnation) is None:
            if node.pending:
                node.pending[:] = [a for a in node.pending if a.seq > req.acked_seq]
                s.stats.actions_repeated += sum(1 for a in node.pending if a.seq <= node.sent_seq)
            node.last_seen = now
            node.state = req.state
            if req.state == pb.NODE_STATE_LEAVING and not node.leaving:
                node.disconnected_at = now  # the absence is handled once, as a disconnection's is
            node.leaving = req.state == pb.NODE_STATE_LEAVING
            node.hb_round = req.round
            node.agent_restarts = req.restart_count
            if req.ranks:
                ranks = node.ranks = list(req.ranks)  # read the repeated field once: every beat passes here
                top = ranks[0].step
                activities = s.activities
                for r in ranks:
                    top = max(top, r.step)
                    if r.HasField("activity"):
                        activities[r.rank] = (req.node_id, req.round, r.activity)
                if top > s.max_step:
                    s.max_step = top
                    self.core.changed()
                if req.round == s.round_number and s.recovery.stepped(now=now, step=top):
                    self.core.changed(durable=True)  # a recovery resumed or caught up: its dates are durable
                self.steps.observe_steps(req.node_id, ranks, round=req.round)
                s.timeline.observe(req.node_id, ranks, now=now)
                self.rounds.maybe_succeed(now=now)
        return self.heartbeat_answer(req, now=now)

    def heartbeat_answer(self, req: pb.HeartbeatRequest, *, now: float) -> pb.HeartbeatResponse:
        """The response to a heartbeat: what the job has for the node now (a held heartbeat asks again
        whenever ``action_version`` moves). It has no effect: one-shot actions stay pending until a
        heartbeat acknowledges them."""
        s = self.state
        node = self.core.node(req.node_id, req.incarnation)
        resp = pb.HeartbeatResponse(round=s.round_number, committed_checkpoint_step=s.checkpoints.committed)
        leave = self.core.exitaction(node, req.incarnation)
        if leave is not None:
            resp.actions.append(leave)
            return resp
        node.last_seen = max(node.last_seen, now)  # connected all along while held
        # Repeated until acknowledged: the answer that carried them may never have arrived.
        resp.actions.extend(node.pending)
        if node.pending:
            node.sent_seq = max(node.sent_seq, node.pending[-1].seq)
        if (
            s.round_open
            and s.is_member(req.node_id)
            and req.node_id not in s.joiners
            and req.state not in (pb.NODE_STATE_RENDEZVOUS, pb.NODE_STATE_RESTARTING)
        ):
            # Repeated until the node joins; agents treat a repeat for the same round as a no-op.
            resp.actions.append(
                action(pb.ACTION_KIND_REJOIN, round=s.next_round, reason="a new round is open")
            )
        return resp

    def disconnected(self, req: pb.HeartbeatRequest, *, now: float) -> None:
        """The connection of a held heartbeat closed before its answer: the agent most likely died. The
        node becomes absent if it is not heard from within the grace (see :meth:`Liveness.tick`)."""
        node = self.state.nodes.get(req.node_id)
        if node is not None and node.incarnation == req.incarnation and node.status == ALIVE:
            node.disconnected_at = now
