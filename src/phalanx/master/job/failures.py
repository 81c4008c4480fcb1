"""Failure reports: what the failure policy (:func:`phalanx.master.decide.failure_policy.decide_failure`)
makes of them (restart, evict, fail), the round's root cause, and the reporter's answer.

:func:`plan_failure` is a pure function of the job's state and the report: it returns what to do as
:mod:`phalanx.master.job.effects` and what to answer; :class:`Failures` has the job's writer apply it, once
per report.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from phalanx.api.elasticjob import Phase
from phalanx.api.v1 import master_pb2 as pb
from phalanx.diagnostics import hang
from phalanx.master.decide.failure_policy import (
    Decision,
    FailureRecord,
    PolicyInput,
    Verdict,
    decide_failure,
    explain_cause,
    records_from_request,
    root_cause,
)
from phalanx.master.job import effects as fx
from phalanx.master.job import hangs
from phalanx.master.job.answers import action, ending, exit_action
from phalanx.master.job.core import JobCore, failure_log
from phalanx.master.state.jobstate import JobState, PendingRestart
from phalanx.master.state.nodes import ALIVE, Node

__all__ = ["Failures", "Plan", "plan_failure"]


@dataclass(frozen=True)
class Plan:
    """What a failure report leads to: the effects, in order, and the reporter's action."""

    effects: list[fx.Effect]
    answer: pb.Action


class Failures:
    """Failure reports: each planned from the state, then applied by the job's writer."""

    def __init__(self, core: JobCore) -> None:
        self.core = core

    def report_failure(self, req: pb.ReportFailureRequest, *, now: float) -> pb.Action:
        plan = plan_failure(self.core.state, req, now=now)
        self.core.apply(plan.effects, now=now)
        return plan.answer

    def handle(self, node: Node, records: list[FailureRecord], *, now: float) -> None:
        """A failure of the running round the master found itself (``node``'s agent restarted)."""
        plan = _judge(self.core.state, node, records, found=None, evidence=None, effects=[], now=now)
        self.core.apply(plan.effects, now=now)


def _same_failure(recorded: dict[str, Any] | None, root: FailureRecord) -> bool:
    """Whether the recorded root cause (JSON) is ``root``'s failure."""
    if recorded is None:
        return False
    return (recorded.get("node_id"), recorded.get("rank")) == (root.node_id, root.rank)


def plan_failure(s: JobState, req: pb.ReportFailureRequest, *, now: float) -> Plan:
    """What ``req`` leads to; RequestError for an unknown node or incarnation."""
    node = s.node(req.node_id, req.incarnation)
    leave = exit_action(s, node, req.incarnation)
    if leave is not None:
        return Plan(_revise_failed_job(s, req, now=now), leave)
    records = records_from_request(req, now=now)
    effects: list[fx.Effect] = [fx.SeeNode(node.node_id)]
    effects += [fx.Tally("failures", rec.failure_class.label) for rec in records]
    evidence = [v for v in map(hang.evidence_view, req.failures) if v is not None] or None
    summary = records[0].summary()
    if req.round != s.round_number or req.node_id not in s.members:
        failure_log.info(
            "stale failure report for round %d: %s", req.round, summary, extra={"node": req.node_id}
        )
        stale = fx.Emit(
            "failure", f"stale report: {summary}", node=req.node_id, round=req.round, hang=evidence
        )
        effects.append(stale)
        return Plan(effects, action(pb.ACTION_KIND_REJOIN, round=s.next_round, reason="a newer round exists"))
    if s.suspended:
        # The job is stopping on purpose: a failure now spends no budget, and the node's rejoin waits for
        # the resume (no round completes while suspended).
        effects += [
            fx.Emit("failure", f"while suspended: {summary}", node=req.node_id, hang=evidence),
            fx.OpenRound(f"failure while suspended: {summary}"),
        ]
        return Plan(effects, action(pb.ACTION_KIND_REJOIN, round=s.next_round, reason="the job is suspended"))
    # A hang counts against the node the evidence at hand singles out (a stopped rank in the stacks sent so
    # far, the recorder's suspects), never merely the node that noticed it: it may be the victim.
    found = hangs.evidence(s, req) if any(r.hung for r in records) else None
    if req.kind == pb.FAILURE_KIND_HANG:
        for f in req.failures:
            side = f.hang.side if f.HasField("hang") and f.hang.side in hang.SIDES else "beacon"
            effects.append(fx.Tally("hang_verdicts", side))
    return _judge(s, node, records, found=found, evidence=evidence, effects=effects, now=now)


def _judge(
    s: JobState,
    node: Node,
    records: list[FailureRecord],
    *,
    found: hangs.HangEvidence | None,
    evidence: list[dict[str, Any]] | None,
    effects: list[fx.Effect],
    now: float,
) -> Plan:
    """The policy's decision on a report of the running round, and what carrying it out takes."""
    round_records = [*s.round_failures, *records]
    suspects = found.suspects if found is not None else None
    blame = found.blame if found is not None else None
    suspect = blame.node if blame is not None else ""
    decision = decide_failure(
        PolicyInput(
            node_id=node.node_id,
            report=records,
            round_records=round_records,
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
    effects.append(fx.NoteFailures(tuple(records)))
    effects += _root_cause(s, decision, round_records, suspects=suspects, now=now)
    first = root_cause(records) or records[0]  # the report's own cause, not the echo it also carries
    summary = first.summary()
    if suspects is not None:
        ranks, nodes = suspects
        summary += f"; suspects: {ranks.describe()}, on {', '.join(nodes)}"
    failure_log.error(
        "failure of %s; root cause of round %d: %s; decision: %s (%s)",
        first.summary(),
        s.round_number,
        decision.root.summary() if decision.root else "?",
        decision.verdict.value,
        decision.reason,
        extra={"node": node.node_id, "round": s.round_number},
    )
    effects += [
        fx.Emit("failure", summary, node=node.node_id, rank=first.rank, hang=evidence),
        fx.SettleRestart(),
        fx.Saved(),
    ]
    return _carry_out(s, node, decision, suspects=suspects, effects=effects, now=now)


def _root_cause(
    s: JobState,
    decision: Decision,
    round_records: list[FailureRecord],
    *,
    suspects: hangs.Suspects | None,
    now: float,
) -> list[fx.Effect]:
    """The round's root cause, as the decision names it; the restart event still waiting names it too, else
    a revision is said when it differs from the one recorded."""
    root = decision.root
    if root is None:
        return []
    cause = {**root.to_json(), "explanation": explain_cause(round_records)}
    if suspects is not None:
        ranks, nodes = suspects
        cause["suspects"] = {
            "ranks": ranks.ranks,
            "nodes": nodes,
            "collective": ranks.op,
            "group": ranks.group,
            "seq": ranks.seq,
        }
    effects: list[fx.Effect] = [fx.SetRootCause(cause)]
    pending = s.pending_restart
    if pending is not None and pending.round == root.round:
        # The restart's event, still waiting, names the better cause: no revision needed.
        message = f"worker failure: {cause['explanation']}"
        effects.append(fx.AmendRestart(root.node_id, root.rank, message, failed=root.unix))
    else:
        effects += _revision(s.root_cause, root, explanation=str(cause["explanation"]))
    return effects


def _carry_out(
    s: JobState,
    node: Node,
    decision: Decision,
    *,
    suspects: hangs.Suspects | None,
    effects: list[fx.Effect],
    now: float,
) -> Plan:
    """Fails the job, evicts the blamed node (or the reporter), or restarts: the effects and the reporter's
    action."""
    rejoin = action(pb.ACTION_KIND_REJOIN, round=s.next_round, reason=decision.reason)
    if decision.verdict is Verdict.FAIL:
        effects.append(fx.Finish(Phase.FAILED, decision.reason))
        ended = ending(Phase.FAILED, decision.reason)
        return Plan(effects, action(pb.ACTION_KIND_EXIT, round=s.round_number, exit_code=1, reason=ended))
    if decision.verdict is Verdict.EVICT:
        blamed = s.nodes.get(decision.blamed) if decision.blamed != node.node_id else None
        if blamed is not None and blamed.status == ALIVE:
            why = f"evicted {blamed.node_id}: {decision.reason}"
            effects.append(fx.Evict(blamed.node_id, decision.evict_kind, decision.reason, reopen_why=why))
            return Plan(effects, rejoin)
        why = f"evicted {node.node_id}: {decision.reason}"
        effects.append(fx.Evict(node.node_id, decision.evict_kind, decision.reason, reopen_why=why))
        exit_reason = f"evicted: {decision.reason}"
        return Plan(effects, action(pb.ACTION_KIND_EXIT, exit_code=1, reason=exit_reason))
    if decision.verdict is Verdict.RESTART:
        effects += _restart(s, node, decision, suspects=suspects, now=now)
    return Plan(effects, rejoin)


def _restart(
    s: JobState, node: Node, decision: Decision, *, suspects: hangs.Suspects | None, now: float
) -> list[fx.Effect]:
    """A restart: its recovery timed from the failure, its event out now (a hang's, which names its
    suspects already) or held until the round's root cause is settled, a new round opened."""
    effects: list[fx.Effect] = [fx.Restart(failed=decision.root.unix if decision.root is not None else 0.0)]
    if decision.dump_stacks or decision.root is None:
        effects.append(fx.Emit("restart", decision.reason, node=node.node_id))
        if decision.dump_stacks:
            effects += hangs.ask_stacks(
                s,
                node.node_id,
                charged=decision.blamed,
                suspect_nodes=suspects[1] if suspects is not None else [],
                now=now,
            )
    else:
        root = decision.root
        pending = PendingRestart(
            round=s.round_number, at=now, node=root.node_id, rank=root.rank, message=decision.reason
        )
        effects.append(fx.HoldRestart(pending))
    return [*effects, fx.OpenRound(decision.reason), fx.SettleRestart()]


def _revision(previous: dict[str, Any] | None, root: FailureRecord, *, explanation: str) -> list[fx.Effect]:
    """Says so when a later report of the round names a better root cause than the one the restart (or an
    earlier report) went by: e.g. the node whose rank was SIGKILLed reports after a node whose ranks lost
    their peer. The round restarts once; only the recorded cause and this event change."""
    if previous is None or previous.get("round") != root.round or _same_failure(previous, root):
        return []
    return [
        fx.Emit("root_cause", f"revised: {explanation}", node=root.node_id, rank=root.rank, round=root.round)
    ]


def _revise_failed_job(s: JobState, req: pb.ReportFailureRequest, *, now: float) -> list[fx.Effect]:
    """A report of the round that failed the job, arriving after it (its restart budget was spent on a
    peer's echo, reported first): the recorded cause and the job's reason, which the ElasticJob's status
    shows, name the better root cause it brings."""
    if s.phase != Phase.FAILED or req.round != s.round_number or req.node_id not in s.members:
        return []
    records = records_from_request(req, now=now)
    round_records = [*s.round_failures, *records]
    effects: list[fx.Effect] = [fx.NoteFailures(tuple(records))]
    previous = s.root_cause
    root = root_cause(round_records)
    if root is None or _same_failure(previous, root):
        return effects
    before = str(previous.get("explanation", "")) if previous else ""
    explanation = explain_cause(round_records)
    reason = s.reason.replace(before, explanation) if before and before in s.reason else None
    effects += [
        fx.SetRootCause({**root.to_json(), "explanation": explanation}, job_reason=reason),
        *_revision(previous, root, explanation=explanation),
        fx.Saved(),
    ]
    return effects
