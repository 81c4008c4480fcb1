"""The job's state: one record every room of the job (:mod:`phalanx.master.job`) reads and writes.

The fields marked *durable* are what :mod:`phalanx.master.snapshot` saves and restores; the others live and
die with the master process. What only one room needs (a probe round, a hang inquiry, a fold-in wait) is
kept by that room, not here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from phalanx.api.elasticjob import FINISHED_PHASES, Phase
from phalanx.api.settings import MasterSettings
from phalanx.api.verdicts import Eviction, HangAnalysis
from phalanx.master import rendezvous as rdzv
from phalanx.master.breakpoints import Breakpoint
from phalanx.master.checkpoints import CheckpointTracker
from phalanx.master.events import EventLog
from phalanx.master.membership import ALIVE, Node
from phalanx.master.policy import FailureRecord
from phalanx.master.recovery import RecoveryTracker
from phalanx.master.stats import JobStats
from phalanx.master.timeline import Timeline

__all__ = ["JobState"]


@dataclass(kw_only=True, eq=False)
class JobState:
    """Everything of one job several rooms share. Durable fields first (see :mod:`.snapshot`)."""

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
    """Durable: whether the job's spec asks it to be suspended (see :mod:`phalanx.master.core`)."""
    events: EventLog = field(default_factory=EventLog)
    """Durable: only its next seq."""
    action_seq: int = 0
    """Durable: the seq of the newest one-shot action, so seqs grow across restarts."""
    next_probe: int = 1
    """Durable: the next probe round's id, so a report to an old master stays stale."""

    joiners: dict[str, rdzv.Joiner] = field(default_factory=dict)
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
