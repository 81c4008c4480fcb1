"""Hangs: who a reported hang counts against, the members' stacks it asks for, and the analysis of those
stacks (:func:`phalanx.diagnostics.stacks.compare_stacks`, :func:`.hang.blame`).

A hang counts against the node the evidence singles out (a stopped rank, the interval recorder's suspects, odd
stacks), never merely the node that noticed it; a node's second hang evicts it. The decisions are pure
functions of the job's state that return :mod:`phalanx.master.job.effects`; :class:`Hangs` takes the stacks
the members send and has the job's writer apply what the analysis decides.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from phalanx.api.v1 import master_pb2 as pb
from phalanx.api.verdicts import HangAnalysis
from phalanx.diagnostics import hang
from phalanx.diagnostics.stacks import compare_stacks
from phalanx.master.job import effects as fx
from phalanx.master.job.answers import action
from phalanx.master.job.core import JobCore, failure_log
from phalanx.master.state.jobstate import HangInquiry, JobState
from phalanx.master.state.nodes import ALIVE

__all__ = ["HangEvidence", "Hangs", "analysis", "ask_stacks", "evidence"]

Suspects = tuple[hang.Suspects, list[str]]
"""The ranks that never entered the collective the others wait in, and their nodes."""


@dataclass(frozen=True)
class HangEvidence:
    """What the evidence at hand says of a hang report: its suspects and the node it counts against."""

    suspects: Suspects | None
    blame: hang.Blame


def evidence(state: JobState, req: pb.ReportFailureRequest) -> HangEvidence:
    """For a hang report: the suspects, from the ranks' last activities of this round (the report's own
    evidence is the freshest), and the node the hang counts against, from them and the stacks (with
    process states) sent before the report, the reporter's among them."""
    return HangEvidence(found := suspects(state, req), blame(state, found))


def suspects(state: JobState, req: pb.ReportFailureRequest) -> Suspects | None:
    if req.kind != pb.FAILURE_KIND_HANG:
        return None
    round_number = state.round_number
    known = {r: (n, a) for r, (n, rnd, a) in state.activities.items() if rnd == round_number}
    for f in req.failures:
        if f.HasField("hang") and f.hang.HasField("activity"):
            known[f.rank] = (req.node_id, f.hang.activity)
    found = hang.find_suspects({r: a for r, (_, a) in known.items()})
    if found is None:
        return None
    return found, sorted({known[r][0] for r in found.ranks})


def blame(state: JobState, found: Suspects | None) -> hang.Blame:
    early_round, early = state.early_stacks
    states = (
        {n: {r: s.process_state for r, s in ranks.items()} for n, ranks in early.items()}
        if early_round == state.round_number
        else {}
    )
    return hang.blame(
        members=state.members,
        stopped=hang.stopped_ranks(states),
        suspect_nodes=found[1] if found is not None else [],
    )


def ask_stacks(
    state: JobState, node_id: str, *, charged: str, suspect_nodes: list[str], now: float
) -> list[fx.Effect]:
    """A hang analysis of the round ``node_id`` found hung: the members are asked for their stacks (those
    sent early count), and with every member's stacks at hand it ends at once. ``charged``: the node the
    hang was counted against at once ("": none yet, the analysis may charge one)."""
    early_round, early = state.early_stacks
    members = state.members
    stacks = {n: st for n, st in early.items() if n in members} if early_round == state.round_number else {}
    inquiry = HangInquiry(
        round=state.round_number,
        node=node_id,
        requested_at=now,
        members=members,
        stacks=stacks,
        charged=charged,
        suspect_nodes=list(suspect_nodes),
    )
    dump = action(pb.ACTION_KIND_DUMP_STACKS, round=state.round_number, reason=f"hang on {node_id}")
    ask = tuple(m for m in members if m not in stacks and m != node_id and m in state.nodes)
    counted = f"counted against {charged}" if charged else "counted against no node until the stacks say"
    message = f"asked {len(ask)} member(s) for their stacks; {len(stacks)} had sent them; {counted}"
    effects: list[fx.Effect] = [fx.AskStacks(inquiry=inquiry, ask=ask, dump=dump, message=message)]
    if set(members) <= set(stacks):
        counts = dict(state.hang_counts)
        if charged:
            counts[charged] = counts.get(charged, 0) + 1
        effects += analysis(state, inquiry, hang_counts=counts, now=now)
    return effects


def analysis(
    state: JobState, inquiry: HangInquiry, *, hang_counts: dict[str, int], now: float
) -> list[fx.Effect]:
    """The end of ``inquiry``: the stacks compared, the hang moved to the node the evidence singles out
    (or off the node charged when it was reported), and a node's second hang evicts it. ``hang_counts``:
    the counts the inquiry's own charge is in."""
    texts = {n: {r: st.stacks for r, st in ranks.items()} for n, ranks in inquiry.stacks.items()}
    verdict = compare_stacks(texts)  # no fallback to the reporter: two stacks that tie name nobody
    states = {n: {r: st.process_state for r, st in ranks.items()} for n, ranks in inquiry.stacks.items()}
    found = hang.blame(
        members=inquiry.members,
        stopped=hang.stopped_ranks(states),
        suspect_nodes=inquiry.suspect_nodes,
        odd_nodes=verdict.odd_nodes,
    )
    counted = f"counted against {found.node}" if found.node else "counted against no node"
    reason = f"{verdict.reason}; {counted}: {found.why}"
    analysed = HangAnalysis(
        round=inquiry.round,
        hung_node=inquiry.node,
        odd_nodes=list(verdict.odd_nodes),
        odd_ranks=sorted(verdict.odd_ranks),
        nodes_reported=sorted(inquiry.stacks),
        reason=reason,
        blamed=found.node,
    )
    effects: list[fx.Effect] = [
        fx.RecordHangAnalysis(analysed),
        fx.Emit("hang_analysis", reason, node=found.node, round=inquiry.round, log=failure_log.warning),
    ]
    if found.node != inquiry.charged:
        if inquiry.charged:
            effects.append(fx.ChargeHang(inquiry.charged, -1))
        if found.node:
            effects.append(fx.ChargeHang(found.node, 1))
            count = hang_counts.get(found.node, 0) + 1
            culprit = state.nodes.get(found.node)
            if count >= 2 and culprit is not None and culprit.status == ALIVE:
                why = f"{found.node} hung {count} times ({found.why})"
                effects.append(
                    fx.Evict(
                        found.node, "hang", why, reopen_why=f"evicted {found.node}: {why}", joiners_too=True
                    )
                )
    effects.append(fx.Saved())
    return effects


class Hangs:
    """The members' stacks as they arrive, and the analysis they complete."""

    def __init__(self, core: JobCore) -> None:
        self.core = core
        self.state = core.state

    def report_stacks(self, req: pb.ReportStacksRequest, *, now: float) -> None:
        """A member's stacks: for the pending analysis (which ends once every member's are in), or kept for
        one its round may start (the stacks of an agent that found a hang come before its report)."""
        s = self.state
        s.node(req.node_id, req.incarnation)
        stacks = {r.rank: r for r in req.ranks}
        inquiry = s.hang
        if inquiry is None or req.round != inquiry.round:
            if req.round == s.round_number and req.node_id in s.members:
                self.core.apply([fx.KeepStacks(req.node_id, req.round, stacks)], now=now)
            return
        inquiry = replace(inquiry, stacks={**inquiry.stacks, req.node_id: stacks})
        effects: list[fx.Effect] = [fx.KeepStacks(req.node_id, req.round, stacks)]
        if set(inquiry.members) <= set(inquiry.stacks):
            effects += analysis(s, inquiry, hang_counts=s.hang_counts, now=now)
        self.core.apply(effects, now=now)

    def conclude(self, *, now: float) -> None:
        """Ends the pending analysis with the stacks it has (all of them, or its time is up)."""
        inquiry = self.state.hang
        if inquiry is not None:
            self.core.apply(
                analysis(self.state, inquiry, hang_counts=self.state.hang_counts, now=now), now=now
            )
