"""The master's verdicts about nodes, as typed records: an :class:`Eviction` it asks for, and the
:class:`HangAnalysis` of a hung round. ``/v1/job``, the durable state and the ElasticJob's status carry
them as JSON objects (``to_dict``); a saved state is read back with ``from_dict``."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True, kw_only=True)
class Eviction:
    """A node the master asked to evict (the operator replaces it on another machine)."""

    node_id: str
    machine: str
    reason: str
    kind: str
    """What found it: hardware, hang, straggler, probe, heartbeat_timeout, ..."""
    requested_at: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, saved: dict[str, Any]) -> Eviction:
        return cls(
            node_id=str(saved["node_id"]),
            machine=str(saved.get("machine", "")),
            reason=str(saved.get("reason", "")),
            kind=str(saved.get("kind", "")),
            requested_at=float(saved.get("requested_at", 0.0)),
        )


@dataclass(frozen=True, kw_only=True)
class HangAnalysis:
    """What the stacks of a hung round's nodes said: the node whose stacks differ from the others'."""

    round: int
    hung_node: str
    """The node whose agent found the hang."""
    odd_nodes: list[str]
    odd_ranks: list[int]
    nodes_reported: list[str]
    reason: str
    blamed: str = ""
    """The node the hang counts against after the analysis ("": none, the evidence singled out no node)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
