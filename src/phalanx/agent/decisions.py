"""The supervisor's decisions, as pure functions of what the agent observed. The executor
(:mod:`phalanx.agent.supervisor`) carries them out."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from phalanx.api.v1 import master_pb2 as pb


class Outcome(enum.Enum):
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"


def workers_outcome(codes: Mapping[int, int | None]) -> tuple[Outcome, list[int]]:
    """From the local workers' exit codes (None: still running) to the node's outcome.

    Like torchrun: one non-zero exit fails the node's workers (the rest are stopped); the node succeeded
    only when every worker exited 0.
    """
    failed = sorted(lr for lr, code in codes.items() if code not in (None, 0))
    if failed:
        return Outcome.FAILED, failed
    if codes and all(code == 0 for code in codes.values()):
        return Outcome.SUCCEEDED, []
    return Outcome.RUNNING, []


class RejoinMode(enum.Enum):
    REGROUP = "regroup"
    """Keep the workers; they re-form their groups in-process from the new round file."""
    RESTART = "restart"
    """Stop the workers and start them again with the new round's ranks."""


def rejoin_mode(*, own_failure: bool, regroup_capable: bool, workers_alive: bool) -> RejoinMode:
    """How to carry out a REJOIN. Regroup only when the cause lies elsewhere (another node left or joined)
    and every local worker is alive and announced it can regroup."""
    if not own_failure and regroup_capable and workers_alive:
        return RejoinMode.REGROUP
    return RejoinMode.RESTART


@dataclass(frozen=True)
class Next:
    """What the agent does after a master decision."""

    kind: Literal["rejoin", "exit", "wait"]
    """"rejoin": join round ``round``; "exit": stop and exit with ``exit_code``; "wait": no decision yet."""
    round: int = 0
    exit_code: int = 0
    reason: str = ""
    job_ended: bool = False
    """For "exit": the whole job ended, not just this node's part in it (see :func:`job_ended`)."""


def after_failure(action: pb.Action, *, restarts_used: int, max_restarts: int) -> Next:
    """Carries out the master's answer to ReportFailure, within this agent's --max-restarts budget.

    ``restarts_used`` counts failure restarts already done (membership changes do not count).
    """
    if action.kind == pb.ACTION_KIND_EXIT:
        return Next(
            "exit", exit_code=action.exit_code or 1, reason=action.reason, job_ended=job_ended(action)
        )
    if action.kind == pb.ACTION_KIND_REJOIN:
        if restarts_used >= max_restarts:
            return Next(
                "exit",
                exit_code=1,
                reason=f"--max-restarts={max_restarts} spent; {action.reason}".rstrip("; "),
            )
        return Next("rejoin", round=action.round, reason=action.reason)
    return Next("wait", reason=action.reason)


def job_ended(action: pb.Action) -> bool:
    """Whether an EXIT says that the job ended (it names the round it ended in), rather than that this node
    leaves a job that goes on (evicted, replaced). Only a job that ended is worth waiting for on the way out
    until every node's save at breakpoint settled: a job that goes on keeps the state in its survivors."""
    return action.kind == pb.ACTION_KIND_EXIT and action.round > 0


def is_new_rejoin(action: pb.Action, *, current_round: int) -> bool:
    """A REJOIN matters only for a round after the one the node already runs (heartbeats may repeat it)."""
    return action.kind == pb.ACTION_KIND_REJOIN and (action.round == 0 or action.round > current_round)


def refill_due(*, spares: int, wanted: int, since_handover_s: float, workers_stepped: bool) -> bool:
    """Start new warm spares once the new workers got going: importing torch competes for the same cores,
    so it waits until every worker reported a step in its round, or 5 s at most."""
    if spares >= wanted:
        return False
    return workers_stepped or since_handover_s > 5.0
