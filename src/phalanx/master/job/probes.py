"""Probe rounds: the master's side of health probes (a node that fails a probe, or is a straggler, is
evicted and replaced).

A probe round is started on demand (``POST /v1/probe``), right after a rendezvous round completes
(``probes.on_round_complete``), every ``probes.interval_s`` (counted from the rendezvous round's first
training step where that came after the last probe round: a start is no time to measure), or when the
step-time check finds ranks whose step intervals lag the others' (:mod:`phalanx.master.job.stepchecks`, event
``slow_steps``, ``slow_ranks`` of /v1/job); nothing starts unless ``probes.enabled``. The same check
scores every member node (:mod:`phalanx.master.job.stepchecks`): a node confirmed slow over
``step_confirm_checks`` checks is reported (event ``straggler``, ``straggler`` of /v1/nodes,
``phalanx_node_straggler_score``) and, with ``probes.stragglers.evict_slow_nodes``, evicted at once without
a probe round.
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

from phalanx.api import views
from phalanx.api.v1 import master_pb2 as pb
from phalanx.diagnostics.stragglers import NodeVerdict, compute_verdicts, link_verdicts
from phalanx.master.decide import rendezvous as rdzv
from phalanx.master.errors import RequestError
from phalanx.master.job import effects as fx
from phalanx.master.job.answers import action
from phalanx.master.job.core import JobCore, failure_log, log
from phalanx.master.state.events import EventKind
from phalanx.master.state.nodes import ALIVE

__all__ = [
    "PROBE_KINDS",
    "Measured",
    "ProbeRound",
    "ProbeRounds",
    "judge",
    "round_kinds",
    "run_probe_actions",
]

PROBE_KINDS = {pb.PROBE_KIND_MATMUL: "matmul", pb.PROBE_KIND_ALLGATHER: "allgather"}
STEPLESS_PROBE_AFTER_S = 120.0
"""Periodic probe rounds count from a rendezvous round's first step; a round none of whose ranks reported
a step this long after it completed (a script that reports none) counts from then instead."""


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
    result: views.ProbeResult = "running"
    """running | ok | suspects | evicted | inconclusive | aborted"""
    finished_at: float | None = None
    verdicts: list[NodeVerdict] = field(default_factory=list)
    evicted: list[str] = field(default_factory=list)

    def complete(self) -> bool:
        """True when every member reported every kind."""
        return all(set(self.members) <= set(self.reports.get(kind, {})) for kind in self.kinds)

    def view(self) -> views.ProbeRound:
        """The ``probe`` field of ``/v1/job``."""
        return views.ProbeRound(
            id=self.id,
            round=self.rendezvous_round,
            trigger=self.trigger,
            result=self.result,
            members=list(self.members),
            started_unix=self.started_at,
            finished_unix=self.finished_at,
            reported={kind: sorted(self.reports.get(kind, {})) for kind in self.kinds},
            stale_reports=self.stale_reports,
            verdicts=[
                views.ProbeVerdict(
                    node_id=v.node_id,
                    kind=v.kind,
                    confidence=v.confidence,
                    value=v.value,
                    reference=v.reference,
                    reason=v.reason,
                )
                for v in self.verdicts
            ],
            evicted=list(self.evicted),
        )


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


class ProbeRounds:
    """The job's probe rounds (see the module docstring): a component the job owns."""

    def __init__(self, core: JobCore) -> None:
        self.core = core
        self.state = core.state
        self.probe: ProbeRound | None = None
        """The running or the latest probe round."""
        self.probed_round = 0
        """Rendezvous round of the latest probe round (for ``on_round_complete``)."""
        self.last_probe_at: float | None = None
        self.first_step: tuple[int, float] = (0, 0.0)
        """(rendezvous round, when a rank of it was first seen with a step): periodic rounds wait for it."""
        self.slow_streaks: dict[str, int] = {}
        """node -> probe rounds in a row that found it slow (a high-confidence straggler), while
        unconfirmed."""

    def start_probe(self, *, now: float, trigger: str) -> ProbeRound:
        """Starts a probe round; RequestError (``failed_precondition``) when none can start now."""
        why = self.cannot_probe()
        if why:
            raise RequestError(f"cannot start a probe round: {why}", code="failed_precondition")
        s = self.state
        assert s.round is not None
        r = s.round
        members = self._probe_members()
        kinds = round_kinds(configured=s.settings.probes.kind_names, members=len(members))
        probe = ProbeRound(
            id=s.next_probe,
            rendezvous_round=r.number,
            members=members,
            trigger=trigger,
            started_at=now,
            kinds=kinds,
        )
        self.probe = probe
        self.probed_round = r.number
        self.last_probe_at = now
        reason = f"probe round {probe.id} ({trigger})"
        effects: list[fx.Effect] = [fx.NextProbe()]
        effects += [fx.Push(n, tuple(run_probe_actions(probe, store=r, reason=reason))) for n in members]
        effects.append(fx.Emit("probe_started", f"{reason}: {', '.join(members)}", log=log.info))
        self.core.apply(effects, now=now)
        return probe

    def report_probe(self, req: pb.ReportProbeRequest, *, now: float) -> None:
        """A node's probe results: kept on the node (``/v1/nodes``) and counted toward the running round."""
        node = self.state.node(req.node_id, req.incarnation)
        if req.incarnation != node.incarnation:
            return  # a replaced agent's results say nothing about the node now
        kind = pb.ProbeKind.Name(req.probe).removeprefix("PROBE_KIND_").lower()
        results = tuple(
            views.PeerProbe(
                peer_node_id=m.peer_node_id,
                ok=m.ok,
                elapsed_s=m.elapsed_s,
                rate=m.rate,
                error=m.error,
                unix=now,
                probe_round=req.probe_round,
            )
            for m in req.measurements
        )
        self.core.apply([fx.Probed(req.node_id, kind, results)], now=now)
        self.probe_report(req, now=now)
        self.core.apply([fx.Saved(durable=False)], now=now)

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
            self.core.apply([fx.Tally("probe_reports_stale")], now=now)
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
        self.core.changed()
        return True

    def tick(self, *, now: float) -> None:
        """Probe-round timeouts, aborts and scheduling."""
        s = self.state
        if self.first_step[0] != s.round_number and self.state.round_step() >= 0:
            self.first_step = (s.round_number, now)
        probe = self.probe
        if probe is not None and probe.result == "running":
            if s.finished or s.round_open or s.round_number != probe.rendezvous_round:
                why = f"the job {s.phase.lower()}" if s.finished else "the rendezvous round changed"
                self._end_probe(probe, "aborted", now=now, why=why)
            elif now - probe.started_at >= s.settings.probes.timeout_s:
                self._finish_probe(now=now)
            return
        cfg = s.settings.probes
        if self.cannot_probe() or s.round is None:
            return
        trigger = ""
        members = self._probe_members()
        self.slow_streaks = {n: c for n, c in self.slow_streaks.items() if n in members}
        if self.slow_streaks:
            need = cfg.stragglers.confirm_rounds
            trigger = "confirming " + ", ".join(
                f"{n} (slow in {c} of {need} rounds)" for n, c in sorted(self.slow_streaks.items())
            )
        elif cfg.on_round_complete and s.round_number > self.probed_round:
            trigger = f"rendezvous round {s.round_number} completed"
        elif cfg.interval_s > 0 and now - self._periodic_since(now) >= cfg.interval_s:
            trigger = f"every {cfg.interval_s:g}s"
        if trigger:
            self.start_probe(now=now, trigger=trigger)

    def _periodic_since(self, now: float) -> float:
        """When the wait for the next periodic round began: the last probe round, or the running rendezvous
        round's first step where that came later. A round is measured once it trains, not while its processes
        start (import torch, load a checkpoint) on the same hosts: a healthy node measured then looks slow,
        and a confirming round right after it (still during the start) would evict it. A round whose ranks
        report no step is measured from ``STEPLESS_PROBE_AFTER_S`` after its completion."""
        s = self.state
        assert s.round is not None
        started = self.first_step[1] if self.first_step[0] == s.round_number else now
        started = min(started, s.round.completed_at + STEPLESS_PROBE_AFTER_S)
        return max(self.last_probe_at or 0.0, started)

    def _probe_members(self) -> list[str]:
        """The running rendezvous round's members that are alive, in group-rank order."""
        s = self.state
        node_ids = s.round.node_ids if s.round is not None else []
        return [m for m in node_ids if m in s.nodes and s.nodes[m].status == ALIVE]

    def cannot_probe(self) -> str:
        """Why no probe round can start now; empty when one can."""
        s = self.state
        cfg = s.settings.probes
        if not cfg.enabled:
            return "probes are disabled (probes.enabled)"
        if s.finished:
            return f"the job has {s.phase.lower()}"
        if s.round is None or s.round_open:
            return "no rendezvous round is running"
        if self.probe is not None and self.probe.result == "running":
            return f"probe round {self.probe.id} is still running"
        members = len(self._probe_members())
        if not round_kinds(configured=cfg.kind_names, members=members):
            # An allgather-only setup on a one-node round: a round would measure nothing.
            return f"no probe of probes.kinds={cfg.kinds!r} runs on {members} node(s); allgather needs two"
        return ""

    def _end_probe(self, probe: ProbeRound, result: views.ProbeResult, *, now: float, why: str) -> None:
        probe.result = result
        probe.finished_at = now
        finished = fx.Emit("probe_finished", f"{result}: {why}", round=probe.rendezvous_round, log=log.info)
        effects: list[fx.Effect] = [
            fx.DropProbeActions(probe.id, tuple(probe.members)),
            fx.Tally("probe_rounds", result),
            finished,
        ]
        self.core.apply(effects, now=now)

    def _finish_probe(self, *, now: float) -> None:
        probe = self.probe
        assert probe is not None
        cfg = self.state.settings.probes
        probe.verdicts = judge(probe, timeout_s=cfg.timeout_s, settings=cfg.stragglers)
        for v in probe.verdicts:
            kind: EventKind = "probe_failed" if v.kind == "probe_failed" else "straggler"
            self.core.event(kind, now=now, node=v.node_id, message=f"{v.confidence} confidence: {v.reason}")
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
        result: views.ProbeResult
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
        s = self.state
        node = s.nodes.get(node_id)
        if node is None or node.status != ALIVE or s.finished:
            return
        first = next(v for v in probe.verdicts if v.node_id == node_id and v.confidence == "high")
        kind = "probe_failed" if first.kind == "probe_failed" else "straggler"
        if len(s.evictions) >= s.settings.restart.max_evictions:
            failure_log.warning(
                "not evicting %s, the eviction budget (%d) is spent: %s",
                node_id,
                s.settings.restart.max_evictions,
                first.reason,
                extra={"node": node_id, "round": probe.rendezvous_round},
            )
            return
        why = f"evicted {node_id}: {first.reason}"
        if self.core.evict_and_reopen(node, kind=kind, reason=first.reason, why=why, now=now):
            probe.evicted.append(node_id)
