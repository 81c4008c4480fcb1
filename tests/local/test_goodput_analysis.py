"""benchmarks/goodput.py's arithmetic (pure): the schedule, productive steps, and one fault's time split."""

from __future__ import annotations

from benchmarks.goodput import (
    DETECT,
    KINDS,
    REFORM,
    Step,
    analyse_fault,
    clean_step_time,
    productive,
    schedule,
)


def test_the_schedule_is_seeded_and_mixes_every_kind() -> None:
    plan = schedule(seed=25, count=9, interval_s=60.0, world=2)
    assert plan == schedule(seed=25, count=9, interval_s=60.0, world=2)
    assert [f.at_s for f in plan] == [60.0 * i for i in range(1, 10)]
    assert sorted(f.kind for f in plan) == sorted(KINDS * 3)
    assert plan != schedule(seed=26, count=9, interval_s=60.0, world=2)


def test_a_step_done_again_counts_once_and_a_smaller_world_trains_less() -> None:
    steps = [Step(float(i), i, 2) for i in range(10)]  # steps 0..9 at world 2
    steps += [Step(10.0 + i, 8 + i, 1) for i in range(4)]  # 8 and 9 redone at world 1, then 10, 11
    assert clean_step_time(steps[:10], start=0.0, end=10.0) == 1.0
    count, weighted = productive(steps, start=0.0, end=20.0, full_world=2)
    assert count == 12
    assert weighted == 8 + 4 * 0.5  # the kept completions of 8..11 were at world 1


def test_one_fault_is_split_into_detect_reform_restore_recompute() -> None:
    # Steps every 0.1 s up to step 49 at t=5.0; the fault at 5.05; torchrun's worker reports the peer's
    # error at 5.25, the restarted script prints at 8.0, steps 48.. again from 8.3 (two recomputed).
    steps = [Step(0.1 * i + 0.1, i, 2) for i in range(50)]
    steps += [Step(8.3 + 0.1 * i, 48 + i, 2) for i in range(5)]
    lines = [
        (5.25, "node1 RuntimeError: Connection reset by peer"),
        (6.0, "node0 [WARNING] get_gpu_stats failed"),  # noise, before the restart
        (8.0, "node0 world size 2, starting at step 48 (restart 1)"),
    ]
    out = analyse_fault(
        at=5.05,
        until=60.0,
        steps=steps,
        lines=lines,
        detect=DETECT["torchrun"],
        reform=REFORM["torchrun"],
        clean_s=0.1,
    )
    assert out["detect_s"] == 0.2
    assert out["reform_s"] == 2.75
    assert out["restore_s"] == 0.3
    assert out["recompute_steps"] == 2
    assert out["recompute_s"] == 0.2  # 48 at 8.3, 50 (past the 49 reached before) at 8.5
    assert out["lost_s"] == round(8.5 - 5.05 - 0.1, 3)
    assert out["world_after"] == 2
    assert out["later_stalls_s"] == 0.0
    assert out["recovered"]


def test_a_fault_never_recovered_from_costs_the_whole_interval() -> None:
    steps = [Step(0.1 * i, i, 2) for i in range(10)]
    out = analyse_fault(
        at=1.0,
        until=61.0,
        steps=steps,
        lines=[],
        detect=DETECT["phalanx"],
        reform=REFORM["phalanx"],
        clean_s=0.1,
    )
    assert out["detect_s"] is None
    assert not out["recovered"]
    assert out["lost_s"] == 60.0
