"""Folding waiting nodes (a replacement) into a running job at a checkpoint boundary: the pure decision
(:func:`phalanx.master.decide.foldin.decide`) and the job that applies it, driven with an injected clock."""

from __future__ import annotations

from phalanx.master.decide.foldin import MAX_WAIT_S, Snapshots, Waiting, cadence, decide

from .sim import Sim, kinds

WAIT = Waiting(round=3, since=100.0, step=113, committed=110)
EVERY_10 = Snapshots(every=10, newest=110)


def test_cadence_is_the_smallest_gap_between_the_steps_a_node_holds() -> None:
    assert cadence([[109, 110]]) == Snapshots(every=1, newest=110)
    assert cadence([[100, 110], [110]]) == Snapshots(every=10, newest=110)
    assert cadence([[110], [-1, 5]]) is None  # one snapshot each: no cadence to see
    assert cadence([]) is None


def test_a_job_that_snapshots_every_step_folds_in_at_once() -> None:
    d = decide(waiting=WAIT, now=100.0, step=113, committed=110, snapshots=Snapshots(every=1, newest=112))
    assert d.now
    assert "every step" in d.reason


def test_a_job_that_snapshots_every_10_steps_waits_for_the_next_snapshot() -> None:
    # The replacement joined at step 113: folding it in now would train 111..113 again.
    assert not decide(waiting=WAIT, now=101.0, step=115, committed=110, snapshots=EVERY_10).now
    # Step 120 reported: its snapshot may still be copying (a trainer saves after it reports).
    assert not decide(waiting=WAIT, now=101.5, step=120, committed=110, snapshots=EVERY_10).now
    # Step 121 reported: step 120's snapshot is complete, the save at breakpoint persists it.
    d = decide(waiting=WAIT, now=102.0, step=121, committed=110, snapshots=EVERY_10)
    assert d.now
    assert "step 120 snapshotted" in d.reason
    # Heartbeats come once a second: the step first heard of may be past the boundary already.
    assert decide(waiting=WAIT, now=102.0, step=124, committed=110, snapshots=EVERY_10).now


def test_a_node_that_joins_just_after_a_snapshot_is_folded_in_at_once() -> None:
    at_boundary = Waiting(round=3, since=100.0, step=111, committed=100)
    d = decide(waiting=at_boundary, now=100.0, step=111, committed=100, snapshots=EVERY_10)
    assert d.now
    assert "boundary" in d.reason


def test_without_a_cadence_a_commit_is_the_boundary() -> None:
    assert not decide(waiting=WAIT, now=101.0, step=115, committed=110, snapshots=None).now
    d = decide(waiting=WAIT, now=101.0, step=121, committed=120, snapshots=None)
    assert d.now
    assert "step 120 committed" in d.reason


def test_without_a_cadence_the_wait_for_a_commit_lasts_one_and_a_half_commit_periods() -> None:
    # Commits every 20 s: a job that snapshots in memory every step would wait for nothing.
    assert not decide(
        waiting=WAIT, now=129.0, step=115, committed=110, snapshots=None, commit_period_s=20.0
    ).now
    d = decide(waiting=WAIT, now=130.0, step=115, committed=110, snapshots=None, commit_period_s=20.0)
    assert d.now
    assert d.reason == "no checkpoint boundary within 30s"
    # A known cadence is not cut short: its boundaries are steps.
    assert not decide(
        waiting=WAIT, now=130.0, step=115, committed=110, snapshots=EVERY_10, commit_period_s=20.0
    ).now


def test_a_job_that_reports_no_checkpoints_folds_in_at_once() -> None:
    blind = Waiting(round=3, since=100.0, step=50, committed=-1)
    d = decide(waiting=blind, now=100.0, step=50, committed=-1, snapshots=None)
    assert d.now
    assert "no checkpoints" in d.reason


def test_the_wait_for_a_boundary_is_bounded() -> None:
    stuck = Snapshots(every=1000, newest=0)
    late = WAIT.since + MAX_WAIT_S
    assert not decide(waiting=WAIT, now=late - 1, step=130, committed=110, snapshots=stuck).now
    d = decide(waiting=WAIT, now=late, step=130, committed=110, snapshots=stuck)
    assert d.now
    assert "no checkpoint boundary within" in d.reason
    assert decide(waiting=WAIT, now=101.0, step=130, committed=110, snapshots=stuck, max_wait_s=1.0).now


# -- the job ------------------------------------------------------------------------------------------

THREE = {"rendezvous": {"min_nodes": 1, "max_nodes": 3, "last_call_s": 1.0}, "heartbeat": {"timeout_s": 4.0}}


def _lost_c_then_replacement(held: list[int]) -> Sim:
    """a, b, c train; c is lost; a and b save at breakpoint (their ranks hold ``held``) and re-form at
    world 4 (round 2); the replacement d registers and joins beside round 2."""
    sim = Sim(**THREE)
    sim.form("a", "b", "c")
    sim.disconnect("c")
    sim.at(sim.now + 1.1)  # past the grace: c is absent, round 2 opens without it
    assert sim.job.round_open
    for n in "ab":
        sim.in_memory(n, round=1, held=held)
        sim.join(n)
    assert (sim.job.round_number, sim.job.members) == (2, ["a", "b"])
    for n in "ab":
        sim.hb(n, step=max(held) + 3)
    sim.register("d")
    sim.join("d")
    return sim


def test_a_replacement_waits_for_the_snapshot_after_it_joined_then_folds_in() -> None:
    sim = _lost_c_then_replacement([100, 110])  # snapshots every 10 steps; the job is at step 113
    assert not sim.job.round_open  # folding d in now would train 111..113 again: a and b train on
    assert kinds(sim.hb("a", step=117)) == []
    sim.at(sim.now + 0.5)
    assert not sim.job.round_open
    sim.hb("a", step=121)  # step 120 snapshotted
    sim.at(sim.now + 0.25)
    assert sim.job.round_open
    (opened,) = sim.job.events.of_kind("round_open")[-1:]
    assert opened.message == (
        "scale up: 1 node(s) waiting; at a checkpoint boundary: step 120 snapshotted, the job is at 121"
    )
    assert kinds(sim.hb("b", step=121)) == ["REJOIN"]
    sim.join("a")
    sim.join("b")
    assert (sim.job.round_number, sim.job.members) == (3, ["a", "b", "d"])


def test_a_replacement_of_a_job_that_snapshots_every_step_is_folded_in_when_it_joins() -> None:
    sim = _lost_c_then_replacement([112, 113])
    assert sim.job.round_open
    assert sim.job.events.of_kind("round_open")[-1].message.endswith("the save at breakpoint loses none")


def test_a_replacement_joining_before_the_round_stepped_waits_for_the_boundary_after_its_first_step() -> None:
    sim = Sim(**THREE)
    sim.form("a", "b", "c")
    sim.disconnect("c")
    sim.at(sim.now + 1.1)
    for n in "ab":
        sim.in_memory(n, round=1, held=[100, 110])
        sim.join(n)
    sim.register("d")
    sim.join("d")  # no step of round 2 heard of yet
    assert not sim.job.round_open
    sim.hb("a", step=113)
    sim.at(sim.now + 0.25)
    assert not sim.job.round_open  # 113 is the first step heard of: the boundary to wait for is 120
    sim.hb("a", step=122)
    sim.at(sim.now + 0.25)
    assert sim.job.round_open


def test_without_a_save_at_breakpoint_the_next_commit_folds_the_replacement_in() -> None:
    """A trainer that re-forms its groups in process saves nothing at breakpoint: the master knows only
    the steps committed to storage."""
    sim = Sim(**THREE)
    sim.form("a", "b")
    sim.persisted("a", step=10, ranks=[0, 1])
    sim.persisted("b", step=10, ranks=[2, 3])
    sim.hb("a", step=13)
    sim.register("c")
    sim.join("c")
    assert not sim.job.round_open
    sim.at(sim.now + 1.0)
    assert not sim.job.round_open
    sim.persisted("a", step=20, ranks=[0, 1])
    assert not sim.job.round_open  # step 20 is not committed until every shard of it is persisted
    sim.persisted("b", step=20, ranks=[2, 3])
    assert sim.job.round_open
    assert sim.job.events.of_kind("round_open")[-1].message.endswith(
        "at a checkpoint boundary: step 20 committed"
    )
