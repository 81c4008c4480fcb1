"""A lost node's replacement folded into the job, counted as part of the fault that lost the node.

A node kill is one fault, recovered in two rounds: the survivors re-form at a smaller world at once, and
the replacement joins a later round (the master opens it at a checkpoint boundary, see
:mod:`phalanx.master.decide.foldin`). The summary's row of the fault says both: when the survivors trained
again (``recovered``), and when, at which step and at what cost the replacement was folded in.

Pure bookkeeping: :mod:`phalanx.local.accounting` feeds it what :class:`phalanx.local.cluster.LocalCluster`
observes (replacements started, rounds opened, the job's round and members, the workers' beacons) with its
own clock.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field


@dataclass
class FoldIn:
    """The fold-in of one fault's replacement node; times are seconds since the run started."""

    node: str
    """The replacement's node id."""
    survivors: tuple[str, ...] = ()
    """The nodes that trained on while the replacement started."""
    base_round: int = 0
    """The round the survivors trained in when the replacement started: the fold-in is a later one."""
    reformed_world: int = 0
    """The world size the survivors trained at meanwhile (0: none, the replacement joined the round that
    re-formed the job after the fault)."""
    opened_at: float | None = None
    """When the round that took the replacement in opened."""
    reason: str = ""
    """The master's reason for opening it (for a scale up: the checkpoint boundary it waited for)."""
    round: int = 0
    """The round that took the replacement in (0: not yet)."""
    world: int = 0
    formed_at: float | None = None
    """When the poller first saw that round formed: the survivors had stopped, saved at breakpoint and
    joined it (the rest of the cost is the restart itself: processes, restore, first step)."""
    round_seen_ns: int = 0
    """When the poller first saw that round (Unix ns): a step reported after it is the new round's."""
    last_steps: dict[tuple[str, int], int] = field(default_factory=dict)
    """Each survivor rank's (node, local rank) newest step in the round it trained alone: a rank's beacon
    may be unreadable at a poll, or already reset by the next round's worker, so each rank's own maximum is
    kept rather than one poll's minimum."""
    base_since_ns: int = 0
    """Beacon updates before this (Unix ns) belong to an older round (0: the round was running already)."""
    folded_at: float | None = None
    """The first step completed by the job with the replacement."""
    resumed_step: int | None = None
    steps_lost: int | None = None

    @property
    def cost_s(self) -> float | None:
        """From the round opening to the first step with the replacement: what the fold-in cost."""
        if self.opened_at is None or self.folded_at is None:
            return None
        return self.folded_at - self.opened_at

    def to_json(self) -> dict[str, object]:
        cost = self.cost_s
        return {
            "node": self.node,
            "round": self.round,
            "world": self.world,
            "reformed_world": self.reformed_world,
            "opened_at": None if self.opened_at is None else round(self.opened_at, 3),
            "formed_at": None if self.formed_at is None else round(self.formed_at, 3),
            "folded_at": None if self.folded_at is None else round(self.folded_at, 3),
            "cost_s": None if cost is None else round(cost, 3),
            "step": self.resumed_step,
            "steps_lost": self.steps_lost,
            "reason": self.reason,
        }

    def described(self, *, injected_at: float) -> str:
        if self.folded_at is None:
            return f"{self.node} not folded in before the run ended"
        if not self.reformed_world:
            return (
                f"{self.node} joined the re-formed round {self.round} at step {self.resumed_step}, "
                f"{self.folded_at - injected_at:.2f}s after the fault, {self.steps_lost} steps lost"
            )
        return (
            f"re-formed at world {self.reformed_world}, {self.node} folded in at step {self.resumed_step} "
            f"(round {self.round}) {self.folded_at - injected_at:.2f}s after the fault, "
            f"{self.steps_lost} steps lost"
        )


def started(*, node: str, lost: str, round_: int, members: Iterable[str], world: int) -> FoldIn:
    """``node`` started to replace ``lost`` while the job's round was ``round_``, with ``members`` at
    ``world``: the survivors' round, or still the one ``lost`` was in when they have not re-formed yet."""
    survivors = tuple(m for m in members if m != lost)
    before_reform = len(survivors) < len(tuple(members))
    return FoldIn(
        node=node, survivors=survivors, base_round=round_, reformed_world=0 if before_reform else world
    )


def round_opened(fold: FoldIn, *, at: float, reason: str) -> None:
    """A round opened (the replacement may join it); the last one before the fold-in round counts."""
    if fold.round == 0:
        fold.opened_at, fold.reason = at, reason


def observe(
    fold: FoldIn,
    *,
    at: float,
    now_ns: int,
    round_: int,
    members: Iterable[str],
    world: int,
    running: bool,
    steps: Mapping[tuple[str, int], tuple[int, int]],
) -> bool:
    """Follows the job at one poll (``at``: run time, ``now_ns``: Unix ns): its ``round_``, ``members`` and
    ``world``, whether it is ``running``, and each worker's (node, local rank) -> (step, unix_ns) from its
    beacon. True when this poll saw the first step of the job with the replacement: the fold-in is
    complete."""
    if fold.folded_at is not None:
        return False
    if fold.round == 0:
        if round_ == fold.base_round:
            # The survivors' workers still run the round without the replacement.
            for key, (step, unix_ns) in steps.items():
                if key[0] in fold.survivors and step >= 0 and unix_ns > fold.base_since_ns:
                    fold.last_steps[key] = max(step, fold.last_steps.get(key, -1))
            return False
        if fold.node not in set(members):
            # Another round without it (a second fault): the replacement joins a later one.
            fold.base_round, fold.survivors, fold.reformed_world = round_, tuple(members), world
            fold.opened_at, fold.last_steps, fold.base_since_ns = None, {}, now_ns
            return False
        fold.round, fold.world, fold.formed_at, fold.round_seen_ns = round_, world, at, now_ns
    if not running or round_ != fold.round:
        return False
    fresh = [s for s, ns in steps.values() if ns > fold.round_seen_ns and s >= 0]
    if not fresh:
        return False
    fold.folded_at = at
    fold.resumed_step = min(fresh)
    # The job had completed the slowest survivor rank's last step; the steps from the resumed one up to it
    # are trained again.
    before = min(fold.last_steps.values(), default=-1)
    fold.steps_lost = max(0, before - fold.resumed_step + 1) if before >= 0 else 0
    return True
