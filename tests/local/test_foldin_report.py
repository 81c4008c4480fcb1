"""A node kill's replacement folded in, reported in the fault's own row (pure bookkeeping)."""

from __future__ import annotations

from phalanx.local import foldin
from phalanx.local.report import FailureRecord, Summary, table

S = 1_000_000_000  # ns


def _poll(
    fold: foldin.FoldIn, at: float, round_: int, members: list[str], world: int, **steps: list[int]
) -> bool:
    """One poll at run time ``at`` (Unix ns: ``at`` seconds); ``steps``: node (node_0) -> its local ranks'
    steps, each reported at that poll."""
    return foldin.observe(
        fold,
        at=at,
        now_ns=int(at * S),
        round_=round_,
        members=members,
        world=world,
        running=True,
        steps={
            (n.replace("_", "-"), lr): (s, int(at * S)) for n, v in steps.items() for lr, s in enumerate(v)
        },
    )


def test_the_fold_in_is_timed_from_its_round_opening_to_the_first_step_with_the_replacement() -> None:
    fault = FailureRecord(
        kind="kill-node", node="node-2", rank=-1, injected_at=16.72, action="evicted node-2"
    )
    survivors = ["node-1", "node-0"]
    fold = fault.fold_in = foldin.started(node="node-3", lost="node-2", round_=3, members=survivors, world=2)
    assert not _poll(fold, 20.0, 3, survivors, 2, node_0=[140], node_1=[141])
    foldin.round_opened(fold, at=23.03, reason="scale up: 1 node(s) waiting; the job snapshots every step")
    # The survivors' workers stop: their beacons keep the last step each completed (150; one got to 151).
    assert not _poll(fold, 23.1, 3, survivors, 2, node_0=[150], node_1=[151])
    members = [*survivors, "node-3"]
    assert not _poll(fold, 23.2, 4, members, 3)  # the round formed; nothing stepped in it yet
    assert fold.round == 4
    assert _poll(fold, 24.33, 4, members, 3, node_0=[151], node_1=[151], node_3=[151])
    assert (fold.resumed_step, fold.steps_lost) == (151, 0)
    assert fold.cost_s is not None
    assert abs(fold.cost_s - 1.30) < 1e-9
    assert fault.described() == (
        "evicted node-2; re-formed at world 2, node-3 folded in at step 151 (round 4) 7.61s after the fault, "
        "0 steps lost"
    )
    row = fault.to_json()["fold_in"]
    assert row == {
        "node": "node-3",
        "round": 4,
        "world": 3,
        "reformed_world": 2,
        "opened_at": 23.03,
        "formed_at": 23.2,
        "folded_at": 24.33,
        "cost_s": 1.3,
        "step": 151,
        "steps_lost": 0,
        "reason": "scale up: 1 node(s) waiting; the job snapshots every step",
    }
    summary = Summary(job_id="j", failures=[fault])
    assert table(summary).count("kill-node") == 1  # one fault, one row


def test_steps_trained_again_after_the_fold_in_are_counted_as_lost() -> None:
    fold = foldin.started(node="node-3", lost="node-2", round_=2, members=["node-0", "node-1"], world=2)
    foldin.round_opened(
        fold, at=10.0, reason="scale up: 1 node(s) waiting; no checkpoint boundary within 300s"
    )
    _poll(fold, 10.1, 2, ["node-0", "node-1"], 2, node_0=[57], node_1=[57])
    _poll(fold, 10.5, 3, ["node-0", "node-1", "node-3"], 3)
    assert _poll(fold, 11.0, 3, ["node-0", "node-1", "node-3"], 3, node_0=[51], node_1=[51], node_3=[51])
    assert fold.steps_lost == 7  # restored step 50: steps 51..57 are trained again


def test_a_round_without_the_replacement_moves_the_fold_in_to_a_later_round() -> None:
    fold = foldin.started(node="node-3", lost="node-2", round_=2, members=["node-0", "node-1"], world=2)
    foldin.round_opened(fold, at=5.0, reason="node-1 rejoined")
    _poll(fold, 5.5, 3, ["node-0", "node-1"], 2, node_0=[20])  # a worker failure's round, still at world 2
    assert (fold.round, fold.base_round, fold.opened_at) == (0, 3, None)
    foldin.round_opened(fold, at=8.0, reason="scale up: 1 node(s) waiting; the job snapshots every step")
    _poll(fold, 8.5, 4, ["node-0", "node-1", "node-3"], 3)
    assert _poll(fold, 9.0, 4, ["node-0", "node-1", "node-3"], 3, node_3=[30])
    assert (fold.round, fold.opened_at, fold.cost_s) == (4, 8.0, 1.0)


def test_a_replacement_that_joins_the_re_formed_round_is_said_to_have_joined_it() -> None:
    fault = FailureRecord(kind="kill-node", node="node-2", rank=-1, injected_at=5.0)
    # Started while the round node-2 was in still ran: the survivors had not re-formed yet.
    fold = fault.fold_in = foldin.started(
        node="node-3", lost="node-2", round_=1, members=["node-0", "node-1", "node-2"], world=3
    )
    assert fold.survivors == ("node-0", "node-1")
    _poll(fold, 6.0, 2, ["node-0", "node-1", "node-3"], 3)
    assert _poll(fold, 7.0, 2, ["node-0", "node-1", "node-3"], 3, node_3=[16])
    assert (
        fault.described()
        == "node-3 joined the re-formed round 2 at step 16, 2.00s after the fault, 0 steps lost"
    )


def test_a_rank_missing_from_the_last_poll_still_counts_with_its_own_last_step() -> None:
    """Rank 0 lags 5 steps (the workload's ranks step on timers of their own) and checkpoints; at the last
    poll before the fold-in its beacon already belongs to the next round's worker (step -1), so that poll's
    minimum alone would be the others' 75 and call steps 71-75 lost."""
    fold = foldin.started(node="node-3", lost="node-2", round_=2, members=["node-0", "node-1"], world=4)
    _poll(fold, 7.9, 2, ["node-0", "node-1"], 4, node_0=[70, 75], node_1=[75, 75])
    _poll(fold, 8.0, 2, ["node-0", "node-1"], 4, node_0=[-1, 75], node_1=[75, 75])
    _poll(fold, 8.1, 3, ["node-0", "node-1", "node-3"], 6)
    assert _poll(fold, 8.5, 3, ["node-0", "node-1", "node-3"], 6, node_0=[71, 71], node_3=[71, 71])
    assert (fold.resumed_step, fold.steps_lost) == (71, 0)
