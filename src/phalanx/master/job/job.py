"""The job: the master's whole state machine, driven by agent requests and a clock tick.

Every method takes ``now`` (Unix seconds) and does no I/O, so the master's behaviour is tested with plain
values and an injected clock. The executor (:mod:`phalanx.master.serve.runtime`) calls these methods,
persists :meth:`Job.durable` when ``durable_version`` moves, and wakes long-polls when ``round_version``
moves.

:class:`Job` is a composition of one :class:`~phalanx.master.state.jobstate.JobState` record (what
:mod:`phalanx.master.state.snapshot` saves and restores), its writer (:class:`.core.JobCore`: events,
actions, rounds, evictions, the end of the job, and :meth:`~.core.JobCore.apply` for the effects decisions
return), and one component per concern:

* :class:`.rounds.Rounds` -- registration, joining, completing rounds, GetRendezvous, the job's success;
* :class:`.heartbeats.Heartbeats` -- heartbeats in, actions out;
* :class:`.failures.Failures` -- failure reports, planned by :func:`.failures.plan_failure`;
* :class:`.hangs.Hangs` -- the members' stacks and the analysis of a hang;
* :class:`.foldin.FoldIn` -- checkpoint reports and the fold-in of waiting nodes at a boundary;
* :class:`.liveness.Liveness` -- everything that happens with time, suspension;
* :class:`.probes.ProbeRounds` and :class:`.stepchecks.StepChecks` -- probe rounds, slow steps, stragglers.

The pure decisions they ask are in :mod:`phalanx.master.decide` (the failure policy, rendezvous, fold-in)
and :mod:`phalanx.diagnostics` (hang verdicts, stragglers).

Phases: ``Pending`` (no round completed yet), ``Running``, ``Restarting`` (a new round is gathering after
the first), ``Succeeded``, ``Failed``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Generic, TypeVar, cast

from phalanx.api import views
from phalanx.api.elasticjob import Phase
from phalanx.api.settings import MasterSettings
from phalanx.api.v1 import master_pb2 as pb
from phalanx.api.verdicts import Eviction, HangAnalysis
from phalanx.diagnostics.stragglers import NodeScore
from phalanx.master.decide import rendezvous as rdzv
from phalanx.master.decide.failure_policy import FailureRecord
from phalanx.master.job.core import FINISHED, JobCore
from phalanx.master.job.failures import Failures
from phalanx.master.job.foldin import FoldIn
from phalanx.master.job.hangs import Hangs
from phalanx.master.job.heartbeats import Heartbeats
from phalanx.master.job.liveness import Liveness
from phalanx.master.job.probes import ProbeRound, ProbeRounds
from phalanx.master.job.rounds import RendezvousAnswer, Rounds
from phalanx.master.job.stepchecks import StepChecks
from phalanx.master.state import snapshot
from phalanx.master.state.beat import BeatRanks
from phalanx.master.state.breakpoints import Breakpoint
from phalanx.master.state.checkpoints import CheckpointTracker
from phalanx.master.state.counters import JobStats
from phalanx.master.state.events import EventLog
from phalanx.master.state.jobstate import HangInquiry, JobState
from phalanx.master.state.nodes import Node
from phalanx.master.state.recovery import RecoveryTracker
from phalanx.master.state.timeline import Timeline

__all__ = ["FINISHED", "Job", "RendezvousAnswer"]

T = TypeVar("T")


class _Shared(Generic[T]):
    """A field of the job's :class:`JobState`, read and written as ``job.<field>`` (the servers, the metrics
    and the tests read the job's state through the job)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, job: Job, owner: type | None = None) -> T:
        return cast(T, getattr(job.state, self.name))

    def __set__(self, job: Job, value: T) -> None:
        setattr(job.state, self.name, value)


class Job:
    """State and decisions of one job's master (see the module docstring for its components)."""

    settings: _Shared[MasterSettings] = _Shared()
    job_id: _Shared[str] = _Shared()
    started_unix: _Shared[float] = _Shared()
    opened_at: _Shared[float] = _Shared()
    below_min_since: _Shared[float | None] = _Shared()
    phase: _Shared[Phase] = _Shared()
    reason: _Shared[str] = _Shared()
    round: _Shared[rdzv.Round | None] = _Shared()
    next_round: _Shared[int] = _Shared()
    round_open: _Shared[bool] = _Shared()
    restart_count: _Shared[int] = _Shared()
    evictions: _Shared[list[Eviction]] = _Shared()
    checkpoints: _Shared[CheckpointTracker] = _Shared()
    nodes: _Shared[dict[str, Node]] = _Shared()
    hang_counts: _Shared[dict[str, int]] = _Shared()
    completed: _Shared[set[str]] = _Shared()
    root_cause: _Shared[dict[str, Any] | None] = _Shared()
    suspended: _Shared[bool] = _Shared()
    events: _Shared[EventLog] = _Shared()
    action_seq: _Shared[int] = _Shared()
    next_probe: _Shared[int] = _Shared()
    joiners: _Shared[dict[str, rdzv.Joiner]] = _Shared()
    breakpoint: _Shared[Breakpoint | None] = _Shared()
    round_failures: _Shared[list[FailureRecord]] = _Shared()
    last_hang_analysis: _Shared[HangAnalysis | None] = _Shared()
    max_step: _Shared[int] = _Shared()
    scheduled_workers: _Shared[int | None] = _Shared()
    spec_generation: _Shared[int] = _Shared()
    stats: _Shared[JobStats] = _Shared()
    timeline: _Shared[Timeline] = _Shared()
    recovery: _Shared[RecoveryTracker] = _Shared()
    durable_version: _Shared[int] = _Shared()
    status_version: _Shared[int] = _Shared()
    round_version: _Shared[int] = _Shared()
    action_version: _Shared[int] = _Shared()

    def __init__(
        self, *, settings: MasterSettings, now: float, saved: Mapping[str, Any] | None = None
    ) -> None:
        self.state = state = JobState.new(settings, now=now)
        self.core = core = JobCore(state)
        self.hangs = Hangs(core)
        self.failures = Failures(core)
        self.fold_in = FoldIn(core)
        self.rounds = Rounds(core, failures=self.failures, fold_in=self.fold_in)
        self.probes = ProbeRounds(core)
        self.steps = StepChecks(core, probes=self.probes, now=now)
        self.beats = Heartbeats(core, steps=self.steps, rounds=self.rounds)
        self.liveness = Liveness(core, hangs=self.hangs, rounds=self.rounds)
        if saved is not None:
            snapshot.restore(state, saved, now=now)
            # The restored restart event waiting for its root cause goes into the new log first, once:
            # master_resumed does not hold it.
            core.event(
                "master_resumed", now=now, round=state.round_number, message=f"resumed in phase {state.phase}"
            )
        else:
            core.event("job_started", now=now, message=f"job {state.job_id} started")
            core.changed(durable=True)

    # ------------------------------------------------------------------------------------------------
    # Views

    @property
    def round_number(self) -> int:
        return self.state.round_number

    @property
    def finished(self) -> bool:
        return self.state.finished

    @property
    def shown_phase(self) -> Phase:
        return self.state.shown_phase

    @property
    def members(self) -> list[str]:
        return self.state.members

    def is_member(self, node_id: str) -> bool:
        return self.state.is_member(node_id)

    def alive(self) -> list[Node]:
        return self.state.alive()

    def absent(self, *, now: float) -> list[str]:
        return self.state.absent(now=now)

    @property
    def probe(self) -> ProbeRound | None:
        """The running or the latest probe round."""
        return self.probes.probe

    @property
    def hang(self) -> HangInquiry | None:
        """The pending hang analysis of a round."""
        return self.state.hang

    @property
    def node_scores(self) -> dict[str, NodeScore]:
        return self.steps.node_scores

    def status(self) -> views.JobView:
        """``GET /v1/job``, and what the status sink publishes."""
        s = self.state
        return views.JobView(
            job_id=s.job_id,
            phase=s.shown_phase,
            suspended=s.suspended,
            spec_generation=s.spec_generation,
            reason=s.reason,
            round=s.round_number,
            open_round=s.next_round if s.round_open else None,
            world_size=s.round.world_size if s.round else 0,
            members=s.members,
            waiting=sorted(s.joiners),
            min_nodes=s.settings.rendezvous.min_nodes,
            max_nodes=s.settings.rendezvous.max_nodes,
            nodes_alive=len(s.alive()),
            restart_count=s.restart_count,
            max_restarts=s.settings.restart.max_restarts,
            eviction_count=len(s.evictions),
            max_evictions=s.settings.restart.max_evictions,
            evictions=[views.EvictionView.model_validate(e.to_dict()) for e in s.evictions],
            committed_checkpoint_step=s.checkpoints.committed,
            max_step=s.max_step,
            root_cause=views.RootCause.model_validate(s.root_cause) if s.root_cause else None,
            hang_analysis=(
                views.HangAnalysisView.model_validate(s.last_hang_analysis.to_dict())
                if s.last_hang_analysis
                else None
            ),
            started_unix=s.started_unix,
            completed=sorted(s.completed),
            probe=self.probes.probe.view() if self.probes.probe else None,
            slow_ranks=[self.steps.slow_ranks[r] for r in sorted(self.steps.slow_ranks)],
            unconfirmed_stragglers=dict(sorted(self.probes.slow_streaks.items())),
        )

    def nodes_view(self, *, now: float) -> views.NodesView:
        """``GET /v1/nodes``: every node the master knows, by id."""
        round_ = self.round
        shown = []
        for node in sorted(self.nodes.values(), key=lambda n: n.node_id):
            member = round_.member(node.node_id) if round_ else None
            shown.append(
                node.view(
                    now=now,
                    group_rank=member.group_rank if member else None,
                    hang_count=self.hang_counts.get(node.node_id, 0),
                    straggler=self.steps.straggler_view(node.node_id),
                )
            )
        return views.NodesView(nodes=shown)

    def durable(self) -> dict[str, Any]:
        """The state a restarted master resumes from (JSON); see :mod:`phalanx.master.state.snapshot`."""
        return snapshot.durable(self.state)

    # ------------------------------------------------------------------------------------------------
    # Requests

    def check_node(self, node_id: str, incarnation: str) -> Node:
        """The node's record; RequestError for an unknown node or incarnation."""
        return self.state.node(node_id, incarnation)

    def register(self, req: pb.RegisterNodeRequest, *, now: float) -> pb.RegisterNodeResponse:
        return self.rounds.register(req, now=now)

    def join(self, req: pb.JoinRendezvousRequest, *, now: float) -> pb.JoinRendezvousResponse:
        return self.rounds.join(req, now=now)

    def get_rendezvous(self, req: pb.GetRendezvousRequest, *, now: float) -> RendezvousAnswer:
        return self.rounds.get_rendezvous(req, now=now)

    def report_completion(self, req: pb.ReportCompletionRequest, *, now: float) -> pb.Action:
        return self.rounds.report_completion(req, now=now)

    def heartbeat(
        self, req: pb.HeartbeatRequest, *, now: float, ranks: BeatRanks | None = None
    ) -> pb.HeartbeatResponse:
        """``ranks``: ``req.ranks`` as already read and checked (see :mod:`phalanx.master.state.beat`)."""
        return self.beats.heartbeat(req, now=now, ranks=ranks)

    def heartbeat_answer(self, req: pb.HeartbeatRequest, *, now: float) -> pb.HeartbeatResponse:
        """What the job has for the node now, without effect (see :meth:`Heartbeats.heartbeat_answer`)."""
        return self.beats.heartbeat_answer(req, now=now)

    def disconnected(self, req: pb.HeartbeatRequest, *, now: float) -> None:
        self.beats.disconnected(req, now=now)

    def report_failure(self, req: pb.ReportFailureRequest, *, now: float) -> pb.Action:
        return self.failures.report_failure(req, now=now)

    def report_stacks(self, req: pb.ReportStacksRequest, *, now: float) -> None:
        self.hangs.report_stacks(req, now=now)

    def report_checkpoint(
        self, req: pb.ReportCheckpointRequest, *, now: float
    ) -> pb.ReportCheckpointResponse:
        return self.fold_in.report_checkpoint(req, now=now)

    def report_probe(self, req: pb.ReportProbeRequest, *, now: float) -> None:
        self.probes.report_probe(req, now=now)

    def start_probe(self, *, now: float, trigger: str) -> ProbeRound:
        """Starts a probe round; RequestError (``failed_precondition``) when none can start now."""
        return self.probes.start_probe(now=now, trigger=trigger)

    # ------------------------------------------------------------------------------------------------
    # Time and the spec

    def follow_spec(
        self, *, suspend: bool, generation: int, now: float, scheduled_workers: int | None = None
    ) -> None:
        self.liveness.follow_spec(
            suspend=suspend, generation=generation, now=now, scheduled_workers=scheduled_workers
        )

    def suspend(self, value: bool, *, now: float) -> None:
        self.liveness.suspend(value, now=now)

    def tick(self, *, now: float) -> None:
        """Applies everything that happens with time, component by component, in this order."""
        state = self.state
        self.liveness.tick(now=now)
        if not state.finished:
            self.steps.check(now=now)
        self.probes.tick(now=now)
        self.core.settle_restart(now=now)
        if not state.round_open and (state.joiners or self.fold_in.fold_in_wait is not None):
            # Steps arrive with heartbeats and the maximum wait ends with time: a boundary is seen here.
            self.fold_in.maybe_fold_in(now=now)
