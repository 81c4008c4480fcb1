"""The min-nodes timeout runs only once the job's worker Pods could be scheduled: nodes that wait for a
machine (a queue such as Kueue, a cluster autoscaler) are not nodes lost. The operator counts the placed
worker Pods into the ElasticJob's ``phalanx.dev/scheduled-workers`` annotation, which the master reads with
the spec. Pure, with an injected clock; tests/k8s/test_operator_ha.py runs it on the real control plane."""

from __future__ import annotations

from phalanx.master.store.kube import scheduled_workers

from .sim import Sim

TWO = {
    "rendezvous": {"min_nodes": 2, "max_nodes": 2, "last_call_s": 1.0, "min_nodes_timeout_s": 30.0},
    "heartbeat": {"interval_s": 1.0, "timeout_s": 4.0},
}


def _follow(sim: Sim, scheduled: int | None) -> None:
    sim.job.follow_spec(suspend=False, generation=1, scheduled_workers=scheduled, now=sim.now)


def test_unscheduled_workers_do_not_start_the_min_nodes_timeout() -> None:
    sim = Sim(**TWO)
    _follow(sim, 0)
    sim.at(sim.now + 100.0)
    _follow(sim, 1)  # one of two placed: still waiting for a machine
    sim.at(sim.now + 100.0)
    assert not sim.job.finished
    # Both placed: from now on the nodes have 30 s to join.
    _follow(sim, 2)
    sim.at(sim.now + 29.0)
    assert not sim.job.finished
    sim.at(sim.now + 2.0)
    sim.at(sim.now + 0.1)
    assert sim.job.phase == "Failed"
    assert "required nodes" in sim.job.reason


def test_without_the_operators_count_the_timeout_runs_from_the_start() -> None:
    sim = Sim(**TWO)
    _follow(sim, None)  # outside Kubernetes nobody counts
    sim.at(sim.now + 31.0)
    sim.at(sim.now + 0.1)
    assert sim.job.phase == "Failed"


def test_the_annotation_is_read_as_a_count() -> None:
    assert scheduled_workers({"annotations": {"phalanx.dev/scheduled-workers": "3"}}) == 3
    assert scheduled_workers({"annotations": {"phalanx.dev/scheduled-workers": "x"}}) is None
    assert scheduled_workers({"annotations": None}) is None
    assert scheduled_workers({}) is None
