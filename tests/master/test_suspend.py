"""A suspended job (the ElasticJob's spec.suspend): nodes whose Pods the operator deletes are forgotten, not
evicted; the nodes agree on the step they persist on the way out; the resumed job forms a new round with the
new Pods. Pure, with an injected clock."""

from __future__ import annotations

from phalanx.api.v1 import master_pb2 as pb
from phalanx.master.job import Job

from .sim import Sim

TWO = {
    "rendezvous": {"min_nodes": 2, "max_nodes": 2, "last_call_s": 1.0, "min_nodes_timeout_s": 30.0},
    "heartbeat": {"interval_s": 1.0, "timeout_s": 4.0},
    "restart": {"max_evictions": 0},
}


def suspended_job() -> tuple[Sim, int]:
    sim = Sim(**TWO)
    r = sim.form("a", "b")
    assert sim.job.status().phase == "Running"
    sim.job.suspend(True, now=sim.now)
    return sim, r


def test_suspension_is_published_and_survives_a_master_restart() -> None:
    sim, r = suspended_job()
    status = sim.job.status()
    assert status.phase == "Suspended"
    assert status.suspended is True
    assert [e.kind for e in sim.job.events.since(0)][-1] == "job_suspended"
    resumed = Job(settings=sim.job.settings, now=sim.now + 1, saved=sim.job.durable())
    assert resumed.suspended
    assert resumed.status().phase == "Suspended"
    assert resumed.round_number == r


def test_nodes_deleted_while_suspended_are_forgotten_not_evicted() -> None:
    sim, _ = suspended_job()
    # With an eviction budget of 0, a single eviction would fail the job.
    sim.disconnect("a")  # a's agent exited: its held heartbeat's connection closed
    sim.hb("b")
    sim.at(sim.now + 1.5)
    assert "a" not in sim.job.nodes
    sim.at(sim.now + 5.0)  # b silent past the heartbeat timeout
    assert sim.job.nodes == {}
    assert sim.job.evictions == []
    assert sim.job.restart_count == 0
    assert not sim.job.finished
    kinds = [e.kind for e in sim.job.events.since(0)]
    assert kinds.count("node_left") == 2
    assert "node_lost" not in kinds
    assert "eviction_requested" not in kinds
    sim.at(sim.now + 60.0)  # far past min_nodes_timeout_s: a suspended job does not fail for want of nodes
    assert not sim.job.finished
    assert sim.job.status().phase == "Suspended"


def test_a_node_whose_agent_leaves_is_forgotten_at_once_while_suspended() -> None:
    sim, _ = suspended_job()
    sim.hb("a", state=pb.NODE_STATE_LEAVING)
    sim.at(sim.now + 0.1)
    assert list(sim.job.nodes) == ["b"]
    assert [e.message for e in sim.job.events.of_kind("node_left")] == ["its agent left"]


def test_a_failure_while_suspended_spends_no_budget() -> None:
    sim, r = suspended_job()
    answer = sim.fail("a", cls=pb.FAILURE_CLASS_HARDWARE, msg="Xid 79")
    assert answer.kind == pb.ACTION_KIND_REJOIN
    assert answer.round == r + 1
    assert sim.job.evictions == []
    assert sim.job.restart_count == 0
    assert not sim.job.finished
    assert "a" in sim.job.nodes


def test_a_probe_eviction_while_suspended_only_forgets_the_node() -> None:
    sim = Sim(
        rendezvous={"min_nodes": 1, "max_nodes": 2, "last_call_s": 1.0},
        heartbeat={"timeout_s": 30.0},
        restart={"max_evictions": 1},
        probes={"enabled": True, "timeout_s": 10.0},
    )
    sim.form("a", "b")
    probe = sim.job.start_probe(now=sim.now, trigger="test")
    t0 = sim.now
    sim.job.suspend(True, now=sim.now)
    for node in ("a", "b"):  # b runs its probes; a's Pod is being deleted and never reports
        sim.hb(node)
    for kind in (pb.PROBE_KIND_MATMUL, pb.PROBE_KIND_ALLGATHER):
        m = pb.ProbeMeasurement(peer_node_id="a" if kind == pb.PROBE_KIND_ALLGATHER else "", ok=True,
                                rate=10.0, elapsed_s=1.0)  # fmt: skip
        req = pb.ReportProbeRequest(node_id="b", incarnation=sim.inc["b"], probe=kind, measurements=[m],
                                    probe_round=probe.id)  # fmt: skip
        sim.job.report_probe(req, now=sim.now)
    sim.at(t0 + 10.0)
    sim.hb("b")
    sim.at(t0 + 10.1)
    assert probe.result != "running"
    assert "a" not in sim.job.nodes
    assert sim.job.evictions == []
    assert not sim.job.finished


def test_leaving_nodes_agree_on_one_step_to_persist() -> None:
    sim, r = suspended_job()
    assert sim.in_memory("a", round=r, held=[10, 11]).persist_step == -1  # b has not reported yet
    assert sim.in_memory("b", round=r, held=[9, 10]).persist_step == 10
    asked = [x for x in sim.hb("a") if x.kind == pb.ACTION_KIND_PERSIST_CHECKPOINT]
    assert [(x.step, x.round) for x in asked] == [(10, r)]


def test_a_node_that_left_is_not_waited_for_by_the_others_persisting() -> None:
    sim, r = suspended_job()
    assert sim.in_memory("a", round=r, held=[7, 8]).persist_step == -1
    sim.hb("a")
    sim.at(sim.now + 2.0)
    sim.hb("a")
    sim.at(sim.now + 2.6)  # b went away without reporting (SIGKILLed at the end of its grace period)
    assert "b" not in sim.job.nodes
    assert sim.job.breakpoint is not None
    assert sim.job.breakpoint.step == 8
    asked = [x for x in sim.hb("a") if x.kind == pb.ACTION_KIND_PERSIST_CHECKPOINT]
    assert asked == []  # a persists 8, its own newest, already


def test_no_round_completes_while_suspended_and_the_resumed_job_forms_one_with_the_new_nodes() -> None:
    sim, r = suspended_job()
    sim.disconnect("a")
    sim.disconnect("b")
    sim.at(sim.now + 1.5)
    assert sim.job.nodes == {}
    # The new Pods of the resumed job may start before the master sees the spec change.
    sim.register("a2")
    sim.register("b2")
    assert sim.join("a2") == sim.join("b2") == r + 1
    for _ in range(3):
        sim.at(sim.now + 2.0)
        sim.hb("a2")
        sim.hb("b2")
    assert sim.job.round_number == r, "a round completed while the job was suspended"
    sim.job.suspend(False, now=sim.now)
    assert [e.kind for e in sim.job.events.since(0)][-2:] == ["job_resumed", "round_open"]
    sim.hb("a2")
    sim.hb("b2")
    sim.at(sim.now + 0.1)
    assert sim.job.round_number == r + 1
    assert sim.job.members == ["a2", "b2"]
    status = sim.job.status()
    assert status.phase == "Running"
    assert status.suspended is False
    assert sim.job.evictions == []
    assert sim.job.restart_count == 0


def test_suspend_undone_before_any_node_left_restarts_nothing() -> None:
    sim, r = suspended_job()
    sim.job.suspend(False, now=sim.now)
    assert sim.job.round_number == r
    assert not sim.job.round_open
    assert sim.hb("a") == []
    assert sim.hb("b") == []


def test_min_nodes_timeout_starts_again_on_resume() -> None:
    sim, _ = suspended_job()
    sim.disconnect("a")
    sim.disconnect("b")
    sim.at(sim.now + 100.0)
    sim.job.suspend(False, now=sim.now)
    sim.at(sim.now + 29.0)
    assert not sim.job.finished
    sim.at(sim.now + 2.0)
    sim.at(sim.now + 0.1)
    assert sim.job.phase == "Failed"
    assert "required nodes" in sim.job.reason


def test_a_finished_job_ignores_suspend() -> None:
    sim = Sim(**TWO)
    sim.form("a", "b")
    sim.complete("a")
    sim.complete("b")
    assert sim.job.finished
    sim.job.suspend(True, now=sim.now)
    assert not sim.job.suspended
    assert sim.job.status().phase == "Succeeded"
