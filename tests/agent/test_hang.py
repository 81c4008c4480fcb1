"""The hang verdict with an injected clock."""

from __future__ import annotations

from phalanx.api.settings import HangSettings
from phalanx.diagnostics.hang import RankHistory, p99, stopped_verdict, timeout_for, verdict

S = HangSettings(floor_s=2.0, idle_floor_s=5.0, factor=10.0, startup_s=30.0)
"""A beacon alone cannot tell where the rank is: it is judged by the idle floor (5 s), never the floor."""


def test_no_step_within_startup_is_a_hang() -> None:
    h = RankHistory(started_at=100.0)
    assert not verdict(h, S, now=129.0).hung
    v = verdict(h, S, now=131.0)
    assert v.hung
    assert "no step" in v.reason


def test_stale_beacon_past_floor_with_fast_steps() -> None:
    h = RankHistory(started_at=0.0)
    for i in range(20):
        h.observe(step=i, now=1.0 + 0.1 * i)  # 100 ms steps: the floor dominates
    last = 1.0 + 0.1 * 19
    assert timeout_for(h, S, waiting=False) == 5.0
    assert timeout_for(h, S) == 2.0  # a rank waiting in a recorded collective
    assert not verdict(h, S, now=last + 4.9).hung
    v = verdict(h, S, now=last + 5.1)
    assert v.hung
    assert "step 19" in v.reason


def test_slow_steps_raise_the_timeout() -> None:
    h = RankHistory(started_at=0.0)
    for i in range(10):
        h.observe(step=i, now=2.0 * i)  # 2 s steps: 10 x p99 = 20 s
    assert timeout_for(h, S) == timeout_for(h, S, waiting=False) == 20.0
    assert not verdict(h, S, now=18.0 + 19.0).hung
    assert verdict(h, S, now=18.0 + 21.0).hung


def test_repeated_readings_do_not_count_as_progress() -> None:
    h = RankHistory(started_at=0.0)
    h.observe(step=1, now=1.0)
    h.observe(step=1, now=4.0)
    assert verdict(h, S, now=6.5).hung  # age counts from when step 1 was first seen


def test_disabled_never_hangs() -> None:
    off = HangSettings(enabled=False, floor_s=1.0, startup_s=1.0)
    h = RankHistory(started_at=0.0)
    assert not verdict(h, off, now=1e6).hung


def test_p99() -> None:
    assert p99([]) == 0.0
    assert p99([1.0] * 99 + [50.0]) == 1.0
    assert p99([1.0] * 98 + [50.0, 60.0]) == 50.0


def test_a_process_stopped_by_a_signal_is_hung_after_stopped_s_whatever_its_steps() -> None:
    settings = HangSettings(stopped_s=2.0)
    assert not stopped_verdict(settings, stopped_for_s=1.9, last_step=40).hung
    v = stopped_verdict(settings, stopped_for_s=2.1, last_step=40)
    assert v.hung
    assert v.side == "host"
    assert v.reason == "after step 40, stopped by a signal (host side, 2.1 s > 2.0 s)"
    assert not stopped_verdict(HangSettings(enabled=False), stopped_for_s=999, last_step=40).hung
