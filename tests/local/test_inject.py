"""The --inject spec parser."""

from __future__ import annotations

import pytest

from phalanx.api.errors import ConfigError
from phalanx.local.inject import Injection, parse, validate


def test_parse_forms() -> None:
    assert parse("kill-worker@step=20,node=1,rank=1") == Injection(
        kind="kill-worker", step=20, node=1, rank=1, spec="kill-worker@step=20,node=1,rank=1"
    )
    node = parse("kill-node@after=2.5s,node=2")
    assert (node.kind, node.after_s, node.node, node.step) == ("kill-node", 2.5, 2, None)
    assert parse("kill-master@after=500ms").after_s == 0.5
    hang = parse("hang-worker@step=3,after=1")
    assert (hang.step, hang.after_s, hang.node, hang.rank) == (3, 1.0, 0, 0)
    slow = parse("delay-node@after=0s,node=1,latency=1200ms")
    assert (slow.kind, slow.node, slow.latency_s, slow.for_s) == ("delay-node", 1, 1.2, None)
    cut = parse("partition-node@step=15,node=1,for=6s")
    assert (cut.kind, cut.step, cut.for_s) == ("partition-node", 15, 6.0)
    assert parse("slow-network@after=5s,node=2,rate=20mbit").rate_bit_s == 20_000_000
    assert parse("slow-network@after=5s,rate=1.5gbit,for=10s").rate_bit_s == 1_500_000_000
    assert parse("slow-network@after=5s,rate=64kbit").rate_bit_s == 64_000
    assert parse("slow-cpu@step=10,node=1,cpu=200m").cpus == 0.2
    cpu = parse("slow-cpu@step=10,cpu=1.5,for=3s")
    assert (cpu.kind, cpu.cpus, cpu.for_s) == ("slow-cpu", 1.5, 3.0)
    host = parse("hang-checkpoint-host@step=30,node=1")
    assert (host.kind, host.step, host.node) == ("hang-checkpoint-host", 30, 1)
    assert parse("kill-checkpoint-host@after=2s").after_s == 2.0


def test_due() -> None:
    both = parse("kill-worker@step=10,after=5")
    assert not both.due(step=10, elapsed_s=4)
    assert not both.due(step=9, elapsed_s=6)
    assert both.due(step=10, elapsed_s=5)
    assert parse("kill-worker@step=10").due(step=11, elapsed_s=0)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("kill-gpu@step=1", "unknown fault 'kill-gpu'"),
        ("kill-worker", "needs a trigger"),
        ("kill-worker@", "needs a trigger"),
        ("kill-worker@node=1", "needs step= or after="),
        ("kill-worker@step", "expected key=value"),
        ("kill-worker@step=x", "whole number"),
        ("kill-worker@step=-1", "cannot be negative"),
        ("kill-node@step=1,rank=1", "kill-node does not take rank="),
        ("kill-master@step=1,node=0", "kill-master does not take node="),
        ("kill-worker@step=1,step=2", "given twice"),
        ("kill-worker@after=soon", "duration"),
        ("delay-node@after=1s", "needs latency= above 0"),
        ("delay-node@after=1s,latency=0ms", "needs latency= above 0"),
        ("partition-node@after=1s,for=0s", "for= must be above 0"),
        ("partition-node@after=1s,rank=1", "partition-node does not take rank="),
        ("kill-node@after=1s,for=2s", "kill-node does not take for="),
        ("kill-checkpoint-host@step=1,rank=1", "kill-checkpoint-host does not take rank="),
        ("slow-network@after=1s", "needs rate=, e.g. slow-network@after=10s,rate=20mbit"),
        ("slow-network@after=1s,rate=20", "rate= takes a number and one of bit, kbit, mbit, gbit"),
        ("slow-network@after=1s,rate=20mbps", "rate= takes a number"),
        ("slow-network@after=1s,rate=4kbit", "at least 8kbit"),
        ("slow-network@after=1s,rate=1mbit,rank=0", "slow-network does not take rank="),
        ("slow-cpu@after=1s", "needs cpu=, e.g. slow-cpu@after=10s,cpu=200m"),
        ("slow-cpu@after=1s,cpu=fast", "cpu= takes CPUs as Kubernetes writes them"),
        ("slow-cpu@after=1s,cpu=5m", "at least 10m"),
        ("slow-cpu@after=1s,cpu=nan", "at least 10m"),
        ("slow-cpu@after=1s,rate=1mbit", "slow-cpu does not take rate="),
    ],
)
def test_errors_say_what_is_wrong(spec: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse(spec)


def test_validate_targets() -> None:
    validate([parse("kill-worker@step=1,node=2,rank=1")], initial_nodes=3, nproc_per_node=2)
    with pytest.raises(ConfigError, match="only 3 nodes"):
        validate([parse("kill-node@step=1,node=3")], initial_nodes=3, nproc_per_node=2)
    with pytest.raises(ConfigError, match="runs 2 processes"):
        validate([parse("kill-worker@step=1,rank=2")], initial_nodes=3, nproc_per_node=2)
