"""The job's component for slow steps: the step-time check over the heartbeats' progress, and the per-node
straggler scores.

Every ``probes.stragglers.step_check_interval_s`` the check flags the ranks whose step intervals lag the
others' (event ``slow_steps``, ``slow_ranks`` of /v1/job) and starts a probe round for them
(:class:`~phalanx.master.job.probes.ProbeRounds`). It also scores every member node
(:func:`phalanx.diagnostics.stragglers.node_scores`): a node confirmed slow over ``step_confirm_checks``
checks is reported (event ``straggler``, ``straggler`` of /v1/nodes, ``phalanx_node_straggler_score``) and,
with ``probes.stragglers.evict_slow_nodes``, evicted at once without a probe round. Pure (``now`` injected).
"""

from __future__ import annotations

from collections.abc import Sequence

from phalanx.api import views
from phalanx.diagnostics.stragglers import (
    NodeScore,
    ScoreBasis,
    confirm_slow,
    new_baselines,
    node_scores,
    node_timings,
    rank_timings,
    step_verdicts,
    straggler_reason,
    straggler_state,
)
from phalanx.master.job import effects as fx
from phalanx.master.job.core import JobCore, failure_log
from phalanx.master.job.probes import ProbeRounds
from phalanx.master.state.beat import Stepped
from phalanx.master.state.nodes import ALIVE
from phalanx.master.state.steptimes import StepTimes

__all__ = ["StepChecks"]


class StepChecks:
    """The step times of the running round, the ranks found slow, and the nodes' straggler scores."""

    def __init__(self, core: JobCore, *, probes: ProbeRounds, now: float) -> None:
        self.core = core
        self.state = core.state
        self.probes = probes
        settings = core.state.settings
        self.step_times = StepTimes(window=settings.probes.stragglers.step_window)
        self.slow_ranks: dict[int, views.SlowRank] = {}
        """Ranks of the running round whose step intervals lag the others' (``slow_ranks`` of /v1/job)."""
        self._step_checked_at = now
        self.node_scores: dict[str, NodeScore] = {}
        """Each member's scores from the latest step-time check of the running round."""
        self.straggler_streaks: dict[str, int] = {}
        """node -> step-time checks in a row that found it slow (confirmed at ``step_confirm_checks``)."""
        self.step_baselines: dict[str, float] = {}
        """node -> its value when first scored healthy in the running round (the individual score's base)."""
        self.step_basis: ScoreBasis = "step"

    def observe_steps(self, node_id: str, stepped: Sequence[Stepped], *, round: int) -> None:
        """A heartbeat's progress of a member running the current round, for the step-time check."""
        s = self.state
        if round != s.round_number or s.round_open or not s.is_member(node_id):
            return
        self.step_times.observe_beat(round=round, node_id=node_id, stepped=stepped)

    def straggler_view(self, node_id: str) -> views.Straggler | None:
        """The ``straggler`` field of a node in ``/v1/nodes``: its latest scores and verdict (``ok``,
        ``suspect`` while being confirmed, ``slow`` once confirmed); None when the latest check did not score
        it (not a member, too few steps, a single node)."""
        score = self.node_scores.get(node_id)
        if score is None:
            return None
        stragglers = self.state.settings.probes.stragglers
        streak = self.straggler_streaks.get(node_id, 0)
        return views.Straggler(
            verdict=straggler_state(streak, need=stragglers.step_confirm_checks),
            basis=score.basis,
            step_time_s=score.step_time_s,
            value_s=score.value_s,
            relative=score.relative,
            reference_s=score.reference_s,
            individual=score.individual,
            baseline_s=score.baseline_s,
            slow_checks=streak,
            reason=straggler_reason(score, checks=streak, factor=stragglers.step_factor) if streak else "",
        )

    def _score_nodes(self, *, now: float) -> None:
        """Scores every member from its step times (relative to the other members, individual against its
        own baseline), confirms the slow ones over ``step_confirm_checks`` checks (event ``straggler``) and,
        with ``evict_slow_nodes``, evicts them without waiting for a probe round."""
        s = self.state
        cfg = s.settings.probes.stragglers
        times = self.step_times
        ranks = rank_timings(times.intervals, times.activity, settings=cfg)
        timings = node_timings(ranks, times.node_of)
        timings = {n: t for n, t in timings.items() if n in s.members}
        scores = node_scores(timings, self.step_baselines, settings=cfg) if len(timings) >= 2 else {}
        self.step_baselines = new_baselines(scores, self.step_baselines, previous=self.step_basis)
        self.step_basis = next(iter(scores.values())).basis if scores else self.step_basis
        self.straggler_streaks, confirmed = confirm_slow(
            self.straggler_streaks, scores, need=cfg.step_confirm_checks
        )
        self.node_scores = scores  # read by /v1/nodes and /metrics when asked; not part of the job status
        if 2 * sum(1 for sc in scores.values() if sc.slow) > len(scores):
            # Half the job slower than the other half: no median to trust (a broken measurement, or a mixed
            # cluster). Nobody is blamed; the streaks start over.
            self.straggler_streaks = {}
            return
        for node_id in confirmed:
            reason = straggler_reason(scores[node_id], checks=cfg.step_confirm_checks, factor=cfg.step_factor)
            self.core.event(
                "straggler", now=now, node=node_id, message=f"step times: {reason}", log=failure_log.warning
            )
            if cfg.evict_slow_nodes:
                self._evict_slow_node(node_id, reason=reason, now=now)

    def _evict_slow_node(self, node_id: str, *, reason: str, now: float) -> None:
        """Evicts a node the step-time checks confirmed slow, as a probe round's straggler is evicted."""
        s = self.state
        node = s.nodes.get(node_id)
        if node is None or node.status != ALIVE or s.finished:
            return
        if len(s.evictions) >= s.settings.restart.max_evictions:
            failure_log.warning(
                "not evicting %s, the eviction budget (%d) is spent: %s",
                node_id,
                s.settings.restart.max_evictions,
                reason,
                extra={"node": node_id, "round": s.round_number},
            )
            return
        was_member = node_id in s.members
        if self.core.request_eviction(node, kind="straggler", reason=f"step times: {reason}", now=now):
            self.straggler_streaks.pop(node_id, None)
            self.node_scores.pop(node_id, None)  # gone from the job: no scores of it until it is back
            if was_member:
                self.core.open_round(f"evicted {node_id}: {reason}", now=now)

    def check(self, *, now: float) -> None:
        """Flags the ranks whose step intervals lag the others' (event ``slow_steps``). A rank's lag alone
        evicts nobody (a slow data loader, a pipeline stage, a late report look the same): it starts a probe
        round when probes are enabled, and the probes judge the node (MegaScale's order). Then scores the
        nodes (:meth:`_score_nodes`), whose confirmed stragglers the job's policy may evict
        (``evict_slow_nodes``)."""
        s = self.state
        every = s.settings.probes.stragglers.step_check_interval_s
        if every <= 0 or now - self._step_checked_at < every:
            return
        self._step_checked_at = now
        if self.step_times.round != s.round_number or s.round_open:
            if self.slow_ranks or self.node_scores or self.straggler_streaks:
                # Another round: its ranks and nodes are judged afresh.
                self.slow_ranks = {}
                self.node_scores = {}
                self.straggler_streaks = {}
                self.step_baselines = {}
                self.core.changed()
            return
        verdicts = step_verdicts(self.step_times.intervals, settings=s.settings.probes.stragglers)
        new = [v for v in verdicts if v.rank not in self.slow_ranks]
        node_of = self.step_times.node_of
        self.slow_ranks = {
            v.rank: views.SlowRank(
                rank=v.rank,
                node=node_of.get(v.rank, ""),
                median_interval_s=v.median_interval_s,
                reference_s=v.reference_s,
                reason=v.reason,
            )
            for v in verdicts
        }
        for v in new:
            node = node_of.get(v.rank, "")
            slow = fx.Emit("slow_steps", v.reason, node=node, rank=v.rank, log=failure_log.warning)
            self.core.apply([fx.Tally("slow_step_verdicts"), slow], now=now)
        if verdicts or new:
            self.core.changed()
        self._score_nodes(now=now)
        if new and not self.probes.cannot_probe():
            nodes = sorted({self.slow_ranks[v.rank].node for v in new})
            self.probes.start_probe(now=now, trigger=f"slow steps on {', '.join(nodes)}")
