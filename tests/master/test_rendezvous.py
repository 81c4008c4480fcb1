"""Rendezvous decisions: completion rule, unit cut, stable ranks. Pure, injected clock."""

from __future__ import annotations

from phalanx.api.settings import RendezvousSettings
from phalanx.master.decide import rendezvous as rdzv
from phalanx.master.decide.rendezvous import Joiner, can_grow, form_round, should_complete, usable


def joiner(node: str, at: float, *, nproc: int = 2, port: int = 1000) -> Joiner:
    return Joiner(
        node_id=node, nproc=nproc, store_host=f"h-{node}", store_port=port, last_round=0, joined_at=at
    )


def joiners(*pairs: tuple[str, float]) -> dict[str, Joiner]:
    return {n: joiner(n, t) for n, t in pairs}


S = RendezvousSettings(min_nodes=2, max_nodes=4, unit=1, last_call_s=1.0)


def check(js: dict[str, Joiner], now: float, *, expected: list[str] | None = None, settings=S) -> bool:
    return should_complete(
        joiners=js,
        expected=expected if expected is not None else list(js),
        opened_at=0.0,
        now=now,
        settings=settings,
        straggler_wait_s=10.0,
    )


def test_completes_at_once_at_max() -> None:
    js = joiners(("a", 0.0), ("b", 0.1), ("c", 0.2), ("d", 0.3))
    assert check(js, 0.3)


def test_a_spare_waiting_beside_the_job_does_not_take_a_rejoining_survivors_place() -> None:
    """Round 1 was a, b, c (max 3); spare d waited beside it. A restart in place: d, a and b have joined,
    which is max_nodes, but c, alive, is still rejoining. The round waits for c and keeps d spare."""
    s = RendezvousSettings(min_nodes=2, max_nodes=3, unit=1, last_call_s=1.0)
    previous, expected = ["a", "b", "c"], ["a", "b", "c", "d"]
    js = joiners(("d", 0.0), ("a", 0.1), ("b", 0.2))

    def complete(now: float) -> bool:
        return should_complete(
            joiners=js, expected=expected, opened_at=0.0, now=now, settings=s, straggler_wait_s=10.0,
            previous=previous,
        )  # fmt: skip

    assert not complete(0.2)
    assert not complete(5.0)  # the last call passed, but c is expected
    js["c"] = joiner("c", 5.1)
    assert complete(5.1)
    formed = form_round(number=2, joiners=js, previous=previous, settings=s, now=5.1)
    assert formed.node_ids == ["a", "b", "c"]
    del js["c"]
    assert complete(10.0), "a survivor that does not rejoin within the straggler wait is left out"


def test_below_min_never_completes() -> None:
    assert not check(joiners(("a", 0.0)), 1000.0)


def test_last_call_waits_for_quiet_period() -> None:
    js = joiners(("a", 0.0), ("b", 0.5))
    assert not check(js, 1.4)  # 0.9 s since the last join
    assert check(js, 1.5)


def test_waits_for_expected_live_nodes_until_straggler_wait() -> None:
    js = joiners(("a", 0.0), ("b", 0.0))
    assert not check(js, 5.0, expected=["a", "b", "c"])
    assert check(js, 10.0, expected=["a", "b", "c"])


def test_unit_cut_and_usable() -> None:
    s = RendezvousSettings(min_nodes=2, max_nodes=5, unit=2, last_call_s=0.0)
    assert usable(3, s) == 2
    assert usable(5, s) == 4
    assert usable(9, s) == 4
    js = joiners(("a", 0.0), ("b", 0.1), ("c", 0.2))
    r = form_round(number=1, joiners=js, previous=[], settings=s, now=1.0)
    assert r.node_ids == ["a", "b"]  # c waits for the next round
    # a cut that would fall below min does not complete
    s3 = RendezvousSettings(min_nodes=3, max_nodes=4, unit=2, last_call_s=0.0)
    assert not check(joiners(("a", 0.0), ("b", 0.0), ("c", 0.0)), 5.0, settings=s3)


def test_ranks_stable_survivors_first_then_newcomers_in_join_order() -> None:
    js = {
        "new2": joiner("new2", 0.3),
        "c": joiner("c", 0.1),
        "new1": joiner("new1", 0.2),
        "a": joiner("a", 0.5, port=4242),
    }
    r = form_round(number=7, joiners=js, previous=["a", "b", "c"], settings=S, now=2.0)
    assert r.number == 7
    assert r.node_ids == ["a", "c", "new1", "new2"]
    assert [m.group_rank for m in r.members] == [0, 1, 2, 3]
    assert [m.rank_offset for m in r.members] == [0, 2, 4, 6]
    assert r.world_size == 8
    # the store is the group-rank-0 node's, from its join request
    assert (r.store_host, r.store_port) == ("h-a", 4242)


def test_can_grow() -> None:
    s = RendezvousSettings(min_nodes=2, max_nodes=4, unit=2)
    assert not can_grow(members=2, waiting=1, settings=s)
    assert can_grow(members=2, waiting=2, settings=s)
    assert not can_grow(members=4, waiting=3, settings=s)


def test_a_reformed_round_of_survivors_completes_without_the_last_call() -> None:
    js = joiners(("a", 0.0), ("b", 0.2))

    def reformed(now: float, *, expected: list[str], previous: list[str]) -> bool:
        return should_complete(
            joiners=js,
            expected=expected,
            opened_at=0.0,
            now=now,
            settings=S,
            straggler_wait_s=10.0,
            previous=previous,
        )

    assert reformed(0.2, expected=["a", "b"], previous=["a", "b", "c"])  # c is gone: nobody else to wait for
    assert not reformed(0.2, expected=["a", "b", "d"], previous=["a", "b", "c"])  # d registered, not joined
    assert check(js, 1.2)  # the first round of a job still gives late starters the last call ...
    assert not check(js, 0.2)
    newcomer = joiners(("a", 0.0), ("n", 0.2))  # ... and so does a round with a newcomer in it
    assert not should_complete(
        joiners=newcomer,
        expected=["a", "n"],
        opened_at=0.0,
        now=0.2,
        settings=S,
        straggler_wait_s=10.0,
        previous=["a", "b"],
    )


def test_untrained_newcomers_are_only_those_that_joined_the_round_and_never_stepped() -> None:
    members = tuple(
        rdzv.Member(node_id=n, group_rank=i, nproc=1, rank_offset=i, newcomer=n in ("c", "d", "e"))
        for i, n in enumerate("abcde")
    )
    round_ = rdzv.Round(
        number=3, members=members, world_size=5, store_host="h", store_port=1, completed_at=0.0
    )
    steps = {"a": [500], "b": [-1], "c": [-1, -1], "d": [-1, 499], "e": []}
    # b restarted in place (not new), d stepped, e has not reported its workers yet: only c is idle.
    assert rdzv.untrained_newcomers(round_, completed={"a"}, steps=steps) == {"c"}
    assert rdzv.untrained_newcomers(round_, completed={"a", "c"}, steps=steps) == set()
    assert rdzv.untrained_newcomers(round_, completed={"b"}, steps=steps) == set()  # no step tells nothing
    assert rdzv.untrained_newcomers(round_, completed=set(), steps=steps) == set()
