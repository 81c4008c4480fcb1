"""Rendezvous decisions: when a round completes and who its members are. Pure functions of plain values.

A round gathers *joiners*. It completes

* at once when ``max_nodes`` joined, unless a live member of the previous round has yet to rejoin: a spare
  that waited beside the running job must not take the place of a survivor that is rejoining;
* at once when it re-forms a running job and every node the master expects has joined, all of them
  members of the previous round: the last call waits for newcomers, and a re-formed round expects none
  (a replacement that arrives later joins by scale up). Every recovery would otherwise pay it;
* otherwise when at least ``min_nodes`` joined, no node joined for ``last_call_s``, and every node the
  master expects (every live registered node) has joined;
* or, when some live node still has not joined, once the round has been open for ``straggler_wait_s``
  (the master passes the heartbeat timeout: a live node that does not rejoin in that time is left out
  rather than blocking everybody).

Membership is cut to the largest multiple of ``unit`` that fits (never above ``max_nodes``); a round
whose cut would fall below ``min_nodes`` does not complete. Group ranks are stable: members of the
previous round keep their relative order, newcomers follow in join order (compare torch elastic's
``_RendezvousJoinOp`` and torchft's ``quorum_compute``).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

from phalanx.api.settings import RendezvousSettings

__all__ = ["Joiner", "Member", "Round", "can_grow", "form_round", "should_complete", "usable"]


@dataclass(frozen=True, kw_only=True)
class Joiner:
    """A node waiting for the open round."""

    node_id: str
    nproc: int
    store_host: str
    store_port: int
    last_round: int
    joined_at: float


@dataclass(frozen=True, kw_only=True)
class Member:
    """One node of a completed round."""

    node_id: str
    group_rank: int
    nproc: int
    rank_offset: int
    newcomer: bool = False
    """Not a member of the round before (a replacement or a scale-up joiner)."""


@dataclass(frozen=True, kw_only=True)
class Round:
    """A completed round."""

    number: int
    members: tuple[Member, ...]
    world_size: int
    store_host: str
    store_port: int
    completed_at: float

    @property
    def node_ids(self) -> list[str]:
        return list(self._ids)

    def member(self, node_id: str) -> Member | None:
        return self._by_id.get(node_id)

    # A round never changes once formed; every member's requests look it up, so at thousands of nodes a
    # scan per lookup would be quadratic. (cached_property writes the instance dict, which frozen allows.)
    @cached_property
    def _ids(self) -> tuple[str, ...]:
        return tuple(m.node_id for m in self.members)

    @cached_property
    def _by_id(self) -> dict[str, Member]:
        return {m.node_id: m for m in self.members}


def usable(count: int, settings: RendezvousSettings) -> int:
    """How many of ``count`` joiners a round can take: capped at max_nodes, cut to a multiple of unit."""
    return min(count, settings.max_nodes) // settings.unit * settings.unit


def can_grow(*, members: int, waiting: int, settings: RendezvousSettings) -> bool:
    """Whether nodes waiting beside a running round would make a larger round (scale up)."""
    return usable(members + waiting, settings) > members


def should_complete(
    *,
    joiners: Mapping[str, Joiner],
    expected: Collection[str],
    opened_at: float,
    now: float,
    settings: RendezvousSettings,
    straggler_wait_s: float,
    previous: Collection[str] = (),
) -> bool:
    """Whether the open round completes now (see the module docstring for the rule); ``previous``: the
    members of the round before it (none for the job's first round)."""
    if usable(len(joiners), settings) < settings.min_nodes:
        return False
    if len(joiners) >= settings.max_nodes and not _survivor_missing(joiners, expected, previous):
        return True
    if previous and set(joiners) == set(expected) and set(joiners) <= set(previous):
        return True
    last_join = max(j.joined_at for j in joiners.values())
    if now - last_join < settings.last_call_s:
        return False
    if all(node in joiners for node in expected):
        return True
    return now - opened_at >= straggler_wait_s


def _survivor_missing(
    joiners: Mapping[str, Joiner], expected: Collection[str], previous: Collection[str]
) -> bool:
    """Whether a node the master expects, a member of the previous round, has not joined yet."""
    if not previous:
        return False
    before = previous if isinstance(previous, (set, frozenset)) else set(previous)
    return any(node in before and node not in joiners for node in expected)


def form_round(
    *,
    number: int,
    joiners: Mapping[str, Joiner],
    previous: Sequence[str],
    settings: RendezvousSettings,
    now: float,
) -> Round:
    """Builds round ``number`` from the joiners: survivors first in their previous order, then newcomers."""
    rank_before = {node: i for i, node in enumerate(previous)}
    ordered = sorted(
        joiners.values(),
        key=lambda j: (
            (0, rank_before[j.node_id], 0.0, "")
            if j.node_id in rank_before
            else (1, 0, j.joined_at, j.node_id)
        ),
    )
    chosen = ordered[: usable(len(ordered), settings)]
    members: list[Member] = []
    offset = 0
    for group_rank, joiner in enumerate(chosen):
        members.append(
            Member(
                node_id=joiner.node_id,
                group_rank=group_rank,
                nproc=joiner.nproc,
                rank_offset=offset,
                newcomer=joiner.node_id not in rank_before,
            )
        )
        offset += joiner.nproc
    head = chosen[0] if chosen else None
    return Round(
        number=number,
        members=tuple(members),
        world_size=offset,
        store_host=head.store_host if head else "",
        store_port=head.store_port if head else 0,
        completed_at=now,
    )


def untrained_newcomers(
    round_: Round, *, completed: Collection[str], steps: Mapping[str, Sequence[int]]
) -> set[str]:
    """Members that joined ``round_`` as training ended: they have nothing left to do once the others
    completed it, and the job has succeeded without them.

    A node joining in the last steps makes a new round; the survivors' workers may finish the last step
    before they see it, and the newcomer then waits to form a world with peers that are gone (and, when it
    gives up, makes everyone train again from the last checkpoint). In a synchronous job the members that
    completed ran the last step, so a newcomer whose workers never reported a step (``steps``: each
    node's ranks' last reported steps, -1 before the first) took no part in it. Only when the completed
    members did report steps: a script that never calls ``report_step`` tells nothing, and its members
    finish in their own time.
    """
    finished = [step for node in completed for step in steps.get(node, ())]
    if not finished or max(finished) < 0:
        return set()
    return {
        m.node_id
        for m in round_.members
        if m.newcomer
        and m.node_id not in completed
        and steps.get(m.node_id)
        and all(step < 0 for step in steps[m.node_id])
    }
