"""What the job's decisions ask for, as values: the job's one writer
(:meth:`phalanx.master.job.core.JobCore.apply`) carries
them out, in order.

A component that decides (a failure report's handling, a hang's analysis) reads the state, calls pure
functions, and returns a list of effects; it writes nothing. So a decision can be read, tested and logged
as data, and every change of the job's state is made in one place, in the order the list gives.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from phalanx.api.elasticjob import Phase
from phalanx.api.v1 import master_pb2 as pb
from phalanx.api.verdicts import HangAnalysis
from phalanx.master.decide.failure_policy import FailureRecord
from phalanx.master.state.events import EventKind
from phalanx.master.state.jobstate import HangInquiry, PendingRestart

__all__ = [
    "AmendRestart",
    "AskStacks",
    "ChargeHang",
    "Effect",
    "Emit",
    "Evict",
    "Finish",
    "HoldRestart",
    "KeepStacks",
    "NoteFailures",
    "OpenRound",
    "Push",
    "RecordHangAnalysis",
    "Restart",
    "Saved",
    "SeeNode",
    "SetRootCause",
    "SettleRestart",
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
    """One more of ``label`` in one of the job's counters for ``/metrics``."""

    counter: Literal["failures", "hang_verdicts"]
    label: str


@dataclass(frozen=True)
class SeeNode:
    """The node was heard from now."""

    node_id: str


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
