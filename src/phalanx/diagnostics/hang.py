"""Hang verdicts from progress beacons: a pure function of what the agent has seen and ``now``.

A rank is hung when its beacon is older than an adaptive timeout, ``max(floor_s, factor * p99)`` of its
recent step intervals (so a job with 30 s steps is not declared hung after 60 s, and a job with 50 ms steps
is caught after ``floor_s``), or when it has not reported any step within ``startup_s`` of starting. A
worker that never calls ``phalanx.report_step`` is only ever judged by the startup rule, which is why
``startup_s`` defaults to minutes.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from phalanx.api.settings import HangSettings

_WINDOW = 128  # recent step intervals kept per rank for the p99


@dataclass
class RankHistory:
    """What the agent has observed of one worker's beacon in the current round."""

    started_at: float
    """Agent clock (seconds) when the worker was started or handed its round."""
    last_step: int = -1
    last_change_at: float | None = None
    """Agent clock when ``last_step`` was first seen."""
    intervals: deque[float] = field(default_factory=lambda: deque(maxlen=_WINDOW))

    def observe(self, *, step: int, now: float) -> None:
        """Records a beacon reading taken at ``now``."""
        if step == self.last_step:
            return
        if step >= 0 and self.last_change_at is not None and self.last_step >= 0:
            steps = max(1, step - self.last_step)
            interval = (now - self.last_change_at) / steps
            self.intervals.extend([interval] * min(steps, 4))
        self.last_step = step
        self.last_change_at = now


@dataclass(frozen=True)
class HangVerdict:
    hung: bool
    age_s: float
    """Seconds since the last progress (or since start before the first step)."""
    timeout_s: float
    """The timeout the age was compared with."""
    reason: str = ""


def p99(values: list[float]) -> float:
    """The 99th percentile (nearest rank); 0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


def timeout_for(history: RankHistory, settings: HangSettings) -> float:
    """The adaptive stale-beacon timeout for one rank."""
    return max(settings.floor_s, settings.factor * p99(list(history.intervals)))


def verdict(history: RankHistory, settings: HangSettings, *, now: float) -> HangVerdict:
    """Is the rank hung at ``now``?"""
    if history.last_step < 0 or history.last_change_at is None:
        age = now - history.started_at
        hung = settings.enabled and age > settings.startup_s
        reason = f"no step reported within {settings.startup_s:g}s of start" if hung else ""
        return HangVerdict(hung=hung, age_s=age, timeout_s=settings.startup_s, reason=reason)
    age = now - history.last_change_at
    timeout = timeout_for(history, settings)
    hung = settings.enabled and age > timeout
    reason = (
        f"no progress past step {history.last_step} for {age:.1f}s (timeout {timeout:.1f}s)" if hung else ""
    )
    return HangVerdict(hung=hung, age_s=age, timeout_s=timeout, reason=reason)
