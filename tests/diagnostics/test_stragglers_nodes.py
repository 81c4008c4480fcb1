"""Per-node straggler scores during training: the pure scoring functions of
:mod:`phalanx.diagnostics.stragglers`, and the master acting on them (``/v1/nodes``, metrics, the
``straggler`` event, the eviction with ``evict_slow_nodes``) driven by heartbeats on an injected clock."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest

from phalanx.api.errors import ConfigError
from phalanx.api.settings import StragglerSettings
from phalanx.api.v1 import master_pb2 as pb
from phalanx.diagnostics.stragglers import (
    NodeTiming,
    confirm_slow,
    new_baselines,
    node_scores,
    node_timings,
    rank_timings,
    score_basis,
    straggler_state,
)
from phalanx.master.serve.logstore import LogStore
from phalanx.master.serve.metrics import MasterMetrics
from tests.master.sim import Sim

CFG = StragglerSettings(step_min_samples=3, step_window=8)


# --- pure functions ------------------------------------------------------------------------------------


def test_a_rank_needs_enough_samples_and_its_recorder_gives_the_compute_time() -> None:
    timings = rank_timings(
        {0: [0.1, 0.1, 0.3], 1: [0.1, 0.1], 2: [0.2] * 5},
        {0: (0.12, 0.02), 2: (0.2, 0.3)},  # rank 2's figures do not add up: no compute time
        settings=CFG,
    )
    assert sorted(timings) == [0, 2]
    assert timings[0] == NodeTiming(step_time_s=0.1, compute_time_s=pytest.approx(0.1))
    assert timings[2].compute_time_s == 0.0


def test_a_node_is_as_slow_as_its_slowest_rank_and_has_a_compute_time_only_from_all_its_ranks() -> None:
    ranks = {
        0: NodeTiming(0.1, 0.05),
        1: NodeTiming(0.3, 0.2),
        2: NodeTiming(0.1, 0.05),
        3: NodeTiming(0.1, 0.0),
    }
    nodes = node_timings(ranks, {0: "a", 1: "a", 2: "b", 3: "b", 9: "c"})
    assert nodes == {"a": NodeTiming(0.3, 0.2), "b": NodeTiming(0.1, 0.0)}
    assert score_basis(nodes) == "step"
    assert score_basis({"a": NodeTiming(0.3, 0.2), "b": NodeTiming(0.3, 0.1)}) == "compute"


def test_synchronous_steps_hide_the_slow_node_but_its_compute_time_names_it() -> None:
    # All-reduce makes every step 0.2 s; node c computes 0.18 s of it, the others 0.09 s and wait the rest.
    timings = {n: NodeTiming(0.2, 0.09) for n in ("a", "b", "d")} | {"c": NodeTiming(0.2, 0.18)}
    scores = node_scores(timings, {}, settings=CFG)
    assert {n for n, s in scores.items() if s.slow} == {"c"}
    assert scores["c"].basis == "compute"
    assert scores["c"].relative == pytest.approx(2.0)
    assert scores["c"].step_time_s == 0.2
    steps_only = {n: NodeTiming(t.step_time_s) for n, t in timings.items()}
    assert not any(s.slow for s in node_scores(steps_only, {}, settings=CFG).values())


def test_scores_are_relative_and_a_cluster_of_equal_nodes_has_no_straggler() -> None:
    timings = {"a": NodeTiming(0.1), "b": NodeTiming(0.11), "c": NodeTiming(0.25)}
    scaled = {n: NodeTiming(t.step_time_s * 1000) for n, t in timings.items()}
    for case in (timings, scaled):
        scores = node_scores(case, {}, settings=CFG)
        assert [n for n, s in scores.items() if s.slow] == ["c"]
        assert scores["c"].reference_s == pytest.approx(case["a"].step_time_s * 1.05)
    assert not any(s.slow for s in node_scores({n: NodeTiming(0.2) for n in "abcd"}, {}).values())
    lone = node_scores({"a": NodeTiming(0.2)}, {})
    assert lone["a"].relative == 0.0
    assert not lone["a"].slow


def test_the_individual_score_is_against_the_first_healthy_window_and_never_blames_alone() -> None:
    first = node_scores({"a": NodeTiming(0.1), "b": NodeTiming(0.1), "c": NodeTiming(0.3)}, {}, settings=CFG)
    baselines = new_baselines(first, {}, previous="step")
    assert baselines == {"a": 0.1, "b": 0.1}  # c was slow from the start: no healthy window yet
    # Everyone twice as slow (a shared file system, the machine's load): individual scores show it, and
    # nobody is relatively slow.
    later = node_scores({"a": NodeTiming(0.2), "b": NodeTiming(0.2), "c": NodeTiming(0.2)}, baselines)
    assert later["a"].individual == pytest.approx(2.0)
    assert later["c"].individual == 0.0
    assert not any(s.slow for s in later.values())
    assert new_baselines(later, baselines, previous="step") == {"a": 0.1, "b": 0.1, "c": 0.2}
    # Recorders appeared or went since the previous check: seconds of another kind, baselines afresh.
    assert new_baselines(later, baselines, previous="compute") == {"a": 0.2, "b": 0.2, "c": 0.2}


def test_a_slow_node_is_confirmed_only_by_checks_in_a_row() -> None:
    slow = node_scores({"a": NodeTiming(0.1), "b": NodeTiming(0.1), "c": NodeTiming(0.3)}, {})
    fast = node_scores({"a": NodeTiming(0.1), "b": NodeTiming(0.1), "c": NodeTiming(0.1)}, {})
    streaks: dict[str, int] = {}
    confirmed_at = []
    for i, scores in enumerate([slow, slow, fast, slow, slow, slow, slow]):
        streaks, confirmed = confirm_slow(streaks, scores, need=3)
        if confirmed:
            confirmed_at.append((i, confirmed))
    assert confirmed_at == [(5, ["c"])]  # the fast check in between started it over; confirmed once
    assert straggler_state(streaks["c"], need=3) == "slow"
    assert straggler_state(1, need=3) == "suspect"
    assert straggler_state(0, need=3) == "ok"


def test_the_settings_refuse_zero_confirming_checks() -> None:
    with pytest.raises(ConfigError):
        StragglerSettings(step_confirm_checks=0)
    assert StragglerSettings().evict_slow_nodes is False


# --- the master ----------------------------------------------------------------------------------------


def _sim(**stragglers: Any) -> Sim:
    sim = Sim(
        rendezvous={"min_nodes": 1, "max_nodes": 3, "last_call_s": 1.0},
        heartbeat={"timeout_s": 60.0},
        restart={"max_evictions": 2},
        probes={"stragglers": {"step_check_interval_s": 2.0, "step_confirm_checks": 3, **stragglers}},
    )
    sim.form("a", "b", "c")
    return sim


def _run(
    sim: Sim, *, seconds: int, step_s: dict[str, float], collective_s: dict[str, float] | None = None
) -> None:
    """Each live node heartbeats once a second; node n's two ranks step every ``step_s[n]`` seconds and, with
    ``collective_s``, report a recorder's step time and time inside collectives."""
    start = sim.now
    for _ in range(seconds):
        sim.at(sim.now + 1.0)
        for node in sorted(step_s):
            if node not in sim.job.members:
                continue
            offset = sim.job.members.index(node)
            step = int((sim.now - start) / step_s[node])
            ranks = []
            for i in (0, 1):
                r = pb.RankProgress(rank=2 * offset + i, step=step, step_unix_ns=int(sim.now * 1e9))
                if collective_s is not None:
                    r.activity.step_time_s = step_s[node]
                    r.activity.collective_time_s = collective_s[node]
                ranks.append(r)
            req = pb.HeartbeatRequest(
                node_id=node,
                incarnation=sim.inc[node],
                state=pb.NODE_STATE_RUNNING,
                round=sim.job.round_number,
                ranks=ranks,
            )
            sim.job.heartbeat(req, now=sim.now)


def test_a_slow_node_is_scored_confirmed_and_reported_but_not_evicted_by_default(tmp_path: Path) -> None:
    sim = _sim()
    _run(sim, seconds=30, step_s={"a": 0.1, "b": 0.1, "c": 0.25})
    view = sim.job.steps.straggler_view("c")
    assert view is not None
    assert view.verdict == "slow"
    assert view.basis == "step"
    assert view.relative == pytest.approx(2.5, rel=0.2)
    assert view.reason.startswith("c's median step interval"), view.reason
    healthy = sim.job.steps.straggler_view("a")
    assert healthy is not None
    assert healthy.verdict == "ok"
    assert healthy.individual == pytest.approx(1.0, rel=0.2)
    [event] = sim.job.events.of_kind("straggler")  # once, however many checks follow
    assert event.node == "c"
    assert event.message.startswith("step times: c's median step interval"), event.message
    assert not sim.job.evictions, "evict_slow_nodes is off by default"
    text = generate_latest(
        MasterMetrics(sim.job, LogStore(ring_lines=1, max_line_bytes=80, path=tmp_path / "job.log")).registry
    ).decode()
    assert 'phalanx_node_straggler_score{kind="relative",node="c"} 2.5' in text, text
    assert 'phalanx_node_step_time_seconds{node="a"} 0.1' in text, text


def test_with_the_policy_on_a_confirmed_slow_node_is_evicted_without_a_probe_round() -> None:
    sim = _sim(evict_slow_nodes=True)
    before = sim.job.round_number
    _run(sim, seconds=12, step_s={"a": 0.1, "b": 0.1, "c": 0.25})
    [eviction] = sim.job.evictions
    assert eviction.node_id == "c"
    assert eviction.kind == "straggler"
    assert eviction.reason.startswith("step times: c's median step interval"), eviction.reason
    assert sim.job.stats.evictions == {"straggler": 1}
    assert sim.job.probe is None, "no probe round was needed"
    assert sim.job.round_open
    assert sim.job.round_number == before
    assert sim.job.steps.straggler_view("c") is None  # a new round scores afresh


def test_with_recorders_the_compute_time_finds_the_node_that_synchronous_steps_hide() -> None:
    sim = _sim(evict_slow_nodes=True)
    # All-reduce equalises the steps at 0.2 s; c computes 0.18 s of it, a and b 0.08 s and wait 0.12 s.
    _run(
        sim,
        seconds=12,
        step_s={"a": 0.2, "b": 0.2, "c": 0.2},
        collective_s={"a": 0.12, "b": 0.12, "c": 0.02},
    )
    [eviction] = sim.job.evictions
    assert eviction.node_id == "c"
    assert "compute time per step" in eviction.reason, eviction.reason


def test_equal_nodes_flag_nothing_and_the_budget_bounds_evictions() -> None:
    sim = _sim(evict_slow_nodes=True)
    _run(sim, seconds=20, step_s={"a": 0.1, "b": 0.1, "c": 0.1})
    assert not sim.job.events.of_kind("straggler")
    assert all(getattr(sim.job.steps.straggler_view(n), "verdict", None) == "ok" for n in "abc")
    spent = Sim(
        rendezvous={"min_nodes": 1, "max_nodes": 3, "last_call_s": 1.0},
        heartbeat={"timeout_s": 60.0},
        restart={"max_evictions": 0},
        probes={"stragglers": {"step_check_interval_s": 2.0, "evict_slow_nodes": True}},
    )
    spent.form("a", "b", "c")
    _run(spent, seconds=12, step_s={"a": 0.1, "b": 0.1, "c": 0.25})
    assert spent.job.events.of_kind("straggler")
    assert not spent.job.evictions, "with the budget spent a slow node is reported, not evicted"
    assert not spent.job.finished
