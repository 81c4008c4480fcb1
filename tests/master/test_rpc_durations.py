"""The master's RPC latency histogram (phalanx.master.serve.metrics.RpcDurations) writes what
prometheus_client's own Histogram writes for the same observations: the same buckets, counts and sums."""

from __future__ import annotations

import random

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from phalanx.master.serve.metrics import RpcDurations

BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.01, 0.1, 1.0, 2.5, 10.0, 30.0)


def exposition(registry: CollectorRegistry) -> list[str]:
    lines = generate_latest(registry).decode().splitlines()
    return sorted(line for line in lines if not line.startswith("#") and "_created" not in line)


def test_the_histogram_reads_as_prometheus_clients_own() -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    durations = RpcDurations(buckets=BUCKETS)
    ours.register(durations)
    reference = Histogram("phalanx_rpc_duration_seconds", "x", ["method"], registry=theirs, buckets=BUCKETS)
    rng = random.Random(7)
    # On a bound, between bounds, above every bound, zero: each "le" bucket takes values <= its bound.
    values = [*BUCKETS, 0.0, 45.0, *(rng.expovariate(1 / 0.002) for _ in range(2000))]
    for i, value in enumerate(values):
        method = ("Heartbeat", "HeartbeatStream", "JoinRendezvous")[i % 3]
        durations.labels(method=method).observe(value)
        reference.labels(method=method).observe(value)
    assert exposition(ours) == exposition(theirs)
    assert any('le="+Inf"' in line and "HeartbeatStream" in line for line in exposition(ours))


def test_a_method_is_written_from_its_labels_on_with_zero_counts_as_prometheus_client_does() -> None:
    registry = CollectorRegistry()
    durations = RpcDurations(buckets=BUCKETS)
    registry.register(durations)
    assert exposition(registry) == []
    durations.labels(method="Heartbeat")
    lines = exposition(registry)
    assert len(lines) == len(BUCKETS) + 3  # the buckets, +Inf, _count and _sum
    assert all('method="Heartbeat"' in line and line.endswith((" 0", " 0.0")) for line in lines)
