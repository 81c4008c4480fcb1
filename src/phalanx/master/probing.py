"""Probe rounds: the master's side of health probes (a node that fails a probe, or is a straggler, is
evicted and replaced).

A probe round is started on demand (``POST /v1/probe``), right after a rendezvous round completes
(``probes.on_round_complete``), every ``probes.interval_s``, or when the step-time check finds ranks whose
step intervals lag the others' (:meth:`ProbeCore._check_step_times`, event ``slow_steps``, ``slow_ranks`` of
/v1/job); nothing starts unless ``probes.enabled``. The same check scores every member node
(:meth:`ProbeCore._score_nodes`): a node confirmed slow over ``step_confirm_checks`` checks is reported (event
``straggler``, ``straggler`` of /v1/nodes, ``phalanx_node_straggler_score``) and, with
``probes.stragglers.evict_slow_nodes``, evicted at once without a probe round.
It needs a completed rendezvous round that is not reopening. Every member then gets one ``RUN_PROBE``
action per kind in ``probes.kinds`` in its next heartbeat response, each tagged with the probe round's id
(``Action.probe_round``):

* ``PROBE_KIND_MATMUL`` -- local compute check, no group;
* ``PROBE_KIND_ALLGATHER`` (only with two or more members) -- pairwise all-gather with ``probe_group``
  = the members in group-rank order. The group meets at a TCPStore that the probe process of the
  group-rank-0 node serves at ``probe_store_addr:probe_store_port`` = the round's ``store_host`` and
  ``store_port + 1``: the rendezvous store's host is the rank-0 node and is reachable by every member,
  and the next port keeps the probe out of the training store.

Reports (``ReportProbe``) count only when they carry the running round's id (0, untagged, is taken for
the running round, for agents that do not echo the id), come from a member and are that node's first
report of the kind; anything else is stale and only counted. The round ends when every member reported
every kind or ``probes.timeout_s`` passed; a missing report is a failed measurement. Then
:mod:`phalanx.diagnostics.stragglers` judges the results:

* high-confidence suspects are evicted through the normal eviction path (event ``probe_failed`` or
  ``straggler`` with the reason sentence, ``eviction_requested``, failure-channel log line,
  ``phalanx_evictions_total{reason="probe_failed"|"straggler"}``), and the rendezvous round reopens. A
  failed probe (an error, a wrong result, no report) evicts at once. A slow node (a straggler) is evicted
  only when ``probes.stragglers.confirm_rounds`` rounds in a row find it slow: a measurement on a busy
  host can be slow once, and an eviction costs the job a restart. The confirming rounds start as soon as
  the previous one ends (trigger ``confirming ...``); a round that finds the node fast again, or an
  inconclusive one, clears it;
* low-confidence verdicts only produce the event;
* when more than half of the members would be evicted, or no member reported at all, the round is
  ``inconclusive`` and evicts nobody: a broken probe setup must not empty the job;
* with the eviction budget spent a suspect is not evicted (event only): a slow node beats no job.

A probe round is aborted when the rendezvous round changes or reopens while it runs. Everything here is
pure (``now`` injected); the probe state is not durable, only the next probe id is, so ids never repeat.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from phalanx.api.settings import MasterSettings
from phalanx.api.v1 import master_pb2 as pb
from phalanx.diagnostics.stragglers import (
    NodeScore,
    NodeVerdict,
    ScoreBasis,
    compute_verdicts,
    confirm_slow,
    link_verdicts,
    new_baselines,
    node_scores,
    node_timings,
    rank_timings,
    step_verdicts,
    straggler_reason,
    straggler_state,
)
from phalanx.master import rendezvous as rdzv
from phalanx.master.core import JobCore, action, failure_log, log
from phalanx.master.errors import RequestError
from phalanx.master.membership import ALIVE
from phalanx.master.steptimes import StepTimes

__all__ = ["PROBE_KINDS", "Measured", "ProbeCore", "ProbeRound", "judge", "round_kinds", "run_probe_actions"]

PROBE_KINDS = {pb.PROBE_KIND_MATMUL: "matmul", pb.PROBE_KIND_ALLGATHER: "allgather"}


@dataclass(frozen=True)
class Measured:
    """One measurement as the analysis reads it (:class:`~phalanx.diagnostics.stragglers.MeasurementLike`)."""

    peer_node_id: str = ""
    ok: bool = False
    rate: float = 0.0
    error: str = ""
    elapsed_s: float = 0.0


@dataclass
class ProbeRound:
    """One probe round: who takes part, what it expects and what arrived."""

    id: int
    rendezvous_round: int
    members: list[str]
    trigger: str
    started_at: float
    kinds: tuple[str, ...]
    reports: dict[str, dict[str, list[Measured]]] = field(default_factory=dict)
    """kind -> node -> measurements."""
    stale_reports: int = 0
    result: str = "running"
    """running | ok | suspects | evicted | inconclusive | aborted"""
    finished_at: float | None = None
    verdicts: list[NodeVerdict] = field(default_factory=list)
    evicted: list[str] = field(default_factory=list)

    def complete(self) -> bool:
        """True when every member reported every kind."""
        return all(set(self.members) <= set(self.reports.get(kind, {})) for kind in self.kinds)

    def view(self) -> dict[str, Any]:
        """The ``probe`` field of ``/v1/job``."""
        return {
            "id": self.id,
            "round": self.rendezvous_round,
            "trigger": self.trigger,
            "result": self.result,
            "members": list(self.members),
            "started_unix": self.started_at,
            "finished_unix": self.finished_at,
            "reported": {kind: sorted(self.reports.get(kind, {})) for kind in self.kinds},
            "stale_reports": self.stale_reports,
            "verdicts": [
                {
                    "node_id": v.node_id,
                    "kind": v.kind,
                    "confidence": v.confidence,
                    "value": v.value,
                    "reference": v.reference,
                    "reason": v.reason,
                }
                for v in self.verdicts
            ],
            "evicted": list(self.evicted),
        }


def round_kinds(*, configured: Sequence[str], members: int) -> tuple[str, ...]:
    """The configured probe kinds a round of ``members`` nodes runs: all-gather needs a pair."""
    return tuple(kind for kind in configured if kind != "allgather" or members >= 2)


def run_probe_actions(probe: ProbeRound, *, store: rdzv.Round, reason: str) -> list[pb.Action]:
    """The RUN_PROBE actions one member gets for ``probe``, one per kind, in :data:`PROBE_KINDS` order."""
    common: dict[str, Any] = {"round": probe.rendezvous_round, "reason": reason, "probe_round": probe.id}
    actions = []
    if "matmul" in probe.kinds:
        actions.append(action(pb.ACTION_KIND_RUN_PROBE, probe=pb.PROBE_KIND_MATMUL, **common))
    if "allgather" in probe.kinds:
        actions.append(
            action(
                pb.ACTION_KIND_RUN_PROBE,
                probe=pb.PROBE_KIND_ALLGATHER,
                probe_group=probe.members,
                probe_store_addr=store.store_host,
                probe_store_port=store.store_port + 1,
                **common,
            )
        )
    return actions


def judge(probe: ProbeRound, *, timeout_s: float, settings: Any) -> list[NodeVerdict]:
    """Verdicts of a finished round; a member without a report failed that probe.

    ``settings`` is a :class:`~phalanx.api.settings.StragglerSettings`.
    """
    verdicts: list[NodeVerdict] = []
    if "matmul" in probe.kinds:
        matmul: dict[str, Sequence[Measured]] = dict(probe.reports.get("matmul", {}))
        for node in probe.members:
            if node not in matmul:
                missing = f"no matmul probe report within {timeout_s:g}s"
                matmul[node] = [Measured(ok=False, error=missing)]
        verdicts.extend(compute_verdicts(matmul, settings=settings))
    if "allgather" in probe.kinds:
        # link_verdicts names the members that reported nothing itself (``expected``).
        allgather: Mapping[str, Sequence[Measured]] = probe.reports.get("allgather", {})
        verdicts.extend(link_verdicts(allgather, expected=probe.members, settings=settings))
    return verdicts


class ProbeCore(JobCore):
    """:class:`JobCore` plus probe rounds (see the module docstring)."""

    probe: ProbeRound | None = None
    """The running or the latest probe round."""
    next_probe: int = 1
    probed_round: int = 0
    """Rendezvous round of the latest probe round (for ``on_round_complete``)."""
    last_probe_at: float | None = None
    slow_streaks: dict[str, int]
    """node -> probe rounds in a row that found it slow (a high-confidence straggler), while unconfirmed."""

    def __init__(
        self, *, settings: MasterSettings, now: float, saved: Mapping[str, Any] | None = None
    ) -> None:
        super().__init__(settings=settings, now=now, saved=saved)
        self.step_times = StepTimes(window=settings.probes.stragglers.step_window)
        self.slow_ranks: dict[int, dict[str, Any]] = {}
        """Ranks of the running round whose step intervals lag the others' (``slow_ranks`` of /v1/job)."""
        self._step_checked_at = now
        self.slow_streaks = {}
        self.node_scores: dict[str, NodeScore] = {}
        """Each member's scores from the latest step-time check of the running round."""
        self.straggler_streaks: dict[str, int] = {}
        """node -> step-time checks in a row that found it slow (confirmed at ``step_confirm_checks``)."""
        self.step_baselines: dict[str, float] = {}
        """node -> its value when first scored healthy in the running round (the individual score's base)."""
        self.step_basis: ScoreBasis = "step"
        if saved is not None:
            # Probe ids stay unique across master restarts, so a report to the old master stays stale.
            self.next_probe = int(saved.get("next_probe", 1))

    def status(self) -> dict[str, Any]:
        """:meth:`JobCore.status` plus ``probe``, the running or latest probe round (or null)."""
        return {
            **super().status(),
            "probe": self.probe.view() if self.probe else None,
            "slow_ranks": [self.slow_ranks[r] for r in sorted(self.slow_ranks)],
            "unconfirmed_stragglers": dict(sorted(self.slow_streaks.items())),
        }

    def durable(self) -> dict[str, Any]:
        """:meth:`JobCore.durable` plus the next probe id."""
        return {**super().durable(), "next_probe": self.next_probe}

    def start_probe(self, *, now: float, trigger: str) -> ProbeRound:
        """Starts a probe round; RequestError (``failed_precondition``) when none can start now."""
        why = self._cannot_probe()
        if why:
            raise RequestError(f"cannot start a probe round: {why}", code="failed_precondition")
        assert self.round is not None
        r = self.round
        members = self._probe_members()
        kinds = round_kinds(configured=self.settings.probes.kind_names, members=len(members))
        probe = ProbeRound(
            id=self.next_probe,
            rendezvous_round=r.number,
            members=members,
            trigger=trigger,
            started_at=now,
            kinds=kinds,
        )
        self.probe = probe
        self.next_probe += 1
        self.probed_round = r.number
        self.last_probe_at = now
        reason = f"probe round {probe.id} ({trigger})"
        for node_id in members:
            self._push(self.nodes[node_id], run_probe_actions(probe, store=r, reason=reason))
        self._event("probe_started", now=now, message=f"{reason}: {', '.join(members)}")
        log.info("%s started on %d nodes", reason, len(members), extra={"round": r.number})
        return probe

    def probe_report(self, req: pb.ReportProbeRequest, *, now: float) -> bool:
        """Counts a ReportProbe toward the running round; False when it is stale (and ignored)."""
        probe = self.probe
        kind = PROBE_KINDS.get(req.probe, "")
        if (
            probe is None
            or probe.result != "running"
            or req.probe_round not in (0, probe.id)
            or kind not in probe.kinds
            or req.node_id not in probe.members
            or req.node_id in probe.reports.get(kind, {})
        ):
            if probe is not None:
                probe.stale_reports += 1
            self.stats.probe_reports_stale += 1
            log.info(
                "ignored a stale %s probe report (probe round %d)",
                kind or "unknown",
                req.probe_round,
                extra={"node": req.node_id},
            )
            return False
        probe.reports.setdefault(kind, {})[req.node_id] = [
            Measured(peer_node_id=m.peer_node_id, ok=m.ok, rate=m.rate, error=m.error, elapsed_s=m.elapsed_s)
            for m in req.measurements
        ]
        if probe.complete():
            self._finish_probe(now=now)
        self._changed()
        return True

    def observe_steps(self, node_id: str, ranks: Sequence[pb.RankProgress], *, round: int) -> None:
        """A heartbeat's progress of a member running the current round, for the step-time check."""
        if round != self.round_number or self.round_open or not self.is_member(node_id):
            return
        self.step_times.observe_beat(round=round, node_id=node_id, ranks=ranks)

    def straggler_view(self, node_id: str) -> dict[str, Any] | None:
        """The ``straggler`` field of a node in ``/v1/nodes``: its latest scores and verdict (``ok``,
        ``suspect`` while being confirmed, ``slow`` once confirmed); null when the latest check did not score
        it (not a member, too few steps, a single node)."""
        score = self.node_scores.get(node_id)
        if score is None:
            return None
        stragglers = self.settings.probes.stragglers
        streak = self.straggler_streaks.get(node_id, 0)
        return {
            "verdict": straggler_state(streak, need=stragglers.step_confirm_checks),
            "basis": score.basis,
            "step_time_s": score.step_time_s,
            "value_s": score.value_s,
            "relative": score.relative,
            "reference_s": score.reference_s,
            "individual": score.individual,
            "baseline_s": score.baseline_s,
            "slow_checks": streak,
            "reason": straggler_reason(score, checks=streak, factor=stragglers.step_factor) if streak else "",
        }

    def _score_nodes(self, *, now: float) -> None:
        """Scores every member from its step times (relative to the other members, individual against its
        own baseline), confirms the slow ones over ``step_confirm_checks`` checks (event ``straggler``) and,
        with ``evict_slow_nodes``, evicts them without waiting for a probe round."""
        cfg = self.settings.probes.stragglers
        times = self.step_times
        ranks = rank_timings(times.intervals, times.activity, settings=cfg)
        timings = node_timings(ranks, times.node_of)
        timings = {n: t for n, t in timings.items() if n in self.members}
        scores = node_scores(timings, self.step_baselines, settings=cfg) if len(timings) >= 2 else {}
        self.step_baselines = new_baselines(scores, self.step_baselines, previous=self.step_basis)
        self.step_basis = next(iter(scores.values())).basis if scores else self.step_basis
        self.straggler_streaks, confirmed = confirm_slow(
            self.straggler_streaks, scores, need=cfg.step_confirm_checks
        )
        self.node_scores = scores  # read by /v1/nodes and /metrics when asked; not part of the job status
        if 2 * sum(1 for s in scores.values() if s.slow) > len(scores):
            # Half the job slower than the other half: no median to trust (a broken measurement, or a mixed
            # cluster). Nobody is blamed; the streaks start over.
            self.straggler_streaks = {}
            return
        for node_id in confirmed:
            reason = straggler_reason(scores[node_id], checks=cfg.step_confirm_checks, factor=cfg.step_factor)
            self._event("straggler", now=now, node=node_id, message=f"step times: {reason}")
            failure_log.warning("straggler: %s", reason, extra={"node": node_id, "round": self.round_number})
            if cfg.evict_slow_nodes:
                self._evict_slow_node(node_id, reason=reason, now=now)

    def _evict_slow_node(self, node_id: str, *, reason: str, now: float) -> None:
        """Evicts a node the step-time checks confirmed slow, as a probe round's straggler is evicted."""
        node = self.nodes.get(node_id)
        if node is None or node.status != ALIVE or self.finished:
            return
        if len(self.evictions) >= self.settings.restart.max_evictions:
            failure_log.warning(
                "not evicting %s, the eviction budget (%d) is spent: %s",
                node_id,
                self.settings.restart.max_evictions,
                reason,
                extra={"node": node_id, "round": self.round_number},
            )
            return
        was_member = node_id in self.members
        if self._request_eviction(node, kind="straggler", reason=f"step times: {reason}", now=now):
            self.straggler_streaks.pop(node_id, None)
            self.node_scores.pop(node_id, None)  # gone from the job: no scores of it until it is back
            if was_member:
                self._open_round(f"evicted {node_id}: {reason}", now=now)

    def _check_step_times(self, *, now: float) -> None:
        """Flags the ranks whose step intervals lag the others' (event ``slow_steps``). A rank's lag alone
        evicts nobody (a slow data loader, a pipeline stage, a late report look the same): it starts a probe
        round when probes are enabled, and the probes judge the node (MegaScale's order). Then scores the
        nodes (:meth:`_score_nodes`), whose confirmed stragglers the job's policy may evict
        (``evict_slow_nodes``)."""
        every = self.settings.probes.stragglers.step_check_interval_s
        if every <= 0 or now - self._step_checked_at < every:
            return
        self._step_checked_at = now
        if self.step_times.round != self.round_number or self.round_open:
            if self.slow_ranks or self.node_scores or self.straggler_streaks:
                # Another round: its ranks and nodes are judged afresh.
                self.slow_ranks = {}
                self.node_scores = {}
                self.straggler_streaks = {}
                self.step_baselines = {}
                self._changed()
            return
        verdicts = step_verdicts(self.step_times.intervals, settings=self.settings.probes.stragglers)
        new = [v for v in verdicts if v.rank not in self.slow_ranks]
        self.slow_ranks = {
            v.rank: {
                "rank": v.rank,
                "node": self.step_times.node_of.get(v.rank, ""),
                "median_interval_s": v.median_interval_s,
                "reference_s": v.reference_s,
                "reason": v.reason,
            }
            for v in verdicts
        }
        for v in new:
            node = self.step_times.node_of.get(v.rank, "")
            self.stats.slow_step_verdicts += 1
            self._event("slow_steps", now=now, node=node, rank=v.rank, message=v.reason)
            failure_log.warning("slow steps: %s", v.reason, extra={"node": node, "round": self.round_number})
        if verdicts or new:
            self._changed()
        self._score_nodes(now=now)
        if new and not self._cannot_probe():
            nodes = sorted({self.slow_ranks[v.rank]["node"] for v in new})
            self.start_probe(now=now, trigger=f"slow steps on {', '.join(nodes)}")

    def tick(self, *, now: float) -> None:
        """:meth:`JobCore.tick`, then the step-time check, probe-round timeouts, aborts and scheduling."""
        super().tick(now=now)
        if not self.finished:
            self._check_step_times(now=now)
        probe = self.probe
        if probe is not None and probe.result == "running":
            if self.finished or self.round_open or self.round_number != probe.rendezvous_round:
                why = f"the job {self.phase.lower()}" if self.finished else "the rendezvous round changed"
                self._end_probe(probe, "aborted", now=now, why=why)
            elif now - probe.started_at >= self.settings.probes.timeout_s:
                self._finish_probe(now=now)
            return
        cfg = self.settings.probes
        if self._cannot_probe() or self.round is None:
            return
        trigger = ""
        members = self._probe_members()
        self.slow_streaks = {n: c for n, c in self.slow_streaks.items() if n in members}
        if self.slow_streaks:
            need = cfg.stragglers.confirm_rounds
            trigger = "confirming " + ", ".join(
                f"{n} (slow in {c} of {need} rounds)" for n, c in sorted(self.slow_streaks.items())
            )
        elif cfg.on_round_complete and self.round_number > self.probed_round:
            trigger = f"rendezvous round {self.round_number} completed"
        elif cfg.interval_s > 0 and now - (self.last_probe_at or self.round.completed_at) >= cfg.interval_s:
            trigger = f"every {cfg.interval_s:g}s"
        if trigger:
            self.start_probe(now=now, trigger=trigger)

    def _probe_members(self) -> list[str]:
        """The running rendezvous round's members that are alive, in group-rank order."""
        node_ids = self.round.node_ids if self.round is not None else []
        return [m for m in node_ids if m in self.nodes and self.nodes[m].status == ALIVE]

    def _cannot_probe(self) -> str:
        """Why no probe round can start now; empty when one can."""
        cfg = self.settings.probes
        if not cfg.enabled:
            return "probes are disabled (probes.enabled)"
        if self.finished:
            return f"the job has {self.phase.lower()}"
        if self.round is None or self.round_open:
            return "no rendezvous round is running"
        if self.probe is not None and self.probe.result == "running":
            return f"probe round {self.probe.id} is still running"
        members = len(self._probe_members())
        if not round_kinds(configured=cfg.kind_names, members=members):
            # An allgather-only setup on a one-node round: a round would measure nothing.
            return f"no probe of probes.kinds={cfg.kinds!r} runs on {members} node(s); allgather needs two"
        return ""

    def _end_probe(self, probe: ProbeRound, result: str, *, now: float, why: str) -> None:
        probe.result = result
        probe.finished_at = now
        for node_id in probe.members:
            node = self.nodes.get(node_id)
            if node is not None:  # RUN_PROBE not yet delivered would start a probe nobody waits for
                node.pending[:] = [
                    a
                    for a in node.pending
                    if not (a.kind == pb.ACTION_KIND_RUN_PROBE and a.probe_round == probe.id)
                ]
        self.stats.probe_rounds[result] = self.stats.probe_rounds.get(result, 0) + 1
        self._event("probe_finished", now=now, round=probe.rendezvous_round, message=f"{result}: {why}")
        log.info("probe round %d %s: %s", probe.id, result, why, extra={"round": probe.rendezvous_round})

    def _finish_probe(self, *, now: float) -> None:
        probe = self.probe
        assert probe is not None
        cfg = self.settings.probes
        probe.verdicts = judge(probe, timeout_s=cfg.timeout_s, settings=cfg.stragglers)
        for v in probe.verdicts:
            kind = "probe_failed" if v.kind == "probe_failed" else "straggler"
            self._event(kind, now=now, node=v.node_id, message=f"{v.confidence} confidence: {v.reason}")
        high = sorted({v.node_id for v in probe.verdicts if v.confidence == "high"})
        reported = set().union(*(set(probe.reports.get(k, {})) for k in probe.kinds))
        inconclusive = ""
        if not reported:
            inconclusive = "no member reported; do the agents run probes?"
        elif high and 2 * len(high) > len(probe.members):
            inconclusive = (
                f"{len(high)} of {len(probe.members)} members failed; evicting none (check the probe setup)"
            )
            failure_log.warning(
                "probe round %d: %s", probe.id, inconclusive, extra={"round": probe.rendezvous_round}
            )
        if inconclusive:
            # A round that tells nothing confirms nothing either, and a broken probe setup must not keep
            # confirming rounds running back to back.
            self.slow_streaks = {}
            self._end_probe(probe, "inconclusive", now=now, why=inconclusive)
            return
        failed = {v.node_id for v in probe.verdicts if v.confidence == "high" and v.kind == "probe_failed"}
        slow = set(high) - failed
        # A node found fast (or not measured) in this round starts over.
        self.slow_streaks = {n: self.slow_streaks.get(n, 0) + 1 for n in sorted(slow)}
        confirmed = {n for n, c in self.slow_streaks.items() if c >= cfg.stragglers.confirm_rounds}
        for node_id in high:
            if node_id in failed or node_id in confirmed:
                self.slow_streaks.pop(node_id, None)
                self._evict_suspect(probe, node_id, now=now)
        if probe.evicted:
            result = "evicted"
        elif probe.verdicts:
            result = "suspects"
        else:
            result = "ok"
        summary = (
            f"evicted {', '.join(probe.evicted)}" if probe.evicted else f"{len(probe.verdicts)} verdict(s)"
        )
        if self.slow_streaks:
            summary += f"; {', '.join(sorted(self.slow_streaks))} slow, to be confirmed"
        self._end_probe(probe, result, now=now, why=summary)

    def _evict_suspect(self, probe: ProbeRound, node_id: str, *, now: float) -> None:
        node = self.nodes.get(node_id)
        if node is None or node.status != ALIVE or self.finished:
            return
        first = next(v for v in probe.verdicts if v.node_id == node_id and v.confidence == "high")
        kind = "probe_failed" if first.kind == "probe_failed" else "straggler"
        if len(self.evictions) >= self.settings.restart.max_evictions:
            failure_log.warning(
                "not evicting %s, the eviction budget (%d) is spent: %s",
                node_id,
                self.settings.restart.max_evictions,
                first.reason,
                extra={"node": node_id, "round": probe.rendezvous_round},
            )
            return
        was_member = node_id in self.members
        if self._request_eviction(node, kind=kind, reason=first.reason, now=now):
            probe.evicted.append(node_id)
            if was_member:
                self._open_round(f"evicted {node_id}: {first.reason}", now=now)
