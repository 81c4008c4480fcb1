"""The job's room for failure reports: it records them, asks :func:`phalanx.master.policy.decide_failure`
what they lead to (restart, evict, fail) and carries the decision out, keeping the round's root cause.

Pure: every method takes ``now`` and does no I/O.
"""

from __future__ import annotations

from typing import Any

from phalanx.api.elasticjob import Phase
from phalanx.api.v1 import master_pb2 as pb
from phalanx.diagnostics import hang
from phalanx.master.core import JobCore, action, failure_log
from phalanx.master.hangs import Hangs
from phalanx.master.membership import ALIVE, Node
from phalanx.master.policy import (
    Decision,
    FailureRecord,
    PolicyInput,
    Verdict,
    decide_failure,
    explain_cause,
    records_from_request,
    root_cause,
)
from phalanx.master.restarts import PendingRestart, Restarts

__all__ = ["Failures"]


def _same_failure(recorded: dict[str, Any] | None, root: FailureRecord) -> bool:
    """Whether the recorded root cause (JSON) is ``root``'s failure."""
    if recorded is None:
        return False
    return (recorded.get("node_id"), recorded.get("rank")) == (root.node_id, root.rank)


class Failures:
    """Failure reports and what the policy makes of them."""

    def __init__(self, core: JobCore, *, hangs: Hangs, restarts: Restarts) -> None:
        self.core = core
        self.state = core.state
        self.hangs = hangs
        self.restarts = restarts

    def report_failure(self, req: pb.ReportFailureRequest, *, now: float) -> pb.Action:
        s, core = self.state, self.core
        node = core.node(req.node_id, req.incarnation)
        leave = core.exitaction(node, req.incarnation)
        if leave is not None:
            self._revise_failed_job(req, now=now)
            return leave
        node.last_seen = now
        records = records_from_request(req, now=now)
        for rec in records:
            label = rec.failure_class.label
            s.stats.failures[label] = s.stats.failures.get(label, 0) + 1
        evidence = [v for v in map(hang.evidence_view, req.failures) if v is not None] or None
        if req.round != s.round_number or req.node_id not in s.members:
            core.event(
                "failure",
                now=now,
                node=req.node_id,
                round=req.round,
                message=f"stale report: {records[0].summary()}",
                hang=evidence,
            )
            failure_log.info(
                "stale failure report for round %d: %s",
                req.round,
                records[0].summary(),
                extra={"node": req.node_id},
            )
            return action(pb.ACTION_KIND_REJOIN, round=s.next_round, reason="a newer round exists")
        if s.suspended:
            # The job is stopping on purpose: a failure now spends no budget, and the node's rejoin waits
            # for the resume (no round completes while suspended).
            summary = records[0].summary()
            core.event(
                "failure", now=now, node=req.node_id, message=f"while suspended: {summary}", hang=evidence
            )
            core.open_round(f"failure while suspended: {summary}", now=now)
            return action(pb.ACTION_KIND_REJOIN, round=s.next_round, reason="the job is suspended")
        if req.kind == pb.FAILURE_KIND_HANG:
            for f in req.failures:
                side = f.hang.side if f.HasField("hang") and f.hang.side in hang.SIDES else "beacon"
                s.stats.hang_verdicts[side] = s.stats.hang_verdicts.get(side, 0) + 1
        return self.handle(node, records, now=now, suspects=self.hangs.suspects(req), evidence=evidence)

    def handle(
        self,
        node: Node,
        records: list[FailureRecord],
        *,
        now: float,
        suspects: tuple[hang.Suspects, list[str]] | None = None,
        evidence: list[dict[str, Any]] | None = None,
    ) -> pb.Action:
        """Decides what ``records`` (a report of ``node``) lead to and carries it out; the agent's action.
        ``evidence``: a hang report's, per rank (:func:`phalanx.diagnostics.hang.evidence_view`)."""
        self.state.round_failures.extend(records)
        decision = self._decide(node, records, suspects=suspects, now=now)
        self._settle_root_cause(decision, now=now)
        self._announce(node, records, decision, suspects=suspects, evidence=evidence, now=now)
        return self._carry_out(node, decision, suspects=suspects, now=now)

    def _decide(
        self,
        node: Node,
        records: list[FailureRecord],
        *,
        suspects: tuple[hang.Suspects, list[str]] | None,
        now: float,
    ) -> Decision:
        """The policy's decision on the report, given the round so far and the job's budgets."""
        s = self.state
        # A hang counts against the node the evidence at hand singles out (a stopped rank in the stacks sent
        # so far, the recorder's suspects), never merely the node that noticed it: it may be the victim.
        hung = any(r.hung for r in records)
        blame = self.hangs.blame(suspects) if hung else None
        suspect = blame.node if blame is not None else ""
        return decide_failure(
            PolicyInput(
                node_id=node.node_id,
                report=records,
                round_records=s.round_failures,
                members=s.members,
                world_size=s.round.world_size if s.round else 0,
                restart_count=s.restart_count,
                max_restarts=s.settings.restart.max_restarts,
                eviction_count=len(s.evictions),
                max_evictions=s.settings.restart.max_evictions,
                hang_suspect=suspect,
                hang_blame_why=blame.why if blame is not None else "",
                suspect_hang_count=s.hang_counts.get(suspect, 0),
                already_restarting=s.round_open,
                user_error_window_s=s.settings.user_error_window_s,
            ),
            now=now,
        )

    def _settle_root_cause(self, decision: Decision, *, now: float) -> None:
        """The round's root cause, as the decision names it; the restart event still waiting names it too,
        else a revision is said."""
        s = self.state
        previous = s.root_cause
        if decision.root is None:
            return
        s.root_cause = decision.root.to_json()
        s.root_cause["explanation"] = explain_cause(s.round_failures)
        pending = self.restarts.pending
        if pending is not None and pending.round == decision.root.round:
            # The restart's event, still waiting, names the better cause: no revision needed.
            pending.node, pending.rank = decision.root.node_id, decision.root.rank
            pending.message = f"worker failure: {s.root_cause['explanation']}"
            if s.recovery.current is not None and decision.root.unix > 0:
                s.recovery.current.failed = min(decision.root.unix, s.recovery.current.started)
        else:
            self._revise_cause(previous, decision.root, now=now)

    def _announce(
        self,
        node: Node,
        records: list[FailureRecord],
        decision: Decision,
        *,
        suspects: tuple[hang.Suspects, list[str]] | None,
        evidence: list[dict[str, Any]] | None,
        now: float,
    ) -> None:
        """The failure's event (with the suspects and the evidence a hang report carried) and its log
        line."""
        s, core = self.state, self.core
        first = root_cause(records) or records[0]  # the report's own cause, not the echo it also carries
        summary = first.summary()
        if suspects is not None:
            found, nodes = suspects
            summary += f"; suspects: {found.describe()}, on {', '.join(nodes)}"
            if decision.root is not None and s.root_cause is not None:
                s.root_cause["suspects"] = {
                    "ranks": found.ranks,
                    "nodes": nodes,
                    "collective": found.op,
                    "group": found.group,
                    "seq": found.seq,
                }
        core.event("failure", now=now, node=node.node_id, rank=first.rank, message=summary, hang=evidence)
        self.restarts.settle(now=now)
        failure_log.error(
            "failure of %s; root cause of round %d: %s; decision: %s (%s)",
            first.summary(),
            s.round_number,
            decision.root.summary() if decision.root else "?",
            decision.verdict.value,
            decision.reason,
            extra={"node": node.node_id, "round": s.round_number},
        )
        core.changed(durable=True)

    def _carry_out(
        self,
        node: Node,
        decision: Decision,
        *,
        suspects: tuple[hang.Suspects, list[str]] | None,
        now: float,
    ) -> pb.Action:
        """Fails the job, evicts the blamed node (or the reporter), or restarts: the reporter's action."""
        s, core = self.state, self.core
        if decision.verdict is Verdict.FAIL:
            core.finish(Phase.FAILED, decision.reason, now=now)
            return action(pb.ACTION_KIND_EXIT, round=s.round_number, exit_code=1, reason=core.end_reason())
        if decision.verdict is Verdict.EVICT and decision.blamed and decision.blamed != node.node_id:
            blamed = s.nodes.get(decision.blamed)
            if blamed is not None and blamed.status == ALIVE:
                why = f"evicted {blamed.node_id}: {decision.reason}"
                if core.evict_and_reopen(
                    blamed, kind=decision.evict_kind, reason=decision.reason, why=why, now=now
                ):
                    return action(pb.ACTION_KIND_REJOIN, round=s.next_round, reason=decision.reason)
        if decision.verdict is Verdict.EVICT:
            why = f"evicted {node.node_id}: {decision.reason}"
            core.evict_and_reopen(node, kind=decision.evict_kind, reason=decision.reason, why=why, now=now)
            return action(pb.ACTION_KIND_EXIT, exit_code=1, reason=node.exit_reason or core.end_reason())
        if decision.verdict is Verdict.RESTART:
            self._restart(node, decision, suspects=suspects, now=now)
        return action(pb.ACTION_KIND_REJOIN, round=s.next_round, reason=decision.reason)

    def _restart(
        self,
        node: Node,
        decision: Decision,
        *,
        suspects: tuple[hang.Suspects, list[str]] | None,
        now: float,
    ) -> None:
        """A restart: its recovery timed from the failure, its event out now (a hang's, which names its
        suspects already) or held until the round's root cause is settled, a new round opened."""
        s, core = self.state, self.core
        s.restart_count += 1
        failed_at = decision.root.unix if decision.root is not None else 0.0
        s.recovery.start(now=now, failed=failed_at, step=s.max_step)
        if decision.dump_stacks or decision.root is None:
            core.event("restart", now=now, node=node.node_id, message=decision.reason)
            if decision.dump_stacks:
                self.hangs.start_analysis(
                    node.node_id,
                    charged=decision.blamed,
                    suspect_nodes=suspects[1] if suspects is not None else [],
                    now=now,
                )
        else:
            self.restarts.emit()  # one still waiting from an earlier round goes first
            root = decision.root
            self.restarts.pending = PendingRestart(
                round=s.round_number, at=now, node=root.node_id, rank=root.rank, message=decision.reason
            )
        core.open_round(decision.reason, now=now)
        self.restarts.settle(now=now)

    def _revise_cause(self, previous: dict[str, Any] | None, root: FailureRecord, *, now: float) -> None:
        """Says so when a later report of the round names a better root cause than the one the restart (or
        an earlier report) went by: e.g. the node whose rank was SIGKILLed reports after a node whose ranks
        lost their peer. The round restarts once; only the recorded cause and this event change."""
        if previous is None or previous.get("round") != root.round or _same_failure(previous, root):
            return
        s = self.state
        self.core.event(
            "root_cause",
            now=now,
            node=root.node_id,
            rank=root.rank,
            round=root.round,
            message=f"revised: {s.root_cause['explanation'] if s.root_cause else root.summary()}",
        )

    def _revise_failed_job(self, req: pb.ReportFailureRequest, *, now: float) -> None:
        """A report of the round that failed the job, arriving after it (its restart budget was spent on
        a peer's echo, reported first): the recorded cause and the job's reason, which the ElasticJob's
        status shows, name the better root cause it brings."""
        s = self.state
        if s.phase != Phase.FAILED or req.round != s.round_number or req.node_id not in s.members:
            return
        previous = s.root_cause
        before = str(previous.get("explanation", "")) if previous else ""
        s.round_failures.extend(records_from_request(req, now=now))
        root = root_cause(s.round_failures)
        if root is None or _same_failure(previous, root):
            return
        explanation = explain_cause(s.round_failures)
        s.root_cause = {**root.to_json(), "explanation": explanation}
        if before and before in s.reason:
            s.reason = s.reason.replace(before, explanation)
        self._revise_cause(previous, root, now=now)
        self.core.changed(durable=True)
