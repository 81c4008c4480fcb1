"""The fleet simulator's accounting (``benchmarks/fleet_sim.py``): a tiny fleet with a known schedule gives a
known answer. Pure logic on the real master core with an injected clock; milliseconds."""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator

import pytest
from benchmarks.fleet_sim import (
    LLAMA3_GPU_MTTF_H,
    Fault,
    Figures,
    Fleet,
    Outcome,
    account,
    schedule,
)


@pytest.fixture(autouse=True)
def quiet() -> Iterator[None]:
    logging.disable(logging.CRITICAL)
    yield
    logging.disable(logging.NOTSET)


def test_each_kind_of_fault_takes_its_path_through_the_real_core() -> None:
    fleet = Fleet(nodes=4, spares=1)
    fleet.form_first_round()
    assert fleet.job.round_number == 1

    gpu = fleet.inject(Fault(at=100.0, kind="gpu", slot=1))
    assert (gpu.node, gpu.verdict, gpu.round, gpu.world_size) == ("node-1", "evict", 2, 32)
    assert "node-1" not in fleet.job.members
    assert "spare-1" in fleet.job.members  # the spare took its place
    assert gpu.decided_after_s == 0.0  # the agent reported it: the master decides on the report
    assert gpu.formed_after_s == pytest.approx(fleet.rejoin_s + fleet.spare_join_s)

    crash = fleet.inject(Fault(at=200.0, kind="software", slot=2))
    assert (crash.verdict, crash.round) == ("restart", 3)
    assert crash.formed_after_s == pytest.approx(fleet.rejoin_s)  # same members: no last call, no spare

    host = fleet.inject(Fault(at=300.0, kind="host", slot=0))
    assert (host.node, host.verdict, host.round) == ("node-0", "evict", 4)
    # Silent: found by the first tick past the 10 s heartbeat timeout.
    assert host.decided_after_s == pytest.approx(10.25)

    hang = fleet.inject(Fault(at=400.0, kind="network", slot=3))
    assert (hang.verdict, hang.round) == ("restart", 5)
    assert len(fleet.job.members) == 4
    assert len(fleet.job.evictions) == 2
    for outcome in (gpu, crash, host, hang):
        assert outcome.to_formed_cpu_s >= outcome.decision_cpu_s >= 0


def outcome(kind: str, verdict: str, decided_after_s: float = 0.0) -> Outcome:
    return Outcome(
        kind=kind,
        node="n",
        at=0.0,
        verdict=verdict,
        decided_after_s=decided_after_s,
        formed_after_s=0.0,
        decision_cpu_s=0.0,
        to_formed_cpu_s=0.0,
        answers_cpu_s=0.0,
        round=2,
        world_size=8,
    )


def test_goodput_of_a_known_schedule() -> None:
    fig = Figures(
        values={
            "restart_in_place_s": 2.0,
            "node_replaced_s": 3.0,
            "hang_detect_s": 10.0,
            "restore_from_storage_s": 1.0,
            "phalanx_save_stall_s": 0.1,
            "torchrun_restart_s": 4.0,
            "torch_save_blocking_s": 1.0,
            "collective_timeout_s": 600.0,
        },
        sources={},
    )
    outcomes = [
        outcome("gpu", "evict"),
        outcome("software", "restart"),
        outcome("host", "evict", decided_after_s=10.25),
        outcome("network", "restart"),
    ]
    day = 86400.0
    result = account(outcomes, fig, horizon_s=day, interval_s=600.0, step_s=5.0)
    # phalanx: a lost node costs re-form + restore + half the interval; a restart in place half a step.
    ours = (0 + 3 + 1 + 300) + (0 + 2 + 0 + 2.5) + (10.25 + 3 + 1 + 300) + (10 + 2 + 0 + 2.5)
    assert result["phalanx"]["goodput"] == pytest.approx((day - ours) / day * (1 - 0.1 / 5), abs=1e-5)
    assert result["phalanx"]["recompute_s_mean"] == pytest.approx((300 + 2.5 + 300 + 2.5) / 4, abs=1e-3)
    # torchrun: every failure restarts the whole job from the last save; hangs and silent hosts wait for the
    # collective timeout.
    theirs = 2 * (4 + 1 + 300) + 2 * (600 + 4 + 1 + 300)
    assert result["torchrun_whole_job"]["goodput"] == pytest.approx(
        (day - theirs) / day * (1 - 1 / 600), abs=1e-5
    )
    assert result["torchrun_whole_job"]["detect_s_mean"] == pytest.approx(300.0)


def test_schedule_is_seeded_and_at_the_published_rate() -> None:
    days = 30
    one = schedule(random.Random(7), gpus=32_768, gpu_mttf_h=LLAMA3_GPU_MTTF_H, horizon_s=days * 86400)
    assert one == schedule(
        random.Random(7), gpus=32_768, gpu_mttf_h=LLAMA3_GPU_MTTF_H, horizon_s=days * 86400
    )
    expected = 32_768 / LLAMA3_GPU_MTTF_H * 24 * days  # 419 in 54 days on 16,384 GPUs, doubled: ~465
    assert abs(len(one) - expected) < 4 * expected**0.5
    assert {f.kind for f in one} == {"gpu", "software", "network", "host"}
