"""The job: the master's whole state machine, driven by agent requests and a clock tick.

Every method takes ``now`` (Unix seconds) and does no I/O, so the master's behaviour is tested with plain
values and an injected clock. The decisions themselves live in pure modules this one combines:
:mod:`.rendezvous` (when a round completes, who is in it), :mod:`.membership` (liveness),
:mod:`.policy` (what a failure leads to), :mod:`.checkpoints` (commits) and
:func:`phalanx.diagnostics.stacks.compare_stacks` (hang verdicts). The executor
(:mod:`phalanx.master.service`) calls these methods, persists :meth:`Job.durable` when
``durable_version`` moves, and wakes long-polls when ``round_version`` moves.

Phases: ``Pending`` (no round completed yet), ``Running``, ``Restarting`` (a new round is gathering after
the first), ``Succeeded``, ``Failed``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from phalanx.api.elasticjob import Phase
from phalanx.api.v1 import master_pb2 as pb
from phalanx.diagnostics import hang, rootcause
from phalanx.master import foldin
from phalanx.master import rendezvous as rdzv
from phalanx.master.breakpoints import Breakpoint
from phalanx.master.core import FINISHED, HangInquiry, action, failure_log, log, rdzv_log
from phalanx.master.errors import RequestError
from phalanx.master.membership import ALIVE, Node, lost_records_to_drop, registration_refusal
from phalanx.master.policy import (
    FailureRecord,
    PolicyInput,
    Verdict,
    decide_failure,
    explain_cause,
    records_from_request,
    root_cause,
)
from phalanx.master.probing import ProbeCore
from phalanx.master.recovery import RecoveryTracker

__all__ = ["FINISHED", "Job", "RendezvousAnswer"]


def _same_failure(recorded: dict[str, Any] | None, root: FailureRecord) -> bool:
    """Whether the recorded root cause (JSON) is ``root``'s failure."""
    if recorded is None:
        return False
    return (recorded.get("node_id"), recorded.get("rank")) == (root.node_id, root.rank)


HOLDS_RESTART_EVENT = frozenset({"failure", "root_cause", "round_open"})
"""Events that may come before a pending restart event (the round's other reports, the round it opened);
any other event (the next round completing, the job ending) emits it first, so the log stays in order."""


@dataclass
class PendingRestart:
    """A restart done and its event not yet emitted: it waits (:func:`rootcause.settled`) for the round's
    other reports, so that it names the root cause even when the echo's node reports first."""

    round: int
    at: float
    node: str
    rank: int
    message: str


class RendezvousAnswer:
    """What GetRendezvous answers; ``durable_version`` must be saved before a COMPLETE goes out."""

    __slots__ = ("durable_version", "response")

    def __init__(self, response: pb.GetRendezvousResponse, durable_version: int = 0) -> None:
        self.response = response
        self.durable_version = durable_version


class Job(ProbeCore):
    """State and decisions of one job's master: :class:`JobCore`, probe rounds (:class:`ProbeCore`) and
    the agents' requests."""

    pending_restart: PendingRestart | None = None
    fold_in_wait: foldin.Waiting | None = None
    """Nodes wait beside the running round for a checkpoint boundary (:mod:`.foldin`)."""
    snapshots: foldin.Snapshots | None = None
    """The job's snapshot cadence, from its newest save at breakpoint (not durable: a restarted master
    learns it at the next one, and waits for a commit meanwhile)."""
    commit_times: tuple[float, float] = (0.0, 0.0)
    """When the last two steps were committed (0: not yet); their difference bounds a wait for a commit."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.recovery = RecoveryTracker()
        """Where each recovery's time goes (detect, reform, restore, recompute): the master's metrics.
        Set first: restoring saved state may emit events already. Not durable (a restarted master starts
        with none)."""
        super().__init__(*args, **kwargs)

    # ------------------------------------------------------------------------------------------------
    # Requests

    def check_node(self, node_id: str, incarnation: str) -> Node:
        """The node's record; RequestError for an unknown node or incarnation."""
        return self._node(node_id, incarnation)

    def register(self, req: pb.RegisterNodeRequest, *, now: float) -> pb.RegisterNodeResponse:
        if req.job_id != self.job_id:
            raise RequestError(f"the node belongs to job {req.job_id!r}; this master serves {self.job_id!r}")
        node = self.nodes.get(req.node_id)
        if node is None:
            for gone in lost_records_to_drop(self.nodes.values(), members=self.members):
                del self.nodes[gone]
            refusal = registration_refusal(
                self.nodes.values(), node_id=req.node_id, max_nodes=self.settings.rendezvous.max_nodes
            )
            if refusal:
                raise RequestError(refusal, code="failed_precondition")
        if node is not None and node.incarnation == req.incarnation:
            node.last_seen = now  # the same agent again, e.g. reconnecting after a master restart
            node.agent_version = req.agent_version
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
            )
            self.nodes[req.node_id] = new
            if node is None:
                self._event("node_registered", now=now, node=req.node_id, message=f"host {req.host}")
            else:
                new.old_incarnations = [*node.old_incarnations, node.incarnation][-8:]
                self.joiners.pop(req.node_id, None)
                self._event(
                    "node_replaced", now=now, node=req.node_id, message=f"new incarnation {req.incarnation}"
                )
                if (
                    node.status == ALIVE
                    and req.node_id in self.members
                    and not self.round_open
                    and not self.finished
                ):
                    # The old agent is gone with its workers: a failure of the round like any other.
                    record = FailureRecord(
                        node_id=req.node_id,
                        round=self.round_number,
                        rank=-1,
                        failure_class="killed",
                        message="the node's agent restarted (new incarnation)",
                        unix=now,
                    )
                    self._handle_failure(new, [record], now=now)
            log.info(
                "registered incarnation %s",
                req.incarnation,
                extra={"node": req.node_id, "round": self.round_number},
            )
            self._changed(durable=True)
        return pb.RegisterNodeResponse(
            heartbeat_interval_s=self.settings.heartbeat.interval_s,
            heartbeat_timeout_s=self.settings.heartbeat.timeout_s,
            round=self.round_number,
            committed_checkpoint_step=self.checkpoints.committed,
        )

    def heartbeat(self, req: pb.HeartbeatRequest, *, now: float) -> pb.HeartbeatResponse:
        node = self._node(req.node_id, req.incarnation)
        self.stats.heartbeats += 1
        if self._exitaction(node, req.incarnation) is None:
            if node.pending:
                node.pending[:] = [a for a in node.pending if a.seq > req.acked_seq]
                self.stats.actions_repeated += sum(1 for a in node.pending if a.seq <= node.sent_seq)
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
                for r in ranks:
                    top = max(top, r.step)
                    if r.HasField("activity"):
                        self.activities[r.rank] = (req.node_id, req.round, r.activity)
                if top > self.max_step:
                    self.max_step = top
                    self._changed()
                if req.round == self.round_number:
                    self.recovery.stepped(now=now, step=top)
                self.observe_steps(req.node_id, ranks, round=req.round)
                self.timeline.observe(req.node_id, ranks, now=now)
                self._maybe_succeed(now=now)
        return self.heartbeat_answer(req, now=now)

    def heartbeat_answer(self, req: pb.HeartbeatRequest, *, now: float) -> pb.HeartbeatResponse:
        """The response to a heartbeat: what the job has for the node now (a held heartbeat asks again
        whenever :attr:`action_version` moves). It has no effect: one-shot actions stay pending until a
        heartbeat acknowledges them."""
        node = self._node(req.node_id, req.incarnation)
        resp = pb.HeartbeatResponse(
            round=self.round_number, committed_checkpoint_step=self.checkpoints.committed
        )
        leave = self._exitaction(node, req.incarnation)
        if leave is not None:
            resp.actions.append(leave)
            return resp
        node.last_seen = max(node.last_seen, now)  # connected all along while held
        # Repeated until acknowledged: the answer that carried them may never have arrived.
        resp.actions.extend(node.pending)
        if node.pending:
            node.sent_seq = max(node.sent_seq, node.pending[-1].seq)
        if (
            self.round_open
            and self.is_member(req.node_id)
            and req.node_id not in self.joiners
            and req.state not in (pb.NODE_STATE_RENDEZVOUS, pb.NODE_STATE_RESTARTING)
        ):
            # Repeated until the node joins; agents treat a repeat for the same round as a no-op.
            resp.actions.append(
                action(pb.ACTION_KIND_REJOIN, round=self.next_round, reason="a new round is open")
            )
        return resp

    def disconnected(self, req: pb.HeartbeatRequest, *, now: float) -> None:
        """The connection of a held heartbeat closed before its answer: the agent most likely died. The
        node becomes absent if it is not heard from within the grace (see :meth:`tick`)."""
        node = self.nodes.get(req.node_id)
        if node is not None and node.incarnation == req.incarnation and node.status == ALIVE:
            node.disconnected_at = now

    def join(self, req: pb.JoinRendezvousRequest, *, now: float) -> pb.JoinRendezvousResponse:
        node = self._node(req.node_id, req.incarnation)
        if self.finished:
            return pb.JoinRendezvousResponse(round=self.next_round)  # GetRendezvous then answers CLOSED
        if node.status != ALIVE or req.incarnation != node.incarnation:
            raise RequestError(
                f"node {req.node_id} may not join: {node.exit_reason or 'replaced'}",
                code="failed_precondition",
            )
        node.last_seen = now
        node.nproc = req.nproc_per_node
        fresh = req.node_id not in self.joiners
        self.joiners[req.node_id] = rdzv.Joiner(
            node_id=req.node_id,
            nproc=req.nproc_per_node,
            store_host=req.store_host,
            store_port=req.store_port,
            last_round=req.last_round,
            joined_at=now,
        )
        if fresh:
            self._event("node_joined", now=now, node=req.node_id, round=self.next_round)
        if not self.round_open:
            if self.is_member(req.node_id):
                self._open_round(f"{req.node_id} rejoined", now=now)
            else:
                self._maybe_fold_in(now=now)
        joined = self.next_round  # the round may complete right now; the node joined this one
        self._maybe_complete(now=now)
        return pb.JoinRendezvousResponse(round=joined)

    def _maybe_fold_in(self, *, now: float) -> None:
        """Opens the round that folds nodes waiting beside the running round in, once it would be larger
        and the job is at a checkpoint boundary (:func:`foldin.decide`); until then the members train on."""
        if self.round_open or self.finished or self.round is None or not self.joiners:
            self.fold_in_wait = None
            return
        members = self.members
        waiting = sum(1 for n in self.joiners if not self.is_member(n))
        # Once a member finished its work the job is ending: a new round would make every worker train
        # again from its last checkpoint (or from scratch) for nothing. Late joiners wait.
        if self.completed or not rdzv.can_grow(
            members=len(members), waiting=waiting, settings=self.settings.rendezvous
        ):
            self.fold_in_wait = None
            return
        step = self._round_step()
        wait = self.fold_in_wait
        fresh = wait is None or wait.round != self.round_number
        if wait is None or wait.round != self.round_number:
            wait = self.fold_in_wait = foldin.Waiting(
                round=self.round_number, since=now, step=step, committed=self.checkpoints.committed
            )
        elif wait.step < 0 <= step:
            # They joined before the round's first step was heard of: the wait is for the boundary after it.
            wait = self.fold_in_wait = dataclasses.replace(wait, step=step)
        before, last = self.commit_times
        decision = foldin.decide(
            waiting=wait,
            now=now,
            step=step,
            committed=self.checkpoints.committed,
            snapshots=self.snapshots,
            commit_period_s=last - before if before > 0 else None,
        )
        if fresh and not decision.now:
            rdzv_log.info(
                "%d node(s) wait beside round %d for a checkpoint boundary (step %d, snapshots %s)",
                waiting,
                self.round_number,
                step,
                f"every {self.snapshots.every} steps" if self.snapshots else "unknown",
                extra={"round": self.round_number},
            )
        if decision.now:
            self.fold_in_wait = None
            self._open_round(f"scale up: {waiting} node(s) waiting; {decision.reason}", now=now)

    def _round_step(self) -> int:
        """The newest step a rank of the running round reported (-1: none yet). Not :attr:`max_step`: after
        a restore from an older step, the job is behind it until the lost steps are trained again."""
        top = -1
        for node_id in self.members:
            node = self.nodes.get(node_id)
            if node is not None and node.hb_round == self.round_number:
                for r in node.ranks:
                    top = max(top, r.step)
        return top

    def get_rendezvous(self, req: pb.GetRendezvousRequest, *, now: float) -> RendezvousAnswer:
        node = self._node(req.node_id, req.incarnation)
        resp = pb.GetRendezvousResponse(
            round=req.round,
            restart_count=self.restart_count,
            committed_checkpoint_step=self.checkpoints.committed,
        )
        if self.finished or node.status != ALIVE or req.incarnation != node.incarnation:
            resp.status = pb.RENDEZVOUS_STATUS_CLOSED
            return RendezvousAnswer(resp)
        r = self.round
        member = r.member(req.node_id) if r is not None and req.round == r.number else None
        if r is not None and member is not None:
            resp.status = pb.RENDEZVOUS_STATUS_COMPLETE
            resp.MergeFrom(self._members_message(r))
            resp.group_rank = member.group_rank
            resp.rank_offset = member.rank_offset
            resp.world_size = r.world_size
            resp.store_host = r.store_host
            resp.store_port = r.store_port
            return RendezvousAnswer(resp, self.durable_version)
        if req.round == self.next_round and req.node_id in self.joiners:
            resp.status = pb.RENDEZVOUS_STATUS_WAITING
        else:
            resp.status = pb.RENDEZVOUS_STATUS_NOT_MEMBER
        return RendezvousAnswer(resp)

    _round_members: tuple[rdzv.Round, pb.GetRendezvousResponse] | None = None

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

    def report_failure(self, req: pb.ReportFailureRequest, *, now: float) -> pb.Action:
        node = self._node(req.node_id, req.incarnation)
        leave = self._exitaction(node, req.incarnation)
        if leave is not None:
            self._revise_failed_job(req, now=now)
            return leave
        node.last_seen = now
        records = records_from_request(req, now=now)
        for rec in records:
            self.stats.failures[rec.failure_class] = self.stats.failures.get(rec.failure_class, 0) + 1
        if req.round != self.round_number or req.node_id not in self.members:
            self._event(
                "failure",
                now=now,
                node=req.node_id,
                round=req.round,
                message=f"stale report: {records[0].summary()}",
            )
            failure_log.info(
                "stale failure report for round %d: %s",
                req.round,
                records[0].summary(),
                extra={"node": req.node_id},
            )
            return action(pb.ACTION_KIND_REJOIN, round=self.next_round, reason="a newer round exists")
        if self.suspended:
            # The job is stopping on purpose: a failure now spends no budget, and the node's rejoin waits
            # for the resume (no round completes while suspended).
            summary = records[0].summary()
            self._event("failure", now=now, node=req.node_id, message=f"while suspended: {summary}")
            self._open_round(f"failure while suspended: {summary}", now=now)
            return action(pb.ACTION_KIND_REJOIN, round=self.next_round, reason="the job is suspended")
        if req.kind == pb.FAILURE_KIND_HANG:
            for f in req.failures:
                side = f.hang.side if f.HasField("hang") and f.hang.side in hang.SIDES else "beacon"
                self.stats.hang_verdicts[side] = self.stats.hang_verdicts.get(side, 0) + 1
        return self._handle_failure(node, records, now=now, suspects=self._hang_suspects(req))

    def _hang_suspects(self, req: pb.ReportFailureRequest) -> tuple[hang.Suspects, list[str]] | None:
        """For a hang report: the ranks that never entered the collective the others wait in, and their nodes,
        from the ranks' last activities of this round (the report's own evidence is the freshest)."""
        if req.kind != pb.FAILURE_KIND_HANG:
            return None
        known = {r: (n, a) for r, (n, rnd, a) in self.activities.items() if rnd == self.round_number}
        for f in req.failures:
            if f.HasField("hang") and f.hang.HasField("activity"):
                known[f.rank] = (req.node_id, f.hang.activity)
        found = hang.find_suspects({r: a for r, (_, a) in known.items()})
        if found is None:
            return None
        return found, sorted({known[r][0] for r in found.ranks})

    def _handle_failure(
        self,
        node: Node,
        records: list[FailureRecord],
        *,
        now: float,
        suspects: tuple[hang.Suspects, list[str]] | None = None,
    ) -> pb.Action:
        self.round_failures.extend(records)
        # A hang counts against the node the evidence at hand singles out (a stopped rank in the stacks sent
        # so far, the recorder's suspects), never merely the node that noticed it: it may be the victim.
        hung = any(r.kind == "hang" or r.failure_class == "hang" for r in records)
        blame = self._hang_blame(suspects) if hung else None
        suspect = blame.node if blame is not None else ""
        decision = decide_failure(
            PolicyInput(
                node_id=node.node_id,
                report=records,
                round_records=self.round_failures,
                members=self.members,
                world_size=self.round.world_size if self.round else 0,
                restart_count=self.restart_count,
                max_restarts=self.settings.restart.max_restarts,
                eviction_count=len(self.evictions),
                max_evictions=self.settings.restart.max_evictions,
                hang_suspect=suspect,
                hang_blame_why=blame.why if blame is not None else "",
                suspect_hang_count=self.hang_counts.get(suspect, 0),
                already_restarting=self.round_open,
                user_error_window_s=self.settings.user_error_window_s,
            ),
            now=now,
        )
        previous = self.root_cause
        if decision.root is not None:
            self.root_cause = decision.root.to_json()
            self.root_cause["explanation"] = explain_cause(self.round_failures)
            pending = self.pending_restart
            if pending is not None and pending.round == decision.root.round:
                # The restart's event, still waiting, names the better cause: no revision needed.
                pending.node, pending.rank = decision.root.node_id, decision.root.rank
                pending.message = f"worker failure: {self.root_cause['explanation']}"
                if self.recovery.current is not None and decision.root.unix > 0:
                    self.recovery.current.failed = min(decision.root.unix, self.recovery.current.started)
            else:
                self._revise_cause(previous, decision.root, now=now)
        first = root_cause(records) or records[0]  # the report's own cause, not the echo it also carries
        summary = first.summary()
        if suspects is not None:
            found, nodes = suspects
            summary += f"; suspects: {found.describe()}, on {', '.join(nodes)}"
            if decision.root is not None and self.root_cause is not None:
                self.root_cause["suspects"] = {
                    "ranks": found.ranks,
                    "nodes": nodes,
                    "collective": found.op,
                    "group": found.group,
                    "seq": found.seq,
                }
        self._event("failure", now=now, node=node.node_id, rank=first.rank, message=summary)
        self._settle_restart_event(now=now)
        failure_log.error(
            "failure of %s; root cause of round %d: %s; decision: %s (%s)",
            first.summary(),
            self.round_number,
            decision.root.summary() if decision.root else "?",
            decision.verdict.value,
            decision.reason,
            extra={"node": node.node_id, "round": self.round_number},
        )
        self._changed(durable=True)
        if decision.verdict is Verdict.FAIL:
            self._finish(Phase.FAILED, decision.reason, now=now)
            return action(
                pb.ACTION_KIND_EXIT, round=self.round_number, exit_code=1, reason=self._end_reason()
            )
        if decision.verdict is Verdict.EVICT and decision.blamed and decision.blamed != node.node_id:
            blamed = self.nodes.get(decision.blamed)
            if blamed is not None and blamed.status == ALIVE:
                was_member = blamed.node_id in self.members
                if self._request_eviction(blamed, kind=decision.evict_kind, reason=decision.reason, now=now):
                    if was_member:
                        self._open_round(f"evicted {blamed.node_id}: {decision.reason}", now=now)
                    return action(pb.ACTION_KIND_REJOIN, round=self.next_round, reason=decision.reason)
        if decision.verdict is Verdict.EVICT:
            was_member = node.node_id in self.members
            if (
                self._request_eviction(node, kind=decision.evict_kind, reason=decision.reason, now=now)
                and was_member
            ):
                self._open_round(f"evicted {node.node_id}: {decision.reason}", now=now)
            return action(pb.ACTION_KIND_EXIT, exit_code=1, reason=node.exit_reason or self._end_reason())
        if decision.verdict is Verdict.RESTART:
            self.restart_count += 1
            failed_at = decision.root.unix if decision.root is not None else 0.0
            self.recovery.start(now=now, failed=failed_at, step=self.max_step)
            if decision.dump_stacks or decision.root is None:
                # A hang's event names its suspects already; it goes out at once.
                self._event("restart", now=now, node=node.node_id, message=decision.reason)
                if decision.dump_stacks:
                    self._start_hang_analysis(
                        node.node_id,
                        charged=decision.blamed,
                        suspect_nodes=suspects[1] if suspects is not None else [],
                        now=now,
                    )
            else:
                self._emit_restart()  # one still waiting from an earlier round goes first
                root = decision.root
                self.pending_restart = PendingRestart(
                    round=self.round_number,
                    at=now,
                    node=root.node_id,
                    rank=root.rank,
                    message=decision.reason,
                )
            self._open_round(decision.reason, now=now)
            self._settle_restart_event(now=now)
        return action(pb.ACTION_KIND_REJOIN, round=self.next_round, reason=decision.reason)

    def tick(self, *, now: float) -> None:
        super().tick(now=now)
        self._settle_restart_event(now=now)
        if not self.round_open and (self.joiners or self.fold_in_wait is not None):
            # Steps arrive with heartbeats and the maximum wait ends with time: a boundary is seen here.
            self._maybe_fold_in(now=now)

    def _event(
        self, kind: str, *, now: float, node: str = "", rank: int = -1, round: int = -1, message: str = ""
    ) -> None:
        if kind not in HOLDS_RESTART_EVENT:
            self._emit_restart()
        if kind == "round_complete":
            self.recovery.reformed(now=now)
        elif kind == "round_open" and self.round is not None:
            cur = self.recovery.current
            if cur is None or cur.reformed > 0:  # not a restart's own round: a node lost, evicted, added
                self.recovery.start(now=now, failed=0.0, step=self.max_step)
        super()._event(kind, now=now, node=node, rank=rank, round=round, message=message)

    def _settle_restart_event(self, *, now: float) -> None:
        """Emits the pending restart event once the round's root cause is settled."""
        pending = self.pending_restart
        if pending is None:
            return
        reported = {r.node_id for r in self.round_failures} if pending.round == self.round_number else set()
        members = self.round.node_ids if self.round is not None and pending.round == self.round_number else []
        if rootcause.settled(waited_s=now - pending.at, reported=reported, members=members):
            self._emit_restart()

    def _emit_restart(self) -> None:
        """The pending restart event, dated when the restart was decided."""
        pending, self.pending_restart = self.pending_restart, None
        if pending is not None:
            super()._event(
                "restart",
                now=pending.at,
                node=pending.node,
                rank=pending.rank,
                round=pending.round,
                message=pending.message,
            )

    def _revise_cause(self, previous: dict[str, Any] | None, root: FailureRecord, *, now: float) -> None:
        """Says so when a later report of the round names a better root cause than the one the restart (or
        an earlier report) went by: e.g. the node whose rank was SIGKILLed reports after a node whose ranks
        lost their peer. The round restarts once; only the recorded cause and this event change."""
        if previous is None or previous.get("round") != root.round or _same_failure(previous, root):
            return
        self._event(
            "root_cause",
            now=now,
            node=root.node_id,
            rank=root.rank,
            round=root.round,
            message=f"revised: {self.root_cause['explanation'] if self.root_cause else root.summary()}",
        )

    def _revise_failed_job(self, req: pb.ReportFailureRequest, *, now: float) -> None:
        """A report of the round that failed the job, arriving after it (its restart budget was spent on
        a peer's echo, reported first): the recorded cause and the job's reason, which the ElasticJob's
        status shows, name the better root cause it brings."""
        if self.phase != Phase.FAILED or req.round != self.round_number or req.node_id not in self.members:
            return
        previous = self.root_cause
        before = str(previous.get("explanation", "")) if previous else ""
        self.round_failures.extend(records_from_request(req, now=now))
        root = root_cause(self.round_failures)
        if root is None or _same_failure(previous, root):
            return
        explanation = explain_cause(self.round_failures)
        self.root_cause = {**root.to_json(), "explanation": explanation}
        if before and before in self.reason:
            self.reason = self.reason.replace(before, explanation)
        self._revise_cause(previous, root, now=now)
        self._changed(durable=True)

    def _hang_blame(self, suspects: tuple[hang.Suspects, list[str]] | None) -> hang.Blame:
        """The node a hang reported now counts against, from the evidence already in: the recorder's
        suspects and the stacks (with process states) sent before the report, the reporter's among them."""
        early_round, early = self.early_stacks
        states = (
            {n: {r: s.process_state for r, s in ranks.items()} for n, ranks in early.items()}
            if early_round == self.round_number
            else {}
        )
        return hang.blame(
            members=self.members,
            stopped=hang.stopped_ranks(states),
            suspect_nodes=suspects[1] if suspects is not None else [],
        )

    def _start_hang_analysis(
        self, node_id: str, *, charged: str, suspect_nodes: list[str], now: float
    ) -> None:
        """Asks the members of the round ``node_id`` found hung for their stacks; ``charged``: the node the
        hang was counted against at once ("": none yet, the analysis may charge one)."""
        if charged:
            self.hang_counts[charged] = self.hang_counts.get(charged, 0) + 1
        early_round, early = self.early_stacks
        stacks = (
            {n: s for n, s in early.items() if n in self.members} if early_round == self.round_number else {}
        )
        self.early_stacks = (0, {})
        self.hang = HangInquiry(
            round=self.round_number,
            node=node_id,
            requested_at=now,
            members=self.members,
            stacks=stacks,
            charged=charged,
            suspect_nodes=list(suspect_nodes),
        )
        dump = action(pb.ACTION_KIND_DUMP_STACKS, round=self.round_number, reason=f"hang on {node_id}")
        missing = [m for m in self.members if m not in stacks and m != node_id and m in self.nodes]
        for member in missing:
            self._push(self.nodes[member], [dump])
        counted = f"counted against {charged}" if charged else "counted against no node until the stacks say"
        asked = f"asked {len(missing)} member(s) for their stacks; {len(stacks)} had sent them"
        self._event("hang", now=now, node=charged or node_id, message=f"{asked}; {counted}")
        if set(self.members) <= set(stacks):
            self._analyze_hang(now=now)

    def report_completion(self, req: pb.ReportCompletionRequest, *, now: float) -> pb.Action:
        node = self._node(req.node_id, req.incarnation)
        leave = self._exitaction(node, req.incarnation)
        if leave is not None:
            return leave
        node.last_seen = now
        if req.round != self.round_number or req.node_id not in self.members:
            return action(pb.ACTION_KIND_REJOIN, round=self.next_round, reason="a newer round exists")
        if self.round_open:
            return action(pb.ACTION_KIND_REJOIN, round=self.next_round, reason="a new round is open")
        if req.node_id not in self.completed:
            self.completed.add(req.node_id)
            self._event("node_completed", now=now, node=req.node_id)
            self._changed(durable=True)
        if self._maybe_succeed(now=now):
            return action(
                pb.ACTION_KIND_EXIT, round=self.round_number, exit_code=0, reason=self._end_reason()
            )
        return action(pb.ACTION_KIND_NONE)

    def _maybe_succeed(self, *, now: float) -> bool:
        """Succeeds the job once every member of the round completed it, or joined it as training ended
        (see :func:`rendezvous.untrained_newcomers`; a newcomer's heartbeat may tell that after the
        others' completions)."""
        if not self.completed or self.round is None or self.round_open or self.finished:
            return False
        idle = rdzv.untrained_newcomers(
            self.round,
            completed=self.completed,
            steps={n: [r.step for r in self.nodes[n].ranks] for n in self.members if n in self.nodes},
        )
        if not self.completed | idle >= set(self.members):
            return False
        reason = f"all {len(self.members)} nodes completed round {self.round_number}"
        if idle:
            reason = (
                f"{len(self.completed)} of {len(self.members)} nodes completed round {self.round_number}; "
                f"{', '.join(sorted(idle))} joined it as training ended and had nothing left to train"
            )
        self._finish(Phase.SUCCEEDED, reason, now=now)
        return True

    def report_checkpoint(
        self, req: pb.ReportCheckpointRequest, *, now: float
    ) -> pb.ReportCheckpointResponse:
        node = self._node(req.node_id, req.incarnation)
        persist_step = -1
        if req.state == pb.CHECKPOINT_STATE_PERSISTED:
            if self.checkpoints.persisted(step=req.step, ranks=req.ranks, world_size=req.world_size):
                self._event(
                    "checkpoint_committed",
                    now=now,
                    node=req.node_id,
                    message=f"step {req.step} at {req.path}",
                )
                log.info(
                    "checkpoint step %d committed",
                    req.step,
                    extra={"node": req.node_id, "round": self.round_number},
                )
                self._changed(durable=True)
                self.commit_times = (self.commit_times[1], now)
                if self.fold_in_wait is not None:
                    self._maybe_fold_in(now=now)  # a checkpoint was just taken: a boundary
        elif req.state == pb.CHECKPOINT_STATE_FAILED:
            self.stats.checkpoint_failures += 1
            self._event(
                "checkpoint_failed", now=now, node=req.node_id, message=f"step {req.step}: {req.error}"
            )
            failure_log.warning(
                "persisting checkpoint step %d failed: %s",
                req.step,
                req.error[:1000],
                extra={"node": req.node_id, "round": self.round_number},
            )
        elif req.state == pb.CHECKPOINT_STATE_IN_MEMORY:
            if node.status != ALIVE or req.incarnation != node.incarnation:
                # An evicted node (a bad GPU, a hang) leaves the job's state to the survivors: what it holds
                # must not become part of a committed step.
                raise RequestError(
                    f"{req.node_id} is {node.status}: it leaves the job's state to the survivors",
                    code="failed_precondition",
                )
            node.memory_checkpoint_step = max(node.memory_checkpoint_step, req.step)
            self.snapshots = foldin.cadence([req.held_steps]) or self.snapshots
            self._changed()
            if req.round > 0:
                persist_step = self._breakpoint_report(req, now=now)
        return pb.ReportCheckpointResponse(
            committed_checkpoint_step=self.checkpoints.committed, persist_step=persist_step
        )

    def _breakpoint_report(self, req: pb.ReportCheckpointRequest, *, now: float) -> int:
        """Records what a node of a broken round holds (see :mod:`phalanx.master.breakpoints`); the step it
        must persist, or -1 while some member has not reported."""
        bp = self.breakpoint
        if bp is None or bp.round < req.round:
            if req.round != self.round_number:
                return -1  # a round that is not the running one: its members are not known any more
            bp = self.breakpoint = Breakpoint(round=req.round, members=frozenset(self.members))
        elif bp.round > req.round:
            return -1  # a late report of an older breakpoint
        if bp.step is not None:  # agreed already (a node reporting twice, or a straggler)
            return bp.step if bp.step in req.held_steps else -1
        bp.report(req.node_id, held=req.held_steps, persisting=req.step)
        self._settle_breakpoint(now=now, answered=req.node_id)
        return -1 if bp.step is None else bp.step

    def report_probe(self, req: pb.ReportProbeRequest, *, now: float) -> None:
        node = self._node(req.node_id, req.incarnation)
        if req.incarnation != node.incarnation:
            return  # a replaced agent's results say nothing about the node now
        kind = pb.ProbeKind.Name(req.probe).removeprefix("PROBE_KIND_").lower()
        node.probes[kind] = [
            {
                "peer_node_id": m.peer_node_id,
                "ok": m.ok,
                "elapsed_s": m.elapsed_s,
                "rate": m.rate,
                "error": m.error,
                "unix": now,
                "probe_round": req.probe_round,
            }
            for m in req.measurements
        ]
        self.probe_report(req, now=now)
        self._changed()

    def report_stacks(self, req: pb.ReportStacksRequest, *, now: float) -> None:
        self._node(req.node_id, req.incarnation)
        stacks = {r.rank: r for r in req.ranks}
        hang = self.hang
        if hang is None or req.round != hang.round:
            if req.round == self.round_number and req.node_id in self.members:
                early_round, early = self.early_stacks
                self.early_stacks = (
                    req.round,
                    {**(early if early_round == req.round else {}), req.node_id: stacks},
                )
            return
        hang.stacks[req.node_id] = stacks
        if set(hang.members) <= set(hang.stacks):
            self._analyze_hang(now=now)
