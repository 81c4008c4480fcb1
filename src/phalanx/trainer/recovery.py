"""Deciding, after every (re)group, where each rank's training state comes from. Pure; no I/O.

Every rank contributes one row: the step of the state it holds for its (new) mesh coordinate, or -1
when it holds none (a fresh process, or a survivor whose coordinate moved), and the most recent
checkpoint steps it can load for that coordinate. From the gathered table every rank computes the same
:class:`RecoveryPlan`:

* every rank is fresh: load the newest checkpoint all coordinates have, or start from the seed;
* every coordinate still has a replica at one common step: ranks at that step keep their state, the
  others receive it by broadcast from the lowest data rank that has it (no storage read);
* otherwise (a whole tensor or pipeline group was lost, or replicas disagree): every rank loads the newest
  checkpoint all of them can load, in the same process; without one, restart the processes.

Loading in place rather than restarting spares the processes' start (seconds of imports on the recovery
path), and the agent's and master's restart budgets: the restart was a consequence of a fault already
counted (a node eviction, a worker failure), and it spent one more restart per fault.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum

from phalanx.trainer.mesh import ParallelConfig, coord_of, group_ranks

NO_STATE = -1
CHECKPOINT_SLOTS = 4
"""How many of its newest loadable checkpoint steps each rank reports."""


class Action(Enum):
    """What the ranks do with their state after a (re)group."""

    CONTINUE = "continue"
    """Every rank holds the agreed step already (a fresh start from the seed counts as step 0)."""
    BROADCAST = "broadcast"
    """Some ranks receive the state from a data-parallel peer."""
    LOAD = "load"
    """Every rank loads the agreed checkpoint step."""
    RESTART = "restart"
    """Some shard has no replica left and no checkpoint every rank can load: exit so the agent restarts
    the processes."""


@dataclass(frozen=True, kw_only=True)
class Row:
    """What one rank reports: its state's step (or NO_STATE) and its loadable checkpoint steps."""

    step: int
    checkpoints: tuple[int, ...] = ()


@dataclass(frozen=True, kw_only=True)
class RecoveryPlan:
    action: Action
    step: int
    """The step every rank resumes at."""
    sources: dict[int, int] = field(default_factory=dict)
    """For BROADCAST: data group (by its lowest rank) -> global rank that broadcasts."""
    receivers: frozenset[int] = frozenset()
    """For BROADCAST: global ranks whose state is replaced."""
    reason: str = ""


def plan_recovery(rows: Sequence[Row], *, config: ParallelConfig) -> RecoveryPlan:
    """The plan every rank derives from the same gathered ``rows`` (indexed by global rank)."""
    world = len(rows)
    common = set(rows[0].checkpoints) if rows else set()
    for r in rows[1:]:
        common &= set(r.checkpoints)
    if all(r.step == NO_STATE for r in rows):
        if common:
            return RecoveryPlan(
                action=Action.LOAD, step=max(common), reason="fresh processes, checkpoint found"
            )
        return RecoveryPlan(action=Action.CONTINUE, step=0, reason="fresh start from the seed")
    best: dict[int, int] = {}
    for ranks in group_ranks(config=config, world_size=world)["data"]:
        best[ranks[0]] = max(rows[r].step for r in ranks)
    steps = set(best.values())
    if NO_STATE in steps or len(steps) > 1:
        if NO_STATE in steps:
            lost = [coord_of(g, config=config) for g, s in best.items() if s == NO_STATE]
            why = "no replica left of " + ", ".join(
                f"(pipeline {c.pipeline}, tensor {c.tensor})" for c in lost
            )
        else:
            why = f"replicas disagree on the step: {sorted(steps)}"
        if common:
            return RecoveryPlan(
                action=Action.LOAD, step=max(common), reason=f"{why}; every rank loads step {max(common)}"
            )
        return RecoveryPlan(action=Action.RESTART, step=NO_STATE, reason=f"{why}, and no checkpoint to load")
    step = steps.pop()
    sources: dict[int, int] = {}
    receivers: set[int] = set()
    for ranks in group_ranks(config=config, world_size=world)["data"]:
        behind = [r for r in ranks if rows[r].step != step]
        if behind:
            sources[ranks[0]] = next(r for r in ranks if rows[r].step == step)
            receivers.update(behind)
    if not receivers:
        return RecoveryPlan(action=Action.CONTINUE, step=step, reason="every rank holds the state")
    return RecoveryPlan(
        action=Action.BROADCAST,
        step=step,
        sources=sources,
        receivers=frozenset(receivers),
        reason=f"{len(receivers)} rank(s) receive the state from a data-parallel peer",
    )


def encode(row: Row) -> list[int]:
    """A fixed-width integer row for an all-gather (no pickle across processes)."""
    slots = sorted(row.checkpoints, reverse=True)[:CHECKPOINT_SLOTS]
    return [row.step, *slots, *([NO_STATE] * (CHECKPOINT_SLOTS - len(slots)))]


def decode(values: Sequence[int]) -> Row:
    """Inverse of :func:`encode`."""
    return Row(step=int(values[0]), checkpoints=tuple(int(v) for v in values[1:] if v != NO_STATE))
