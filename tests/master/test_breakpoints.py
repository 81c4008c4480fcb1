"""Save at breakpoint across nodes: the pure agreement (:mod:`phalanx.master.state.breakpoints`) and the job's
side of it (who is answered, who is asked to persist the agreed step), with an injected clock."""

from __future__ import annotations

from phalanx.api.v1 import master_pb2 as pb
from phalanx.master.state.breakpoints import Breakpoint, agreed_step

from .sim import Sim, kinds

TWO = {"rendezvous": {"min_nodes": 1, "max_nodes": 2, "last_call_s": 1.0}, "heartbeat": {"timeout_s": 4.0}}
THREE = {"rendezvous": {"min_nodes": 1, "max_nodes": 3, "last_call_s": 1.0}, "heartbeat": {"timeout_s": 4.0}}


def test_agreed_step_is_the_newest_common_one_after_the_committed() -> None:
    assert agreed_step([frozenset({9, 10}), frozenset({10, 11})], committed=-1) == 10
    assert agreed_step([frozenset({10, 11}), frozenset({10, 11})], committed=-1) == 11
    assert agreed_step([frozenset({10, 11}), frozenset({10, 11})], committed=10) == 11
    assert agreed_step([frozenset({9, 10}), frozenset({10, 11})], committed=10) is None  # nothing newer
    assert agreed_step([frozenset({8, 9}), frozenset({10, 11})], committed=-1) is None  # nothing common
    assert agreed_step([frozenset({3})], committed=-1) == 3
    assert agreed_step([], committed=-1) is None


def test_settle_waits_for_every_reachable_member_and_asks_the_ones_ahead() -> None:
    bp = Breakpoint(round=4, members=frozenset({"a", "b", "c"}))
    bp.report("a", held=[10, 11], persisting=11)
    assert bp.settle(reachable=["a", "b", "c"], committed=-1) == []
    assert bp.step is None
    bp.report("b", held=[9, 10], persisting=10)
    # c is gone (lost, disconnected): it holds nothing anyone could persist, so it is not waited for.
    assert bp.settle(reachable=["a", "b"], committed=-1) == ["a"]
    assert bp.step == 10
    assert bp.persisting == {"a": 10, "b": 10}
    assert bp.settle(reachable=["a", "b"], committed=-1) == []  # asked once


def test_a_straddled_step_is_agreed_and_committed() -> None:
    sim = Sim(**TWO)
    r = sim.form("a", "b")
    sim.fail("a")  # a's rank saved step 11, then crashed; b's ranks were copying 11 when they stopped
    first = sim.in_memory("a", round=r, held=[10, 11])
    assert first.persist_step == -1  # b has not reported: a persists its own newest, 11
    last = sim.in_memory("b", round=r, held=[9, 10])
    assert last.persist_step == 10
    asked = [x for x in sim.hb("a") if x.kind == pb.ACTION_KIND_PERSIST_CHECKPOINT]
    assert [x.step for x in asked] == [10]
    assert "PERSIST_CHECKPOINT" not in kinds(sim.hb("b"))  # b learnt it from its answer
    assert [e.message for e in sim.job.events.of_kind("checkpoint_breakpoint")] == [
        "step 10: the newest every node of round 1 holds in memory"
    ]
    sim.persisted("a", step=11, ranks=[0, 1])
    sim.persisted("b", step=10, ranks=[2, 3])
    sim.persisted("a", step=10, ranks=[0, 1])
    assert sim.job.checkpoints.committed == 10


def test_nodes_that_agree_are_not_asked_again() -> None:
    sim = Sim(**TWO)
    r = sim.form("a", "b")
    sim.fail("a")
    assert sim.in_memory("a", round=r, held=[10, 11]).persist_step == -1
    assert sim.in_memory("b", round=r, held=[10, 11]).persist_step == 11
    assert "PERSIST_CHECKPOINT" not in kinds(sim.hb("a"))


def test_a_member_that_went_away_is_not_waited_for() -> None:
    sim = Sim(**THREE)
    r = sim.form("a", "b", "c")
    sim.fail("a")
    assert sim.in_memory("a", round=r, held=[10, 11]).persist_step == -1
    assert sim.in_memory("b", round=r, held=[9, 10]).persist_step == -1  # c still may report
    sim.disconnect("c")
    sim.at(sim.now + 1.5)  # c is absent after one heartbeat interval: settled without it
    assert [x.step for x in sim.hb("a") if x.kind == pb.ACTION_KIND_PERSIST_CHECKPOINT] == [10]


def test_reports_of_other_rounds_get_no_step() -> None:
    sim = Sim(**TWO)
    r = sim.form("a", "b")
    sim.fail("a")
    assert sim.in_memory("a", round=r + 5, held=[10, 11]).persist_step == -1  # not the running round
    assert sim.job.breakpoint is None
    assert sim.in_memory("a", round=r, held=[10, 11]).persist_step == -1
    assert sim.in_memory("b", round=0, held=[9, 10]).persist_step == -1  # round 0: not a breakpoint
    assert sim.in_memory("b", round=r, held=[9, 10]).persist_step == 10
    # Reporting again after the agreement gets the agreed step when the node holds it.
    assert sim.in_memory("b", round=r, held=[9, 10]).persist_step == 10
    assert sim.in_memory("b", round=r, held=[11]).persist_step == -1


def test_no_step_newer_than_the_committed_one_asks_nothing() -> None:
    sim = Sim(**TWO)
    r = sim.form("a", "b")
    sim.persisted("a", step=10, ranks=[0, 1])
    sim.persisted("b", step=10, ranks=[2, 3])
    sim.fail("a")
    assert sim.in_memory("a", round=r, held=[10, 11]).persist_step == -1
    assert sim.in_memory("b", round=r, held=[9, 10]).persist_step == -1
    assert "PERSIST_CHECKPOINT" not in kinds(sim.hb("a"))


def test_an_unsettled_breakpoint_is_dropped_when_the_next_round_forms() -> None:
    """b regrouped in place (it never reports): the next round forms without an agreement, and a later
    absence does not settle the old round's breakpoint with snapshots long overwritten."""
    sim = Sim(**THREE)
    r = sim.form("a", "b", "c")
    sim.fail("a")
    assert sim.in_memory("a", round=r, held=[10, 11]).persist_step == -1
    c = pb.ReportCheckpointRequest(
        node_id="c",
        incarnation=sim.inc["c"],
        step=10,
        state=pb.CHECKPOINT_STATE_IN_MEMORY,
        ranks=[4, 5],
        round=r,
        held_steps=[9, 10],
    )
    assert sim.job.report_checkpoint(c, now=sim.now).persist_step == -1  # b has not reported
    for node in ("a", "b", "c"):
        sim.join(node)
    sim.at(sim.now + 0.1)
    assert sim.job.round_number == r + 1
    assert sim.job.breakpoint is None
    sim.disconnect("b")
    sim.at(sim.now + 1.5)
    assert "PERSIST_CHECKPOINT" not in kinds(sim.hb("a"))
    assert not sim.job.events.of_kind("checkpoint_breakpoint")


def test_an_evicted_node_may_not_take_part_in_a_breakpoint() -> None:
    import pytest

    from phalanx.master.errors import RequestError

    sim = Sim(**TWO)
    r = sim.form("a", "b")
    sim.fail("a", cls=pb.FAILURE_CLASS_HARDWARE, msg="ECC error")  # evicted: its memory is suspect
    assert sim.job.nodes["a"].status == "evicted"
    with pytest.raises(RequestError) as refused:
        sim.in_memory("a", round=r, held=[10, 11])
    assert refused.value.code == "failed_precondition"
    assert "survivors" in str(refused.value)
