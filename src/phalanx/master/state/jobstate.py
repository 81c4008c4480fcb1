"""The job's state: one record the job's components (:mod:`phalanx.master.job`) read, and the job's writer
(:class:`~phalanx.master.job.core.JobCore`) writes.

The fields marked *durable* are what :mod:`phalanx.master.state.snapshot` saves and restores; the others live
and die with the master process. What only one component needs (a probe round, a fold-in wait) is kept by that
component, not here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from phalanx.api.elasticjob import FINISHED_PHASES, Phase
from phalanx.api.settings import MasterSettings
from phalanx.api.v1 import master_pb2 as pb
from phalanx.api.verdicts import Eviction, HangAnalysis
from phalanx.master.decide import rendezvous as rdzv
from phalanx.master.decide.failure_policy import FailureRecord
from phalanx.master.errors import RequestError
from phalanx.master.state.breakpoints import Breakpoint
from phalanx.master.state.checkpoints import CheckpointTracker
from phalanx.master.state.counters import JobStats
from phalanx.master.state.events import EventLog
from phalanx.master.state.nodes import ALIVE, Node, absent, gone
from phalanx.master.state.recovery import RecoveryTracker
from phalanx.master.state.timeline import Timeline

__all__ = ["GONE_AFTER_INTERVALS", "HangInquiry", "JobState", "PendingRestart"]

GONE_AFTER_INTERVALS = 3
"""Heartbeat intervals a node whose connection closed may stay silent, while others are heard, before it is
lost (:meth:`JobState.gone`): three for an agent that reconnects within one, 3 s with the defaults against the
10 s heartbeat timeout."""


@dataclass
class PendingRestart:
    """A restart done and its event not yet emitted: it waits (:func:`phalanx.master.job.restarts.settled`)
    for the round's
    other reports, so that it names the root cause even when the echo's node reports first."""

    round: int
    at: float
    node: str
    rank: int
    message: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, saved: Mapping[str, Any]) -> PendingRestart:
        """Raises KeyError, TypeError or ValueError for a malformed one."""
        return cls(
            round=int(saved["round"]),
            at=float(saved["at"]),
            node=str(saved["node"]),
            rank=int(saved["rank"]),
            message=str(saved["message"]),
        )


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


@dataclass(kw_only=True, eq=False)
class JobState:
    """Everything of one job its components share. Durable fields first (see
    :mod:`phalanx.master.state.snapshot`)."""

    settings: MasterSettings
    job_id: str
    """Durable (checked on restore)."""
    started_unix: float
    """Durable."""
    opened_at: float
    """When the open round opened (a restored master: when it resumed)."""
    below_min_since: float | None
    """Since when fewer than ``min_nodes`` nodes are alive (None: enough, or waiting for the scheduler)."""
    phase: Phase = Phase.PENDING
    """Durable."""
    reason: str = ""
    """Durable."""
    round: rdzv.Round | None = None
    """Durable: the running (completed) rendezvous round."""
    next_round: int = 1
    """Durable."""
    round_open: bool = True
    """Durable."""
    restart_count: int = 0
    """Durable."""
    evictions: list[Eviction] = field(default_factory=list)
    """Durable."""
    checkpoints: CheckpointTracker = field(default_factory=CheckpointTracker)
    """Durable (the committed step)."""
    nodes: dict[str, Node] = field(default_factory=dict)
    """Durable."""
    hang_counts: dict[str, int] = field(default_factory=dict)
    """Durable: node -> hangs counted against it."""
    completed: set[str] = field(default_factory=set)
    """Durable: the members that completed the running round."""
    root_cause: dict[str, Any] | None = None
    """Durable."""
    suspended: bool = False
    """Durable: whether the job's spec asks it to be suspended (see :mod:`phalanx.master.job.core`)."""
    events: EventLog = field(default_factory=EventLog)
    """Durable: only its next seq."""
    action_seq: int = 0
    """Durable: the seq of the newest one-shot action, so seqs grow across restarts."""
    next_probe: int = 1
    """Durable: the next probe round's id, so a report to an old master stays stale."""
    pending_restart: PendingRestart | None = None
    """Durable: the restart whose event waits for the round's root cause (see
    :mod:`phalanx.master.job.restarts`)."""

    joiners: dict[str, rdzv.Joiner] = field(default_factory=dict)
    hang: HangInquiry | None = None
    """The pending hang analysis of a round."""
    activities: dict[int, tuple[str, int, pb.RankActivity]] = field(default_factory=dict)
    """Each global rank's last ``RankActivity`` from heartbeats: rank -> (node, round, activity). Where the
    ranks are when a hang is reported: the ones that never entered the collective the others wait in are
    the suspects (not durable: a restarted master learns them again within a heartbeat)."""
    early_stacks: tuple[int, dict[str, dict[int, pb.RankStacks]]] = (0, {})
    """Stacks of the current round that came before any hang analysis asked for them (round, node -> rank
    -> dump): an agent that detects a hang sends its stacks first and then reports the failure that starts
    the analysis, and so may every node whose ranks block in the same collective."""
    breakpoint: Breakpoint | None = None
    """The save at breakpoint of the newest broken round (not durable: a restarted master only misses
    the correction of a straddled step)."""
    round_failures: list[FailureRecord] = field(default_factory=list)
    last_hang_analysis: HangAnalysis | None = None
    max_step: int = -1
    scheduled_workers: int | None = None
    """How many worker Pods the Kubernetes scheduler placed, as the operator last said (None outside
    Kubernetes). Fewer than min_nodes: the missing nodes wait for capacity (a queue, an autoscaler), so
    the min-nodes timeout does not run; it starts when they could be scheduled."""
    spec_generation: int = 0
    """The generation of the ElasticJob spec the job follows (0: none, outside Kubernetes); published so
    the operator knows an acknowledgement is of the spec it sees. Not durable: a restarted master
    reads the spec again."""
    stats: JobStats = field(default_factory=JobStats)
    timeline: Timeline = field(default_factory=Timeline)
    """The ranks' recent intervals and the failures, for ``phalanx timeline`` (not durable)."""
    recovery: RecoveryTracker = field(default_factory=RecoveryTracker)
    """Durable: where each recovery's time goes (detect, reform, restore, recompute), the one in progress
    and the finished ones' totals (the master's metrics)."""
    durable_version: int = 0
    status_version: int = 0
    round_version: int = 0
    action_version: int = 0
    """Moves whenever some node may have a new action (a round opened, one-shot actions, EXIT): held
    heartbeats wake up on it."""

    _member_set: tuple[rdzv.Round | None, frozenset[str]] = (None, frozenset())

    @classmethod
    def new(cls, settings: MasterSettings, *, now: float) -> JobState:
        """A job that has just started, waiting for its first round."""
        return cls(
            settings=settings, job_id=settings.job_id, started_unix=now, opened_at=now, below_min_since=now
        )

    @property
    def round_number(self) -> int:
        return self.round.number if self.round else 0

    @property
    def finished(self) -> bool:
        return self.phase in FINISHED_PHASES

    @property
    def shown_phase(self) -> Phase:
        """The phase people and the operator see: Suspended while the job is (the decisions use ``phase``,
        which the suspension leaves as it was)."""
        return Phase.SUSPENDED if self.suspended and not self.finished else self.phase

    @property
    def members(self) -> list[str]:
        return self.round.node_ids if self.round else []

    def is_member(self, node_id: str) -> bool:
        """``node_id in self.members`` without building the list: every heartbeat asks, and with a thousand
        nodes the list cost more than the rest of the beat. A completed round never changes (frozen), so
        the set is made once per round."""
        round = self.round
        if round is None:
            return False
        if self._member_set[0] is not round:
            self._member_set = (round, frozenset(round.node_ids))
        return node_id in self._member_set[1]

    def alive(self) -> list[Node]:
        return [n for n in self.nodes.values() if n.status == ALIVE]

    def absent(self, *, now: float) -> list[str]:
        """Live nodes whose agent is most likely gone (see :func:`phalanx.master.state.nodes.absent`); the
        grace is one heartbeat interval, within which a live agent whose connection broke heartbeats again."""
        return absent(self.nodes.values(), now=now, grace_s=self.settings.heartbeat.interval_s)

    def gone(self, *, now: float) -> list[str]:
        """Live nodes whose connection closed and that stayed silent for :meth:`gone_after_s` while others
        were heard (see :func:`phalanx.master.state.nodes.gone`)."""
        return gone(self.nodes.values(), now=now, after_s=self.gone_after_s())

    def gone_after_s(self) -> float:
        """How long a node whose connection closed may stay silent before it is lost: a few heartbeat
        intervals (a live agent reconnects within one), never longer than the heartbeat timeout."""
        hb = self.settings.heartbeat
        return min(hb.timeout_s, GONE_AFTER_INTERVALS * hb.interval_s)

    def round_step(self) -> int:
        """The newest step a rank of the running round reported (-1: none yet). Not ``max_step``: after a
        restore from an older step, the job is behind it until the lost steps are trained again."""
        top = -1
        for node_id in self.members:
            node = self.nodes.get(node_id)
            if node is not None and node.hb_round == self.round_number:
                for r in node.ranks:
                    top = max(top, r.step)
        return top

    def node(self, node_id: str, incarnation: str) -> Node:
        """The node's record; RequestError for an unknown node or incarnation."""
        node = self.nodes.get(node_id)
        if node is None:
            raise RequestError(
                f"node {node_id!r} is not registered; call RegisterNode first", code="not_found"
            )
        if node.incarnation != incarnation and incarnation not in node.old_incarnations:
            raise RequestError(f"unknown incarnation {incarnation!r} of node {node_id!r}")
        return node
