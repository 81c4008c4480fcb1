"""The job's room for hangs: who a reported hang counts against, the members' stacks it asks for, and the
analysis of those stacks (:func:`phalanx.diagnostics.stacks.compare_stacks`, :func:`.hang.blame`).

A hang counts against the node the evidence singles out (a stopped rank, the interval recorder's suspects,
odd stacks), never merely the node that noticed it; a node's second hang evicts it. Pure: every method takes
``now`` and does no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from phalanx.api.v1 import master_pb2 as pb
from phalanx.api.verdicts import HangAnalysis
from phalanx.diagnostics import hang
from phalanx.diagnostics.stacks import compare_stacks
from phalanx.master.core import JobCore, action, failure_log
from phalanx.master.membership import ALIVE

__all__ = ["HangInquiry", "Hangs"]


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


class Hangs:
    """The hang evidence of the running round and the pending analysis."""

    def __init__(self, core: JobCore) -> None:
        self.core = core
        self.state = core.state
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

    def suspects(self, req: pb.ReportFailureRequest) -> tuple[hang.Suspects, list[str]] | None:
        """For a hang report: the ranks that never entered the collective the others wait in, and their nodes,
        from the ranks' last activities of this round (the report's own evidence is the freshest)."""
        if req.kind != pb.FAILURE_KIND_HANG:
            return None
        round_number = self.state.round_number
        known = {r: (n, a) for r, (n, rnd, a) in self.activities.items() if rnd == round_number}
        for f in req.failures:
            if f.HasField("hang") and f.hang.HasField("activity"):
                known[f.rank] = (req.node_id, f.hang.activity)
        found = hang.find_suspects({r: a for r, (_, a) in known.items()})
        if found is None:
            return None
        return found, sorted({known[r][0] for r in found.ranks})

    def blame(self, suspects: tuple[hang.Suspects, list[str]] | None) -> hang.Blame:
        """The node a hang reported now counts against, from the evidence already in: the recorder's
        suspects and the stacks (with process states) sent before the report, the reporter's among them."""
        early_round, early = self.early_stacks
        states = (
            {n: {r: s.process_state for r, s in ranks.items()} for n, ranks in early.items()}
            if early_round == self.state.round_number
            else {}
        )
        return hang.blame(
            members=self.state.members,
            stopped=hang.stopped_ranks(states),
            suspect_nodes=suspects[1] if suspects is not None else [],
        )

    def start_analysis(self, node_id: str, *, charged: str, suspect_nodes: list[str], now: float) -> None:
        """Asks the members of the round ``node_id`` found hung for their stacks; ``charged``: the node the
        hang was counted against at once ("": none yet, the analysis may charge one)."""
        s = self.state
        if charged:
            s.hang_counts[charged] = s.hang_counts.get(charged, 0) + 1
        early_round, early = self.early_stacks
        stacks = {n: st for n, st in early.items() if n in s.members} if early_round == s.round_number else {}
        self.early_stacks = (0, {})
        self.hang = HangInquiry(
            round=s.round_number,
            node=node_id,
            requested_at=now,
            members=s.members,
            stacks=stacks,
            charged=charged,
            suspect_nodes=list(suspect_nodes),
        )
        dump = action(pb.ACTION_KIND_DUMP_STACKS, round=s.round_number, reason=f"hang on {node_id}")
        missing = [m for m in s.members if m not in stacks and m != node_id and m in s.nodes]
        for member in missing:
            self.core.push(s.nodes[member], [dump])
        counted = f"counted against {charged}" if charged else "counted against no node until the stacks say"
        asked = f"asked {len(missing)} member(s) for their stacks; {len(stacks)} had sent them"
        self.core.event("hang", now=now, node=charged or node_id, message=f"{asked}; {counted}")
        if set(s.members) <= set(stacks):
            self.analyze(now=now)

    def report_stacks(self, req: pb.ReportStacksRequest, *, now: float) -> None:
        self.core.node(req.node_id, req.incarnation)
        stacks = {r.rank: r for r in req.ranks}
        inquiry = self.hang
        if inquiry is None or req.round != inquiry.round:
            if req.round == self.state.round_number and req.node_id in self.state.members:
                early_round, early = self.early_stacks
                self.early_stacks = (
                    req.round,
                    {**(early if early_round == req.round else {}), req.node_id: stacks},
                )
            return
        inquiry.stacks[req.node_id] = stacks
        if set(inquiry.members) <= set(inquiry.stacks):
            self.analyze(now=now)

    def analyze(self, *, now: float) -> None:
        inquiry, self.hang = self.hang, None
        if inquiry is None:
            return
        s = self.state
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
        s.last_hang_analysis = HangAnalysis(
            round=inquiry.round,
            hung_node=inquiry.node,
            odd_nodes=list(verdict.odd_nodes),
            odd_ranks=sorted(verdict.odd_ranks),
            nodes_reported=sorted(inquiry.stacks),
            reason=reason,
            blamed=found.node,
        )
        self.core.event(
            "hang_analysis",
            now=now,
            node=found.node,
            round=inquiry.round,
            message=reason,
            log=failure_log.warning,
        )
        if found.node != inquiry.charged:
            # The evidence of every node's stacks moves the hang to the node it singles out, or off the node
            # charged when it was reported.
            if inquiry.charged:
                s.hang_counts[inquiry.charged] = max(0, s.hang_counts.get(inquiry.charged, 0) - 1)
            if found.node:
                self._charge(found.node, why=found.why, now=now)
        self.core.changed(durable=True)

    def _charge(self, node_id: str, *, why: str, now: float) -> None:
        """Counts a hang against ``node_id`` after the stack analysis; its second evicts it."""
        s = self.state
        count = s.hang_counts[node_id] = s.hang_counts.get(node_id, 0) + 1
        culprit = s.nodes.get(node_id)
        if count >= 2 and culprit is not None and culprit.status == ALIVE:
            was_member = node_id in s.members or node_id in s.joiners
            reason = f"{node_id} hung {count} times ({why})"
            if self.core.request_eviction(culprit, kind="hang", reason=reason, now=now) and was_member:
                self.core.open_round(f"evicted {node_id}: {reason}", now=now)
