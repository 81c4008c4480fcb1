"""The step-time check: intervals from heartbeats (:class:`phalanx.master.state.steptimes.StepTimes`) and the
master's verdicts on them (event ``slow_steps``, ``slow_ranks`` of /v1/job, a probe round), with an
injected clock."""

from __future__ import annotations

from typing import Any

import pytest

from phalanx.api.v1 import master_pb2 as pb
from phalanx.master.state.steptimes import StepTimes

from .sim import Sim


def test_intervals_are_the_mean_step_time_between_heartbeats() -> None:
    t = StepTimes(window=3)
    t.observe(round=1, node_id="a", rank=0, step=-1, step_unix=0.0)  # not stepped yet
    t.observe(round=1, node_id="a", rank=0, step=10, step_unix=100.0)
    t.observe(round=1, node_id="a", rank=0, step=10, step_unix=100.0)  # no step since: no sample
    t.observe(round=1, node_id="a", rank=0, step=14, step_unix=102.0)
    assert list(t.intervals[0]) == [0.5]
    assert t.node_of == {0: "a"}
    for step, when in ((15, 103.0), (16, 104.0), (18, 104.5)):
        t.observe(round=1, node_id="a", rank=0, step=step, step_unix=when)
    assert list(t.intervals[0]) == [1.0, 1.0, 0.25]  # the window keeps the newest three


def test_a_new_round_or_a_step_back_starts_afresh() -> None:
    t = StepTimes(window=8)
    t.observe(round=1, node_id="a", rank=0, step=1, step_unix=1.0)
    t.observe(round=1, node_id="a", rank=0, step=2, step_unix=2.0)
    t.observe(round=2, node_id="b", rank=0, step=2, step_unix=9.0)
    assert t.intervals == {}
    assert t.node_of == {0: "b"}
    t.observe(round=2, node_id="b", rank=0, step=0, step_unix=10.0)  # reloaded an older checkpoint
    t.observe(round=2, node_id="b", rank=0, step=4, step_unix=12.0)
    assert list(t.intervals[0]) == [0.5]


def _run(sim: Sim, *, seconds: int, step_s: dict[str, float]) -> None:
    """Every node heartbeats once a second; node n's two ranks step every ``step_s[n]`` seconds."""
    start = sim.now
    for _ in range(seconds):
        sim.at(sim.now + 1.0)
        for offset, node in enumerate(sorted(step_s)):
            step = int((sim.now - start) / step_s[node])
            ranks = [
                pb.RankProgress(rank=2 * offset + i, step=step, step_unix_ns=int(sim.now * 1e9))
                for i in (0, 1)
            ]
            req = pb.HeartbeatRequest(
                node_id=node,
                incarnation=sim.inc[node],
                state=pb.NODE_STATE_RUNNING,
                round=sim.job.round_number,
                ranks=ranks,
            )
            sim.job.heartbeat(req, now=sim.now)


def _sim(**probes: Any) -> Sim:
    sim = Sim(
        rendezvous={"min_nodes": 1, "max_nodes": 2, "last_call_s": 1.0},
        heartbeat={"timeout_s": 30.0},
        probes={"stragglers": {"step_check_interval_s": 5.0}, **probes},
    )
    sim.form("a", "b")
    return sim


def test_a_node_whose_ranks_lag_is_flagged_once_and_probed() -> None:
    sim = _sim(enabled=True, kinds="matmul")
    _run(sim, seconds=12, step_s={"a": 0.1, "b": 0.3})
    slow = sim.job.status().slow_ranks
    assert [(r.rank, r.node) for r in slow] == [(2, "b"), (3, "b")]
    assert slow[0].median_interval_s == pytest.approx(0.3, rel=0.2)
    assert slow[0].reference_s == pytest.approx(0.1, rel=0.2)
    events = sim.job.events.of_kind("slow_steps")
    assert [(e.node, e.rank) for e in events] == [("b", 2), ("b", 3)]
    assert events[0].message.startswith("rank 2's median step interval"), events[0].message
    assert "(threshold 1.5x)" in events[0].message, events[0].message
    assert sim.job.probe is not None
    assert sim.job.probe.trigger == "slow steps on b"
    assert sim.job.stats.slow_step_verdicts == 2
    _run(sim, seconds=12, step_s={"a": 0.1, "b": 0.3})
    assert len(sim.job.events.of_kind("slow_steps")) == 2  # once per rank and round
    assert not sim.job.evictions, "a step-time lag alone evicts nobody"


def test_equal_nodes_and_disabled_checks_flag_nothing() -> None:
    sim = _sim()
    _run(sim, seconds=12, step_s={"a": 0.2, "b": 0.2})
    assert sim.job.status().slow_ranks == []
    off = Sim(
        rendezvous={"min_nodes": 1, "max_nodes": 2, "last_call_s": 1.0},
        heartbeat={"timeout_s": 30.0},
        probes={"stragglers": {"step_check_interval_s": 0.0}},
    )
    off.form("a", "b")
    _run(off, seconds=12, step_s={"a": 0.1, "b": 0.5})
    assert off.job.status().slow_ranks == []


def test_without_probes_the_lag_is_reported_and_nothing_else_happens() -> None:
    sim = _sim()
    _run(sim, seconds=12, step_s={"a": 0.1, "b": 0.3})
    assert len(sim.job.events.of_kind("slow_steps")) == 2
    assert sim.job.probe is None


def test_a_new_round_clears_the_verdicts() -> None:
    sim = _sim()
    _run(sim, seconds=12, step_s={"a": 0.1, "b": 0.3})
    assert sim.job.status().slow_ranks
    before = sim.job.round_number
    sim.fail("a")
    sim.join("a")
    sim.join("b")
    sim.at(sim.now + 0.1)
    assert sim.job.round_number == before + 1
    _run(sim, seconds=6, step_s={"a": 0.1, "b": 0.1})
    assert sim.job.status().slow_ranks == []
