"""What the job's decisions ask of its state, as values: the job's one writer
(:meth:`phalanx.master.job.core.JobCore.apply`) carries them out, in order.

A component reads the state, calls pure functions, and hands the writer a list of effects; it writes
nothing itself. So a decision can be read, tested and logged as data (:func:`.failures.plan_failure`
returns one whole), and every change of the job's state is made in one place, in the order the list gives.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from phalanx.api import views
from phalanx.api.elasticjob import Phase
from phalanx.api.v1 import master_pb2 as pb
from phalanx.api.verdicts import HangAnalysis
from phalanx.master.decide import rendezvous as rdzv
from phalanx.master.decide.failure_policy import FailureRecord
from phalanx.master.state.beat import BeatRanks
from phalanx.master.state.events import EventKind
from phalanx.master.state.jobstate import HangInquiry, PendingRestart
from phalanx.master.state.nodes import Node

__all__ = [
    "AddNode",
    "AmendRestart",
    "Answered",
    "AskStacks",
    "Beat",
    "BreakpointReport",
    "ChargeHang",
    "CompleteRound",
    "Completed",
    "Disconnected",
    "DropNodes",
    "DropProbeActions",
    "Effect",
    "Emit",
    "Evict",
    "Finish",
    "Forget",
    "HeldInMemory",
    "HoldRestart",
    "Join",
    "KeepStacks",
    "LeaveOut",
    "MinNodesClock",
    "NextProbe",
    "NoteFailures",
    "OpenRound",
    "Persisted",
    "Probed",
    "Push",
    "RecordHangAnalysis",
    "Restart",
    "Saved",
    "Scheduled",
    "SeeNode",
    "SetRootCause",
    "SettleBreakpoint",
    "SettleRestart",
    "SpecGeneration",
    "Suspend",
    "Tally",
]


@dataclass(frozen=True)
class Emit:
    """An event (see :meth:`phalanx.master.job.core.JobCore.event`); ``log``: a logger's method that says it
    too."""

    kind: EventKind
    message: str
    node: str = ""
    rank: int = -1
    round: int = -1
    log: Callable[..., None] | None = None
    hang: list[dict[str, Any]] | None = None


@dataclass(frozen=True)
class Tally:
    """One more in one of the job's counters for ``/metrics``: of ``label``, for a counter by label."""

    counter: Literal[
        "failures",
        "hang_verdicts",
        "probe_rounds",
        "probe_reports_stale",
        "slow_step_verdicts",
        "checkpoint_failures",
    ]
    label: str = ""


@dataclass(frozen=True)
class SeeNode:
    """The node was heard from now; with what it said of itself (None: unchanged)."""

    node_id: str
    agent_version: str | None = None
    nproc: int | None = None


@dataclass(frozen=True)
class Beat:
    """A heartbeat: what the node says of itself and its ranks' progress (see :meth:`Node.heard`), the
    actions it acknowledged, the job's newest step, the recovery's dates and the timeline; of a node that
    must leave (``heard`` False: its answer is EXIT), only that it beat."""

    req: pb.HeartbeatRequest
    ranks: BeatRanks
    heard: bool


@dataclass(frozen=True)
class Answered:
    """A heartbeat answer carried the node's pending actions (a held heartbeat: connected all along)."""

    node_id: str


@dataclass(frozen=True)
class Disconnected:
    """The connection of the node's held heartbeat closed before its answer."""

    node_id: str


@dataclass(frozen=True)
class DropNodes:
    """Records of nodes lost long ago, dropped to make room for new ones."""

    node_ids: tuple[str, ...]


@dataclass(frozen=True)
class AddNode:
    """A node registered, or a new incarnation of one (which then leaves the round's joiners)."""

    node: Node
    replaces: bool


@dataclass(frozen=True)
class Join:
    """A node joined the open round (its nproc as it said)."""

    joiner: rdzv.Joiner


@dataclass(frozen=True)
class CompleteRound:
    """The open round completed: the job runs ``round``."""

    round: rdzv.Round


@dataclass(frozen=True)
class Completed:
    """The node completed its work in the running round."""

    node_id: str


@dataclass(frozen=True)
class Scheduled:
    """How many worker Pods the scheduler placed, as the operator last said (None: not known)."""

    workers: int | None


@dataclass(frozen=True)
class SpecGeneration:
    """The generation of the ElasticJob spec the job follows (published: the operator waits for it)."""

    generation: int


@dataclass(frozen=True)
class Suspend:
    """The job is suspended (or resumed): held heartbeats wake to learn it."""

    value: bool


@dataclass(frozen=True)
class MinNodesClock:
    """Since when fewer than ``min_nodes`` nodes are alive (None: enough, or their time has not started)."""

    since: float | None


@dataclass(frozen=True)
class Forget:
    """A node that left a suspended job is dropped."""

    node_id: str
    why: str


@dataclass(frozen=True)
class LeaveOut:
    """The rounds stop waiting for an absent node, once per disconnection."""

    node_id: str


@dataclass(frozen=True)
class SettleBreakpoint:
    """The breakpoint's step is agreed once every reachable member reported (``answered`` learns it from
    its own response)."""

    answered: str = ""


@dataclass(frozen=True)
class Persisted:
    """A node persisted its shards of a step (a step is committed once every shard is)."""

    step: int
    ranks: tuple[int, ...]
    world_size: int


@dataclass(frozen=True)
class HeldInMemory:
    """The node holds ``step`` in memory."""

    node_id: str
    step: int


@dataclass(frozen=True)
class BreakpointReport:
    """What a node of broken round ``round`` holds in memory and would persist (the breakpoint of that
    round is opened with the running round's members if it is not yet)."""

    node_id: str
    round: int
    held: tuple[int, ...]
    persisting: int


@dataclass(frozen=True)
class NextProbe:
    """A probe round took the next probe id."""


@dataclass(frozen=True)
class Probed:
    """A node's probe results of one kind, kept on the node."""

    node_id: str
    kind: str
    results: tuple[views.PeerProbe, ...]


@dataclass(frozen=True)
class DropProbeActions:
    """A probe round ended: its RUN_PROBE actions not yet delivered are dropped."""

    probe_round: int
    node_ids: tuple[str, ...]


@dataclass(frozen=True)
class NoteFailures:
    """Failure records of the running round, which later reports of the round are judged with."""

    records: tuple[FailureRecord, ...]


@dataclass(frozen=True)
class SetRootCause:
    """The round's root cause (JSON); ``job_reason``: the failed job's reason, revised with it."""

    cause: dict[str, Any]
    job_reason: str | None = None


@dataclass(frozen=True)
class AmendRestart:
    """The restart event still waiting names a better cause; ``failed``: its failure's time (0: keep)."""

    node: str
    rank: int
    message: str
    failed: float


@dataclass(frozen=True)
class Restart:
    """The job restarts in place: one more restart, and a recovery timed from ``failed`` (0: unknown)."""

    failed: float


@dataclass(frozen=True)
class HoldRestart:
    """The restart's event waits for the round's root cause (one still waiting is emitted first)."""

    pending: PendingRestart


@dataclass(frozen=True)
class SettleRestart:
    """The restart event still waiting is emitted once the round's root cause is settled."""


@dataclass(frozen=True)
class OpenRound:
    """The next rendezvous round opens (survivors get REJOIN)."""

    why: str


@dataclass(frozen=True)
class Evict:
    """The node is evicted (its kind counted; the job fails when the budget is spent); a new round opens
    with ``reopen_why`` when it was in the running round (or, ``joiners_too``, waiting to join one)."""

    node_id: str
    kind: str
    reason: str
    reopen_why: str
    joiners_too: bool = False


@dataclass(frozen=True)
class Finish:
    """The job ends in ``phase``."""

    phase: Phase
    reason: str


@dataclass(frozen=True)
class Push:
    """One-shot actions for the node's next heartbeat responses."""

    node_id: str
    actions: tuple[pb.Action, ...]


@dataclass(frozen=True)
class AskStacks:
    """A hang analysis starts: ``inquiry`` is kept, its charge counted, the members that have not sent
    their stacks are asked for them (``dump``), and the ``hang`` event says so."""

    inquiry: HangInquiry
    ask: tuple[str, ...]
    dump: pb.Action
    message: str


@dataclass(frozen=True)
class KeepStacks:
    """A member's stacks: for the pending analysis of ``round``, or kept for one the round may start."""

    node_id: str
    round: int
    stacks: dict[int, pb.RankStacks]


@dataclass(frozen=True)
class RecordHangAnalysis:
    """A hang analysis ended (the inquiry is closed) with ``analysis``."""

    analysis: HangAnalysis


@dataclass(frozen=True)
class ChargeHang:
    """``delta`` hangs more (or fewer) counted against the node."""

    node_id: str
    delta: int


@dataclass(frozen=True)
class Saved:
    """The job's status changed; ``durable``: and so did its durable state."""

    durable: bool = True


Effect = (
    Emit
    | Tally
    | SeeNode
    | Beat
    | Answered
    | Disconnected
    | DropNodes
    | AddNode
    | Join
    | CompleteRound
    | Completed
    | Scheduled
    | SpecGeneration
    | Suspend
    | MinNodesClock
    | Forget
    | LeaveOut
    | SettleBreakpoint
    | Persisted
    | HeldInMemory
    | BreakpointReport
    | NextProbe
    | Probed
    | DropProbeActions
    | NoteFailures
    | SetRootCause
    | AmendRestart
    | Restart
    | HoldRestart
    | SettleRestart
    | OpenRound
    | Evict
    | Finish
    | Push
    | AskStacks
    | KeepStacks
    | RecordHangAnalysis
    | ChargeHang
    | Saved
)
"""Everything a decision may ask of the writer."""
