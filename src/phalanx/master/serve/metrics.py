"""Prometheus metrics of the master (``/metrics``).

Gauges and counters are read from the job's state at scrape time (a custom collector), so a heartbeat
costs no metric update; only the RPC latency histogram is observed per call, and cheaply (see
:class:`RpcDurations`). Labels are bounded: no pod,
rank or step labels, and a node label only on the per-node step-time series, for the members of the running
round the latest step-time check scored (as many series as the job has nodes; a node that leaves drops out).

============================================  =========  =====================================
metric                                        type       labels
============================================  =========  =====================================
phalanx_nodes                                 gauge      state (alive, lost, evicted)
phalanx_rendezvous_round                      gauge
phalanx_world_size                            gauge
phalanx_job_phase                             gauge      phase (1 for the current phase)
phalanx_restarts_total                        counter
phalanx_failures_total                        counter    failure_class
phalanx_evictions_total                       counter    reason (heartbeat_timeout, connection_closed,
                                                         hardware, hang, probe_failed, straggler)
phalanx_probe_rounds_total                    counter    result (ok, suspects, evicted, inconclusive,
                                                         aborted)
phalanx_probe_reports_stale_total             counter
phalanx_slow_step_verdicts_total              counter    (ranks the step-time check found lagging)
phalanx_hang_verdicts_total                   counter    side (device, host, beacon)
phalanx_node_step_time_seconds                gauge      node (median step interval of its slowest rank)
phalanx_node_straggler_score                  gauge      node, kind (relative, individual)
phalanx_heartbeats_total                      counter
phalanx_actions_repeated_total                counter    (one-shot actions sent again: answers lost)
phalanx_training_step                         gauge      (highest step any rank reported)
phalanx_checkpoint_committed_step             gauge
phalanx_checkpoint_failures_total             counter
phalanx_log_lines_total                       counter
phalanx_log_lines_dropped_total               counter
phalanx_rpc_duration_seconds                  histogram  method
phalanx_event_loop_lag_seconds                gauge      (largest loop delay of the last 10 s)
phalanx_state_save_failures_total             counter    (saves that failed: disk full; old state kept)
phalanx_recovery_phase_seconds                histogram  phase (detect, reform, restore, recompute)
phalanx_recovery_last_phase_seconds           gauge      phase (the newest finished recovery's)
phalanx_recoveries_total                      counter    (finished recoveries)
============================================  =========  =====================================
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

from phalanx.api.elasticjob import MASTER_PHASES
from phalanx.master.job import Job
from phalanx.master.serve.logstore import LogStore
from phalanx.master.state.nodes import ALIVE, EVICTED, LOST
from phalanx.master.state.recovery import PHASES

__all__ = ["MasterMetrics", "RpcDurations"]

_PHASES = tuple(phase.value for phase in MASTER_PHASES)


class _JobCollector:
    def __init__(
        self, job: Job, logs: LogStore, loop_lag: Callable[[], float], save_failures: Callable[[], int]
    ) -> None:
        self._job = job
        self._logs = logs
        self._loop_lag = loop_lag
        self._save_failures = save_failures

    def collect(self) -> Iterator[Metric]:
        job = self._job
        nodes = GaugeMetricFamily("phalanx_nodes", "Nodes known to the master, by state.", labels=["state"])
        for state in (ALIVE, LOST, EVICTED):
            nodes.add_metric([state], sum(1 for n in job.nodes.values() if n.status == state))
        yield nodes
        yield GaugeMetricFamily(
            "phalanx_rendezvous_round", "Latest completed rendezvous round.", value=job.round_number
        )
        yield GaugeMetricFamily(
            "phalanx_world_size",
            "Training processes in the current round.",
            value=job.round.world_size if job.round else 0,
        )
        phase = GaugeMetricFamily("phalanx_job_phase", "1 for the job's current phase.", labels=["phase"])
        for p in _PHASES:
            phase.add_metric([p], 1.0 if job.shown_phase == p else 0.0)
        yield phase
        yield CounterMetricFamily(
            "phalanx_restarts", "In-place restarts of the job.", value=job.restart_count
        )
        failures = CounterMetricFamily(
            "phalanx_failures", "Worker failures reported, by class.", labels=["failure_class"]
        )
        for cls, count in sorted(job.stats.failures.items()):
            failures.add_metric([cls], count)
        yield failures
        evictions = CounterMetricFamily(
            "phalanx_evictions", "Eviction requests, by reason.", labels=["reason"]
        )
        for kind, count in sorted(job.stats.evictions.items()):
            evictions.add_metric([kind], count)
        yield evictions
        verdicts = CounterMetricFamily(
            "phalanx_hang_verdicts", "Hangs reported, by where the rank was stuck.", labels=["side"]
        )
        for side, count in sorted(job.stats.hang_verdicts.items()):
            verdicts.add_metric([side], count)
        yield verdicts
        rounds = CounterMetricFamily(
            "phalanx_probe_rounds", "Finished probe rounds, by result.", labels=["result"]
        )
        for result, count in sorted(job.stats.probe_rounds.items()):
            rounds.add_metric([result], count)
        yield rounds
        yield CounterMetricFamily(
            "phalanx_probe_reports_stale",
            "Probe reports ignored as stale (older probe round, duplicate, not a member).",
            value=job.stats.probe_reports_stale,
        )
        yield CounterMetricFamily(
            "phalanx_slow_step_verdicts",
            "Ranks whose step intervals lagged the other ranks' (once per rank and rendezvous round).",
            value=job.stats.slow_step_verdicts,
        )
        step_time = GaugeMetricFamily(
            "phalanx_node_step_time_seconds",
            "Median recent step interval of each member node's slowest rank (latest step-time check).",
            labels=["node"],
        )
        score = GaugeMetricFamily(
            "phalanx_node_straggler_score",
            "Each member node's straggler scores: relative (its compute or step time over the other nodes' "
            "median) and individual (over its own baseline in the round); 1 is normal, 0 not yet scored.",
            labels=["node", "kind"],
        )
        for node_id, s in sorted(job.node_scores.items()):
            step_time.add_metric([node_id], s.step_time_s)
            score.add_metric([node_id, "relative"], s.relative)
            score.add_metric([node_id, "individual"], s.individual)
        yield step_time
        yield score
        yield CounterMetricFamily("phalanx_heartbeats", "Heartbeats received.", value=job.stats.heartbeats)
        yield CounterMetricFamily(
            "phalanx_actions_repeated",
            "One-shot actions sent again because no heartbeat acknowledged them (answers lost on the way).",
            value=job.stats.actions_repeated,
        )
        yield GaugeMetricFamily(
            "phalanx_training_step", "Highest step any rank reported.", value=job.max_step
        )
        yield GaugeMetricFamily(
            "phalanx_checkpoint_committed_step",
            "Newest committed checkpoint step.",
            value=job.checkpoints.committed,
        )
        yield CounterMetricFamily(
            "phalanx_checkpoint_failures",
            "Checkpoint persists that failed.",
            value=job.stats.checkpoint_failures,
        )
        yield CounterMetricFamily(
            "phalanx_log_lines", "Worker log lines received.", value=self._logs.lines_total
        )
        yield CounterMetricFamily(
            "phalanx_log_lines_dropped",
            "Worker log lines dropped by agents' rate limits.",
            value=self._logs.dropped_total,
        )
        yield GaugeMetricFamily(
            "phalanx_event_loop_lag_seconds",
            "Largest delay of the master's event loop in the last 10 s (how late a busy master answers).",
            value=self._loop_lag(),
        )
        yield CounterMetricFamily(
            "phalanx_state_save_failures",
            "Saves of the master's durable state that failed (full disk, store refused); the previous state "
            "was kept and the save is retried.",
            value=self._save_failures(),
        )

        yield from _recovery(job)


def _recovery(job: Job) -> Iterator[Metric]:
    """The recovery breakdown (:mod:`phalanx.master.state.recovery`): where each recovery's time went."""
    tracker = job.recovery
    phases = HistogramMetricFamily(
        "phalanx_recovery_phase_seconds",
        "Seconds of each recovery phase: detect (failure to restart), reform (to the round completing), "
        "restore (to the first step), recompute (to the step reached before the failure).",
        labels=["phase"],
    )
    last = GaugeMetricFamily(
        "phalanx_recovery_last_phase_seconds",
        "The newest finished recovery's phases (0: it did not go through that phase, or none finished yet).",
        labels=["phase"],
    )
    for phase in PHASES:
        buckets, total = tracker.histogram(phase)
        phases.add_metric([phase], buckets, total)
        last.add_metric([phase], tracker.last.get(phase, 0.0))  # always there: dashboards and tests see it
    yield phases
    yield last
    yield CounterMetricFamily(
        "phalanx_recoveries",
        "Recoveries finished (training back at its pre-failure step).",
        value=tracker.finished,
    )


class MasterMetrics:
    """The master's own registry (never the global one, so two masters in one test process do not clash)."""

    def __init__(
        self,
        job: Job,
        logs: LogStore,
        *,
        loop_lag: Callable[[], float] = lambda: 0.0,
        save_failures: Callable[[], int] = lambda: 0,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_JobCollector(job, logs, loop_lag, save_failures))
        self.rpc_duration = RpcDurations(
            buckets=(
                0.0001,
                0.00025,
                0.0005,
                0.001,
                0.0025,
                0.005,
                0.01,
                0.025,
                0.05,
                0.1,
                0.25,
                0.5,
                1.0,
                2.5,
                10.0,
                30.0,
            ),
        )
        self.registry.register(self.rpc_duration)


class _Durations:
    """One method's counts per bucket (the last one above every bound) and their sum."""

    __slots__ = ("_bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect_left(self._bounds, seconds)] += 1  # the first bound >= seconds: its "le" bucket
        self.sum += seconds


class RpcDurations:
    """``phalanx_rpc_duration_seconds``, a histogram per method, observed by the event loop alone: without
    prometheus_client's ``Histogram``, which takes a lock for the sum and another for the bucket of each
    observation (2-3 us of a heartbeat's 100 on a master's core). ``/metrics`` is served on the same event
    loop, so a scrape reads the counts between two observations, never during one."""

    NAME = "phalanx_rpc_duration_seconds"

    def __init__(self, *, buckets: tuple[float, ...]) -> None:
        self.bounds = tuple(sorted(buckets))
        self._methods: dict[str, _Durations] = {}

    def labels(self, *, method: str) -> _Durations:
        durations = self._methods.get(method)
        if durations is None:
            durations = self._methods[method] = _Durations(self.bounds)
        return durations

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(
            self.NAME,
            "Time the master spent answering an agent RPC (long-polls included).",
            labels=["method"],
        )
        for method, durations in sorted(self._methods.items()):
            counts, total = list(durations.counts), durations.sum
            cumulative, buckets = 0, []
            for bound, count in zip((*self.bounds, float("inf")), counts, strict=True):
                cumulative += count
                buckets.append((floatToGoString(bound), cumulative))  # type: ignore[no-untyped-call]
            family.add_metric([method], buckets, sum_value=total)
        yield family
