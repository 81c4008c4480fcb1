"""What ends a stretch of the agent's work: an :class:`Event` ends the monitoring of a round's workers,
:class:`AgentExit` and :class:`Terminated` end the agent."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from phalanx.api.v1 import master_pb2 as pb

EventKind = Literal["failed", "hang", "succeeded", "rejoin", "exit", "stacks"]
"""What ended the monitoring: workers failed, one hung, all succeeded, the master said rejoin or exit, or
the master asked for the workers' stacks."""


@dataclass
class Event:
    """What ended a stretch of monitoring."""

    kind: EventKind
    local_ranks: list[int] = field(default_factory=list)
    action: pb.Action | None = None
    reason: str = ""
    evidence: pb.HangEvidence | None = None
    """For a hang: the verdict's evidence (side, age, timeout, the rank's activity)."""
    seen_unix_ns: dict[int, int] = field(default_factory=dict)
    """For a failure: when each failed local rank was first seen exited (a SIGKILLed rank has no error
    file to date it: it is dated by this, not by the report's time, which a settle puts up to 1 s later)."""


class AgentExit(Exception):
    """Ends the agent with an exit code."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


class Terminated(BaseException):
    """SIGTERM reached the agent (its Pod deleted, its machine drained, its job suspended). A BaseException,
    like SystemExit, so that no handler meant for errors swallows it."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"signal {signum}")
        self.signum = signum
