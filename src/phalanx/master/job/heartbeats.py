"""The job's component for heartbeats: what a node's beat tells the job (liveness, progress, where its ranks
are) and what the job answers (one-shot actions until acknowledged, REJOIN, EXIT).

Every method takes ``now`` and does no I/O; what a beat tells the job is written by the job's writer.
"""

from __future__ import annotations

from phalanx.api.v1 import master_pb2 as pb
from phalanx.master.job import effects as fx
from phalanx.master.job.answers import action, exit_action
from phalanx.master.job.core import JobCore
from phalanx.master.job.rounds import Rounds
from phalanx.master.job.stepchecks import StepChecks
from phalanx.master.state.beat import BeatRanks, read_ranks
from phalanx.master.state.nodes import ALIVE, Node

__all__ = ["Heartbeats"]


class Heartbeats:
    """Heartbeats in, actions out."""

    def __init__(self, core: JobCore, *, steps: StepChecks, rounds: Rounds) -> None:
        self.core = core
        self.state = core.state
        self.steps = steps
        self.rounds = rounds

    def heartbeat(
        self, req: pb.HeartbeatRequest, *, now: float, ranks: BeatRanks | None = None
    ) -> pb.HeartbeatResponse:
        """``ranks``: ``req.ranks`` as the request's check read them; read here when not given."""
        if ranks is None:
            ranks = read_ranks(req)
        s = self.state
        node = s.node(req.node_id, req.incarnation)
        leave = exit_action(s, node, req.incarnation)
        self.core.apply([fx.Beat(req, ranks, heard=leave is None)], now=now)
        if leave is None and ranks.progress:
            self.steps.observe_steps(req.node_id, ranks.stepped, round=req.round)
            if self.rounds.maybe_succeed(now=now):  # the job ended: the node's answer is EXIT now
                leave = exit_action(s, node, req.incarnation)
        return self._answer(req, node, leave, now=now)

    def heartbeat_answer(self, req: pb.HeartbeatRequest, *, now: float) -> pb.HeartbeatResponse:
        """The response to a heartbeat: what the job has for the node now (a held heartbeat asks again
        whenever ``action_version`` moves). One-shot actions stay pending until a heartbeat acknowledges
        them; the answer only notes that they were sent."""
        node = self.state.node(req.node_id, req.incarnation)
        return self._answer(req, node, exit_action(self.state, node, req.incarnation), now=now)

    def _answer(
        self, req: pb.HeartbeatRequest, node: Node, leave: pb.Action | None, *, now: float
    ) -> pb.HeartbeatResponse:
        s = self.state
        resp = pb.HeartbeatResponse(round=s.round_number, committed_checkpoint_step=s.checkpoints.committed)
        if leave is not None:
            resp.actions.append(leave)
            return resp
        # Repeated until acknowledged: the answer that carried them may never have arrived.
        if node.pending or node.last_seen < now:  # else noting the answer would change nothing
            resp.actions.extend(node.pending)
            self.core.apply([fx.Answered(req.node_id)], now=now)
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
            self.core.apply([fx.Disconnected(req.node_id)], now=now)
