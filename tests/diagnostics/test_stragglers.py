"""Straggler and fault-isolation verdicts with plain values (no processes, no clock)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phalanx.api.errors import ConfigError
from phalanx.api.settings import StragglerSettings
from phalanx.diagnostics.probe_runner import Measurement
from phalanx.diagnostics.stragglers import (
    NodeVerdict,
    compute_verdicts,
    link_verdicts,
    step_verdicts,
    suspects,
)


def ok(rate: float, peer: str = "") -> Measurement:
    return Measurement(peer_node_id=peer, ok=True, elapsed_s=1.0, rate=rate)


def bad(error: str, peer: str = "") -> Measurement:
    return Measurement(peer_node_id=peer, ok=False, error=error)


def ring(rates: dict[tuple[str, str], float]) -> dict[str, list[Measurement]]:
    """Both ends of every pair report it, as the pairwise probe does."""
    out: dict[str, list[Measurement]] = {}
    for (a, b), rate in rates.items():
        out.setdefault(a, []).append(ok(rate, b))
        out.setdefault(b, []).append(ok(rate, a))
    return out


def ring_rates(nodes: list[str], rate: float = 10.0) -> dict[tuple[str, str], float]:
    return {(nodes[i], nodes[(i + 1) % len(nodes)]): rate for i in range(len(nodes))}


def key(verdicts: list[NodeVerdict]) -> list[tuple[str, str, str]]:
    return [(v.node_id, v.kind, v.confidence) for v in verdicts]


# -- settings --------------------------------------------------------------------------------------------


def test_settings_refuse_thresholds_outside_their_range() -> None:
    with pytest.raises(ConfigError, match="compute_threshold"):
        StragglerSettings(compute_threshold=1.2)
    with pytest.raises(ConfigError, match="step_factor"):
        StragglerSettings(step_factor=1.0)
    with pytest.raises(ConfigError, match="step_min_samples"):
        StragglerSettings(step_window=4, step_min_samples=5)


# -- matmul ----------------------------------------------------------------------------------------------


def test_failed_matmul_probe_is_a_high_confidence_suspect_with_its_error() -> None:
    verdicts = compute_verdicts(
        {"n0": [ok(100.0)], "n1": [ok(100.0), bad("wrong matmul result: column 3")], "n2": []}
    )
    assert key(verdicts) == [("n1", "probe_failed", "high"), ("n2", "probe_failed", "high")]
    assert "1 of 2 devices" in verdicts[0].reason
    assert "wrong matmul result" in verdicts[0].reason
    assert "no measurement" in verdicts[1].reason


def test_slow_device_marks_its_node_slow_with_ratio_in_reason() -> None:
    matmul = {f"n{i}": [ok(400.0), ok(410.0)] for i in range(4)}
    matmul["n2"] = [ok(405.0), ok(250.0)]  # one slow GPU
    verdicts = compute_verdicts(matmul)
    assert key(verdicts) == [("n2", "slow_compute", "high")]
    assert verdicts[0].value == 250.0
    assert verdicts[0].reference == pytest.approx(405.0)
    assert "0.62x" in verdicts[0].reason


def test_two_nodes_are_compared_with_each_other_not_with_their_mean() -> None:
    verdicts = compute_verdicts({"a": [ok(100.0)], "b": [ok(70.0)]})
    assert key(verdicts) == [("b", "slow_compute", "high")]


def test_slightly_slower_node_within_threshold_is_not_flagged() -> None:
    assert compute_verdicts({"a": [ok(100.0)], "b": [ok(85.0)], "c": [ok(98.0)]}) == []


def test_single_measurement_cannot_be_slow() -> None:
    assert compute_verdicts({"a": [ok(1.0)]}) == []


def test_threshold_comes_from_settings() -> None:
    rates = {"a": [ok(100.0)], "b": [ok(100.0)], "c": [ok(85.0)]}
    assert compute_verdicts(rates) == []
    strict = StragglerSettings(compute_threshold=0.9)
    assert key(compute_verdicts(rates, settings=strict)) == [("c", "slow_compute", "high")]


# -- pairwise all-gather ---------------------------------------------------------------------------------


def test_node_in_two_slow_pairs_is_the_suspect_and_its_neighbours_are_cleared() -> None:
    nodes = [f"n{i}" for i in range(6)]
    rates = ring_rates(nodes)
    rates[("n2", "n3")] = rates[("n3", "n4")] = 3.0
    verdicts = link_verdicts(ring(rates))
    assert key(verdicts) == [("n3", "slow_link", "high")]
    assert "with n2" in verdicts[0].reason
    assert "with n4" in verdicts[0].reason
    assert suspects(verdicts) == ["n3"]


def test_slow_node_found_in_a_ring_of_three_and_four() -> None:
    for n in (3, 4):
        nodes = [f"n{i}" for i in range(n)]
        rates = ring_rates(nodes)
        rates[("n0", "n1")] = rates[(nodes[-1], "n0")] = 2.0
        assert suspects(link_verdicts(ring(rates))) == ["n0"], n


def test_single_slow_pair_is_ambiguous_and_reports_both_ends_with_low_confidence() -> None:
    nodes = [f"n{i}" for i in range(5)]
    rates = ring_rates(nodes)
    rates[("n1", "n2")] = 2.0
    verdicts = link_verdicts(ring(rates))
    assert key(verdicts) == [("n1", "slow_link", "low"), ("n2", "slow_link", "low")]
    assert "no other pair tells" in verdicts[0].reason
    assert suspects(verdicts) == []


def test_dead_node_fails_both_its_pairs_and_is_the_suspect() -> None:
    nodes = ["a", "b", "c", "d"]
    report = ring({("a", "b"): 10.0, ("c", "d"): 10.0})
    report["b"].append(bad("c did not join the probe group within 30s", "c"))
    report["d"].append(bad("all-gather failed: Connection closed by peer", "c"))
    verdicts = link_verdicts(report, expected=nodes)
    assert key(verdicts) == [("c", "slow_link", "high")]
    assert "failed (b reported: c did not join" in verdicts[0].reason
    assert verdicts[0].value == 0.0


def test_expected_node_that_never_reported_is_a_suspect() -> None:
    report = ring({("a", "b"): 10.0})
    verdicts = link_verdicts(report, expected=["a", "b", "c"])
    assert key(verdicts) == [("c", "probe_failed", "high")]


def test_failure_without_a_peer_is_low_confidence() -> None:
    verdicts = link_verdicts({"a": [bad("could not reach the probe store at h:1")]})
    assert key(verdicts) == [("a", "probe_failed", "low")]
    assert "probe store" in verdicts[0].reason


def test_pair_rate_is_the_slower_of_its_two_reports() -> None:
    report = ring(ring_rates(["a", "b", "c", "d", "e"]))
    report["a"] = [ok(10.0, "b"), ok(10.0, "e")]
    report["b"] = [ok(1.0, "a"), ok(10.0, "c")]  # b saw the a-b pair slow
    assert key(link_verdicts(report)) == [("a", "slow_link", "low"), ("b", "slow_link", "low")]


# -- step intervals --------------------------------------------------------------------------------------


def test_rank_with_slow_steps_lags() -> None:
    intervals = {r: [1.0, 1.1, 0.9, 1.0, 1.05] for r in range(4)}
    intervals[2] = [2.0, 2.1, 1.9, 2.2, 2.0]
    verdicts = step_verdicts(intervals)
    assert [v.rank for v in verdicts] == [2]
    assert verdicts[0].median_interval_s == 2.0
    assert "2.00x" in verdicts[0].reason


def test_two_ranks_compare_with_each_other() -> None:
    assert [v.rank for v in step_verdicts({0: [1.0] * 5, 1: [1.6] * 5})] == [1]


def test_only_the_window_counts_and_short_histories_are_not_judged() -> None:
    cfg = StragglerSettings(step_window=5, step_min_samples=5)
    recovered = {0: [1.0] * 10, 1: [5.0] * 5 + [1.0] * 5, 2: [1.0] * 10, 3: [9.0] * 4}
    assert step_verdicts(recovered, settings=cfg) == []


def test_one_spike_does_not_make_a_straggler() -> None:
    intervals = {r: [1.0] * 9 for r in range(3)}
    intervals[1] = [1.0] * 8 + [30.0]
    assert step_verdicts(intervals) == []


# -- properties ------------------------------------------------------------------------------------------

rate = st.floats(min_value=1e-3, max_value=1e3, allow_nan=False)
scale = st.integers(min_value=-20, max_value=20).map(lambda e: 2.0**e)  # exact: no rounding at thresholds


@settings(max_examples=150, deadline=None)
@given(
    st.dictionaries(st.sampled_from([f"n{i}" for i in range(8)]), st.lists(rate, min_size=1, max_size=4)),
    scale,
)
def test_scaling_all_matmul_rates_leaves_verdicts_unchanged(
    rates: dict[str, list[float]], factor: float
) -> None:
    base = compute_verdicts({n: [ok(r) for r in rs] for n, rs in rates.items()})
    scaled = compute_verdicts({n: [ok(r * factor) for r in rs] for n, rs in rates.items()})
    assert key(base) == key(scaled)


@settings(max_examples=150, deadline=None)
@given(
    st.integers(min_value=3, max_value=12).flatmap(lambda n: st.lists(rate, min_size=n, max_size=n)), scale
)
def test_scaling_all_pair_bandwidths_leaves_verdicts_unchanged(rates: list[float], factor: float) -> None:
    nodes = [f"n{i}" for i in range(len(rates))]
    pairs = list(ring_rates(nodes))
    base = link_verdicts(ring(dict(zip(pairs, rates, strict=True))))
    scaled = link_verdicts(ring({p: r * factor for p, r in zip(pairs, rates, strict=True)}))
    assert key(base) == key(scaled)


@settings(max_examples=150, deadline=None)
@given(
    st.dictionaries(st.integers(0, 15), st.lists(rate, min_size=5, max_size=40), min_size=1),
    scale,
)
def test_scaling_all_step_intervals_leaves_verdicts_unchanged(
    intervals: dict[int, list[float]], factor: float
) -> None:
    base = [v.rank for v in step_verdicts(intervals)]
    scaled = [v.rank for v in step_verdicts({r: [x * factor for x in xs] for r, xs in intervals.items()})]
    assert base == scaled


@settings(max_examples=100, deadline=None)
@given(
    st.integers(min_value=1, max_value=16),
    rate,
    st.lists(st.floats(min_value=0.9, max_value=1.1), min_size=64, max_size=64),
)
def test_a_clean_cluster_yields_no_suspects(n: int, base: float, noise: list[float]) -> None:
    """Equal nodes with +-10% noise: no verdict of any kind from any of the three checks."""
    nodes = [f"n{i}" for i in range(n)]
    matmul = {
        node: [ok(base * noise[i % 64]), ok(base * noise[(i + 7) % 64])] for i, node in enumerate(nodes)
    }
    assert compute_verdicts(matmul) == []
    if n >= 2:
        pairs = list(ring_rates(nodes)) if n > 2 else [("n0", "n1")]
        report = ring({p: base * noise[(i + 3) % 64] for i, p in enumerate(pairs)})
        assert link_verdicts(report, expected=nodes) == []
    steps = {r: [base * noise[(r + j) % 64] for j in range(10)] for r in range(n)}
    assert step_verdicts(steps) == []
