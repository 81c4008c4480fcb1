"""When nodes waiting beside a running round are folded into the job: right after a checkpoint boundary.

A node is lost: the survivors re-form at once at a smaller world and train on, and the replacement that
the operator (or ``phalanx local``) starts joins later. Folding it in is a second round: every worker
stops, the agents save at breakpoint (:mod:`phalanx.master.state.breakpoints`), and all ranks restore the step
that save persisted. Where that step is older than the job's own, the steps between are trained again:
a job that snapshots every ``k`` steps loses up to ``k - 1`` of them when the round opens at an arbitrary
moment, none when it opens just after a snapshot. Training on at the smaller world meanwhile only costs
the missing nodes' share of the throughput (a third, for one node of three), while a lost step costs the
whole world's; so the master waits for the boundary, and never longer than ``max_wait_s``.

What the master knows of the job's checkpoints:

* the *snapshot cadence*, from the steps the agents hold in memory at the newest save at breakpoint (the
  node loss's own re-form has one): two snapshots one step apart mean the job snapshots every step, and
  then any moment is a boundary (the save at breakpoint persists the newest step, nothing is lost);
* the *committed step* (every shard persisted): when it advances, a checkpoint was just taken;
* nothing, for a script that checkpoints on its own (``torch.save``): there is no boundary the master
  could wait for, and waiting would only cost throughput.

Pure: plain values in, a decision out (:func:`decide`); :class:`phalanx.master.job.Job` applies it when a
node joins beside a running round, after a checkpoint report and at each tick.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["MAX_WAIT_S", "Decision", "Snapshots", "Waiting", "cadence", "decide"]

MAX_WAIT_S = 300.0
"""The longest the master waits for a checkpoint boundary before it folds waiting nodes in anyway. Waiting
``w`` seconds at two thirds of the throughput costs ``w / 3`` seconds of the whole world's training, a
fold-in at a random moment of a job that snapshots every ``T`` seconds ``T / 2`` on average: the wait pays
for snapshot periods up to several minutes, and a job that never reaches a boundary still grows."""


@dataclass(frozen=True)
class Snapshots:
    """The job's in-memory snapshot cadence, as its newest save at breakpoint showed it."""

    every: int
    """Steps between two snapshots (>= 1)."""
    newest: int
    """A step the job snapshotted: the others are ``every`` apart from it."""

    def last_complete(self, step: int) -> int:
        """The newest snapshot complete once a rank reported ``step``: a trainer snapshots a step after it
        reports it, so the snapshot of ``step`` itself may still be copying; the one before is done."""
        return self.newest + (step - 1 - self.newest) // self.every * self.every


def cadence(held: Iterable[Iterable[int]]) -> Snapshots | None:
    """The snapshot cadence from the steps each node's ranks hold in memory (two slots each: the newest
    snapshot and the one before); None when no node holds two."""
    every: int | None = None
    newest = -1
    for steps in held:
        ordered = sorted({s for s in steps if s >= 0})
        for a, b in itertools.pairwise(ordered):
            every = b - a if every is None else min(every, b - a)
        if ordered:
            newest = max(newest, ordered[-1])
    return None if every is None else Snapshots(every=every, newest=newest)


@dataclass(frozen=True)
class Waiting:
    """Nodes wait beside the running round: since when, and where the job stood then."""

    round: int
    """The running round they wait beside (a wait of an older round is over)."""
    since: float
    step: int
    """The job's step when the first of them joined (-1: none yet)."""
    committed: int
    """The committed checkpoint step then (-1: none)."""


@dataclass(frozen=True)
class Decision:
    now: bool
    """Open the round that folds the waiting nodes in now."""
    reason: str


def decide(
    *,
    waiting: Waiting,
    now: float,
    step: int,
    committed: int,
    snapshots: Snapshots | None,
    commit_period_s: float | None = None,
    max_wait_s: float = MAX_WAIT_S,
) -> Decision:
    """Whether to fold the waiting nodes in now (see the module docstring). ``step``: the job's newest
    reported step; ``committed``: its committed checkpoint step; ``snapshots``: its snapshot cadence, if
    known; ``commit_period_s``: the time between its last two commits, if known. Without a cadence the
    wait for a commit is bounded by one and a half periods: a job that snapshots in memory more often than
    it persists loses nothing to a fold-in at any moment, and should not wait minutes for a rare commit."""
    if snapshots is not None and snapshots.every == 1:
        return Decision(True, "the job snapshots every step: the save at breakpoint loses none")
    if snapshots is not None and step >= 0:
        done = snapshots.last_complete(step)
        if step - 1 == done or (waiting.step >= 0 and done > snapshots.last_complete(waiting.step)):
            return Decision(True, f"at a checkpoint boundary: step {done} snapshotted, the job is at {step}")
    elif committed > waiting.committed:
        return Decision(True, f"at a checkpoint boundary: step {committed} committed")
    elif snapshots is None and committed < 0:
        return Decision(True, "the job reports no checkpoints: there is no boundary to wait for")
    waited = now - waiting.since
    if snapshots is None and commit_period_s is not None:
        max_wait_s = min(max_wait_s, 1.5 * commit_period_s)
    if waited >= max_wait_s:
        return Decision(True, f"no checkpoint boundary within {max_wait_s:g}s")
    return Decision(False, "waiting for a checkpoint boundary")
