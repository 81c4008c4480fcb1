"""The job's component for rendezvous rounds: nodes register, join the open round, learn the completed round,
and report that they completed their work (which succeeds the job).

The decisions (when a round completes, who is in it) are :mod:`phalanx.master.decide.rendezvous`'s; this
component carries them out. Pure: every method takes ``now`` and does no I/O.
"""

from __future__ import annotations

from phalanx.api.elasticjob import Phase
from phalanx.api.failures import FailureClass
from phalanx.api.v1 import master_pb2 as pb
from phalanx.master.decide import rendezvous as rdzv
from phalanx.master.decide.failure_policy import FailureRecord
from phalanx.master.errors import RequestError
from phalanx.master.job import effects as fx
from phalanx.master.job.answers import action, end_reason, exit_action
from phalanx.master.job.core import JobCore, log
from phalanx.master.job.failures import Failures
from phalanx.master.job.foldin import FoldIn
from phalanx.master.state.nodes import (
    ALIVE,
    Node,
    lost_records_to_drop,
    registration_refusal,
    unheard_since_restore,
)

__all__ = ["RESTORE_GRACE_INTERVALS", "RendezvousAnswer", "Rounds"]

RESTORE_GRACE_INTERVALS = 3
"""Heartbeat intervals within which a live agent reaches a restarted master (it retries every interval,
and gRPC reconnects within a second)."""


class RendezvousAnswer:
    """What GetRendezvous answers; ``durable_version`` must be saved before a COMPLETE goes out."""

    __slots__ = ("durable_version", "response")

    def __init__(self, response: pb.GetRendezvousResponse, durable_version: int = 0) -> None:
        self.response = response
        self.durable_version = durable_version


class Rounds:
    """Registration, the rendezvous rounds and the job's success."""

    def __init__(self, core: JobCore, *, failures: Failures, fold_in: FoldIn) -> None:
        self.core = core
        self.state = core.state
        self.failures = failures
        self.fold_in = fold_in
        self._round_members: tuple[rdzv.Round, pb.GetRendezvousResponse] | None = None

    def register(self, req: pb.RegisterNodeRequest, *, now: float) -> pb.RegisterNodeResponse:
        s, core = self.state, self.core
        if req.job_id != s.job_id:
            raise RequestError(f"the node belongs to job {req.job_id!r}; this master serves {s.job_id!r}")
        node = s.nodes.get(req.node_id)
        if node is None:
            core.apply(
                [fx.DropNodes(tuple(lost_records_to_drop(s.nodes.values(), members=s.members)))], now=now
            )
            refusal = registration_refusal(
                s.nodes.values(), node_id=req.node_id, max_nodes=s.settings.rendezvous.max_nodes
            )
            if refusal:
                raise RequestError(refusal, code="failed_precondition")
        if node is not None and node.incarnation == req.incarnation:
            # The same agent again, e.g. reconnecting after a master restart.
            core.apply([fx.SeeNode(req.node_id, agent_version=req.agent_version)], now=now)
        else:
            new = Node(
                node_id=req.node_id,
                incarnation=req.incarnation,
                host=req.host,
                machine=req.machine,
                nproc=req.nproc_per_node,
                agent_version=req.agent_version,
                registered_unix=now,
                last_seen=now,
                old_incarnations=[] if node is None else [*node.old_incarnations, node.incarnation][-8:],
            )
            if node is None:
                core.apply(
                    [
                        fx.AddNode(new, replaces=False),
                        fx.Emit("node_registered", f"host {req.host}", node=req.node_id),
                    ],
                    now=now,
                )
            else:
                replaced = fx.Emit("node_replaced", f"new incarnation {req.incarnation}", node=req.node_id)
                core.apply([fx.AddNode(new, replaces=True), replaced], now=now)
                if node.status == ALIVE and req.node_id in s.members and not s.round_open and not s.finished:
                    # The old agent is gone with its workers: a failure of the round like any other.
                    record = FailureRecord(
                        node_id=req.node_id,
                        round=s.round_number,
                        rank=-1,
                        failure_class=FailureClass.KILLED,
                        message="the node's agent restarted (new incarnation)",
                        unix=now,
                    )
                    self.failures.handle(new, [record], now=now)
            log.info(
                "registered incarnation %s",
                req.incarnation,
                extra={"node": req.node_id, "round": s.round_number},
            )
            core.apply([fx.Saved()], now=now)
        return pb.RegisterNodeResponse(
            heartbeat_interval_s=s.settings.heartbeat.interval_s,
            heartbeat_timeout_s=s.settings.heartbeat.timeout_s,
            round=s.round_number,
            committed_checkpoint_step=s.checkpoints.committed,
        )

    def join(self, req: pb.JoinRendezvousRequest, *, now: float) -> pb.JoinRendezvousResponse:
        s = self.state
        node = self.state.node(req.node_id, req.incarnation)
        if s.finished:
            return pb.JoinRendezvousResponse(round=s.next_round)  # GetRendezvous then answers CLOSED
        if node.status != ALIVE or req.incarnation != node.incarnation:
            raise RequestError(
                f"node {req.node_id} may not join: {node.exit_reason or 'replaced'}",
                code="failed_precondition",
            )
        joiner = rdzv.Joiner(
            node_id=req.node_id,
            nproc=req.nproc_per_node,
            store_host=req.store_host,
            store_port=req.store_port,
            last_round=req.last_round,
            joined_at=now,
        )
        effects: list[fx.Effect] = [fx.SeeNode(req.node_id, nproc=req.nproc_per_node), fx.Join(joiner)]
        if req.node_id not in s.joiners:
            effects.append(fx.Emit("node_joined", "", node=req.node_id, round=s.next_round))
        self.core.apply(effects, now=now)
        if not s.round_open:
            if s.is_member(req.node_id):
                self.core.apply([fx.OpenRound(f"{req.node_id} rejoined")], now=now)
            else:
                self.fold_in.maybe_fold_in(now=now)
        joined = s.next_round  # the round may complete right now; the node joined this one
        self.maybe_complete(now=now)
        return pb.JoinRendezvousResponse(round=joined)

    def get_rendezvous(self, req: pb.GetRendezvousRequest, *, now: float) -> RendezvousAnswer:
        s = self.state
        node = self.state.node(req.node_id, req.incarnation)
        resp = pb.GetRendezvousResponse(
            round=req.round,
            restart_count=s.restart_count,
            committed_checkpoint_step=s.checkpoints.committed,
        )
        if s.finished or node.status != ALIVE or req.incarnation != node.incarnation:
            resp.status = pb.RENDEZVOUS_STATUS_CLOSED
            return RendezvousAnswer(resp)
        r = s.round
        member = r.member(req.node_id) if r is not None and req.round == r.number else None
        if r is not None and member is not None:
            resp.status = pb.RENDEZVOUS_STATUS_COMPLETE
            resp.MergeFrom(self._members_message(r))
            resp.group_rank = member.group_rank
            resp.rank_offset = member.rank_offset
            resp.world_size = r.world_size
            resp.store_host = r.store_host
            resp.store_port = r.store_port
            return RendezvousAnswer(resp, s.durable_version)
        if req.round == s.next_round and req.node_id in s.joiners:
            resp.status = pb.RENDEZVOUS_STATUS_WAITING
        else:
            resp.status = pb.RENDEZVOUS_STATUS_NOT_MEMBER
        return RendezvousAnswer(resp)

    def _members_message(self, r: rdzv.Round) -> pb.GetRendezvousResponse:
        """The round's member list as a message, built once per round and merged into each member's answer
        (a copy in C): built per answer, the answers of N members cost N x N Python objects."""
        if self._round_members is None or self._round_members[0] is not r:
            members = [
                pb.Member(
                    node_id=m.node_id,
                    group_rank=m.group_rank,
                    nproc_per_node=m.nproc,
                    rank_offset=m.rank_offset,
                )
                for m in r.members
            ]
            self._round_members = (r, pb.GetRendezvousResponse(members=members))
        return self._round_members[1]

    def _expected(self, *, now: float) -> list[str]:
        """The nodes an open round waits for: the live ones, less the absent, and less those not heard from
        since this master restarted (a few heartbeat intervals ago). Such a node, one that died while the
        master was down, say, would otherwise hold every round until its heartbeat timeout. Only a round
        open for another reason completes without it: the timeout still decides whether it is lost, so a
        live one slow to come back costs no round, and joins the next one if it missed this."""
        s = self.state
        grace = RESTORE_GRACE_INTERVALS * s.settings.heartbeat.interval_s
        left_out = set(unheard_since_restore(s.nodes.values(), now=now, grace_s=grace))
        left_out.update(self.state.absent(now=now))
        # One set, built once: this runs at every join; a union per node is quadratic at thousands of nodes.
        return [n.node_id for n in s.nodes.values() if n.status == ALIVE and n.node_id not in left_out]

    def maybe_complete(self, *, now: float) -> None:
        s = self.state
        if not s.round_open or s.finished or s.suspended or not s.joiners:
            return
        rs = s.settings.rendezvous
        if rdzv.usable(len(s.joiners), rs) < rs.min_nodes:
            # should_complete's first test, made before the expected nodes are listed: while thousands of
            # nodes join one by one, listing them at every join would make the rendezvous quadratic.
            return
        if not rdzv.should_complete(
            joiners=s.joiners,
            expected=self._expected(now=now),
            opened_at=s.opened_at,
            now=now,
            settings=s.settings.rendezvous,
            straggler_wait_s=s.settings.heartbeat.timeout_s,
            previous=s.members,
        ):
            return
        new = rdzv.form_round(
            number=s.next_round,
            joiners=s.joiners,
            previous=s.members,
            settings=s.settings.rendezvous,
            now=now,
        )
        self.core.apply([fx.CompleteRound(new)], now=now)

    def report_completion(self, req: pb.ReportCompletionRequest, *, now: float) -> pb.Action:
        s, core = self.state, self.core
        node = s.node(req.node_id, req.incarnation)
        leave = exit_action(s, node, req.incarnation)
        if leave is not None:
            return leave
        core.apply([fx.SeeNode(req.node_id)], now=now)
        if req.round != s.round_number or req.node_id not in s.members:
            return action(pb.ACTION_KIND_REJOIN, round=s.next_round, reason="a newer round exists")
        if s.round_open:
            return action(pb.ACTION_KIND_REJOIN, round=s.next_round, reason="a new round is open")
        if req.node_id not in s.completed:
            core.apply(
                [fx.Completed(req.node_id), fx.Emit("node_completed", "", node=req.node_id), fx.Saved()],
                now=now,
            )
        if self.maybe_succeed(now=now):
            return action(pb.ACTION_KIND_EXIT, round=s.round_number, exit_code=0, reason=end_reason(s))
        return action(pb.ACTION_KIND_NONE)

    def maybe_succeed(self, *, now: float) -> bool:
        """Succeeds the job once every member of the round completed it, or joined it as training ended
        (see :func:`rendezvous.untrained_newcomers`; a newcomer's heartbeat may tell that after the
        others' completions)."""
        s = self.state
        if not s.completed or s.round is None or s.round_open or s.finished:
            return False
        idle = rdzv.untrained_newcomers(
            s.round,
            completed=s.completed,
            steps={n: [r.step for r in s.nodes[n].ranks] for n in s.members if n in s.nodes},
        )
        if not s.completed | idle >= set(s.members):
            return False
        reason = f"all {len(s.members)} nodes completed round {s.round_number}"
        if idle:
            reason = (
                f"{len(s.completed)} of {len(s.members)} nodes completed round {s.round_number}; "
                f"{', '.join(sorted(idle))} joined it as training ended and had nothing left to train"
            )
        self.core.finish(Phase.SUCCEEDED, reason, now=now)
        return True
