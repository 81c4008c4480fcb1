"""What the job answers its agents, from its state alone: actions, and the EXIT a finished job, a node
that must leave, or a replaced incarnation gets."""

from __future__ import annotations

from typing import Any

from phalanx.api.elasticjob import Phase
from phalanx.api.v1 import master_pb2 as pb
from phalanx.master.state.jobstate import JobState
from phalanx.master.state.nodes import ALIVE, Node

__all__ = ["action", "end_reason", "ending", "exit_action"]


def action(kind: int, **fields: Any) -> pb.Action:
    """An Action for an agent (``kind`` is an ``ACTION_KIND_*`` value)."""
    return pb.Action(kind=kind, **fields)  # type: ignore[arg-type]


def ending(phase: Phase, reason: str) -> str:
    """Why the job ended, as its agents are told."""
    return f"job {phase.lower()}: {reason}" if reason else f"job {phase.lower()}"


def end_reason(state: JobState) -> str:
    return ending(state.phase, state.reason)


def exit_action(state: JobState, node: Node, incarnation: str) -> pb.Action | None:
    """EXIT for a finished job, an evicted or lost node, or a replaced incarnation; None otherwise."""
    if state.finished:
        code = 0 if state.phase == Phase.SUCCEEDED else 1
        return action(pb.ACTION_KIND_EXIT, round=state.round_number, exit_code=code, reason=end_reason(state))
    if incarnation != node.incarnation:
        return action(pb.ACTION_KIND_EXIT, exit_code=1, reason="replaced by a newer incarnation of this node")
    if node.status != ALIVE:
        return action(pb.ACTION_KIND_EXIT, exit_code=1, reason=node.exit_reason or f"node {node.status}")
    return None
