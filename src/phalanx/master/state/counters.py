"""Counters the job keeps for ``/metrics`` (monotonic within one master process)."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["JobStats"]


@dataclass
class JobStats:
    failures: dict[str, int] = field(default_factory=dict)
    """Worker failures by failure class (user, killed, oom, comm, hardware, hang, unknown)."""
    evictions: dict[str, int] = field(default_factory=dict)
    """Eviction requests by kind (heartbeat_timeout, connection_closed, hardware, hang, probe_failed,
    straggler)."""
    heartbeats: int = 0
    actions_repeated: int = 0
    """One-shot actions sent again because no heartbeat acknowledged them: answers lost on the network."""
    probe_rounds: dict[str, int] = field(default_factory=dict)
    """Finished probe rounds by result (ok, suspects, evicted, inconclusive, aborted)."""
    probe_reports_stale: int = 0
    slow_step_verdicts: int = 0
    """Ranks found lagging by the step-time check (each at most once per rendezvous round)."""
    checkpoint_failures: int = 0
    hang_verdicts: dict[str, int] = field(default_factory=dict)
    """Hangs the agents reported, by the side of their verdict (device, host, beacon)."""
