"""The job state machine driven with an injected clock: membership, heartbeats, failures, completion,
resume from saved state. No sockets, no sleeps."""

from __future__ import annotations

import json

import pytest

from phalanx.api.v1 import master_pb2 as pb
from phalanx.master.job import Job

from .sim import Sim, kinds, settings

TWO = {"rendezvous": {"min_nodes": 1, "max_nodes": 2, "last_call_s": 1.0}, "heartbeat": {"timeout_s": 4.0}}


def test_two_nodes_form_a_round_with_stable_ranks_and_rank0_store() -> None:
    sim = Sim(**TWO)
    sim.register("a")
    sim.register("b")
    assert sim.join("b", port=3111) == 1
    assert sim.get("b", 1).status == pb.RENDEZVOUS_STATUS_WAITING
    sim.now += 0.1
    assert sim.join("a", port=3222) == 1  # max reached: completes at once
    resp = sim.get("a", 1)
    assert resp.status == pb.RENDEZVOUS_STATUS_COMPLETE
    assert [m.node_id for m in resp.members] == ["b", "a"]  # join order
    assert (resp.group_rank, resp.rank_offset, resp.world_size) == (1, 2, 4)
    assert (resp.store_host, resp.store_port) == ("host-b", 3111)
    assert sim.job.phase == "Running"
    assert sim.hb("a") == []


def test_last_call_completes_at_min_after_quiet_period() -> None:
    sim = Sim(rendezvous={"min_nodes": 1, "max_nodes": 3, "last_call_s": 2.0})
    sim.register("a")
    sim.join("a")
    sim.at(sim.now + 1.0)
    assert sim.job.round is None
    sim.at(sim.now + 1.1)
    assert sim.job.round is not None
    assert sim.job.members == ["a"]


def test_lost_node_is_evicted_and_survivors_rejoin_new_round() -> None:
    sim = Sim(**TWO)
    sim.form("a", "b")
    t0 = sim.now
    for dt in (1.0, 2.0, 3.0, 4.0, 5.0):
        sim.at(t0 + dt)
        sim.hb("a")  # b stays silent
    assert sim.job.nodes["b"].status == "lost"
    status = sim.job.status()
    assert status.phase == "Restarting"
    assert status.evictions[0].node_id == "b"
    assert "heartbeat" in status.evictions[0].reason
    actions = sim.hb("a")
    assert kinds(actions) == ["REJOIN"]
    assert actions[0].round == 2
    assert sim.job.events.of_kind("node_lost")[0].node == "b"
    sim.join("a")
    sim.at(sim.now + 1.5)
    assert sim.job.members == ["a"]
    assert sim.job.round_number == 2
    # a late heartbeat from the lost node tells it to leave a job that goes on (no round: the job did not end)
    (leave,) = sim.hb("b")
    assert (kinds([leave]), leave.round) == (["EXIT"], 0)


def test_worker_failure_restarts_in_place_with_same_membership() -> None:
    sim = Sim(**TWO)
    sim.form("a", "b")
    action = sim.fail("b", rank=3, msg="RuntimeError: nccl")
    assert (kinds([action]), action.round) == (["REJOIN"], 2)
    assert sim.job.restart_count == 1
    assert kinds(sim.hb("a")) == ["REJOIN"]
    assert sim.job.root_cause is not None
    assert sim.job.root_cause["rank"] == 3
    sim.join("b")
    sim.join("a")
    resp = sim.get("a", 2)
    assert resp.status == pb.RENDEZVOUS_STATUS_COMPLETE
    assert [m.node_id for m in resp.members] == ["a", "b"]  # survivors keep their order
    assert resp.restart_count == 1


def test_restart_budget_spent_fails_job_and_agents_exit() -> None:
    sim = Sim(restart={"max_restarts": 1}, **TWO)
    sim.form("a", "b")
    sim.fail("a")
    sim.join("a")
    sim.join("b")
    action = sim.fail("a", msg="oops")
    assert kinds([action]) == ["EXIT"]
    assert action.exit_code == 1
    assert action.round == sim.job.round_number > 0  # the job ended (agents save at breakpoint on the way)
    assert sim.job.phase == "Failed"
    assert "restart budget (1)" in sim.job.reason
    exit_b = sim.hb("b")
    assert kinds(exit_b) == ["EXIT"]
    assert exit_b[0].exit_code == 1
    assert exit_b[0].round == sim.job.round_number
    assert sim.get("b", 3).status == pb.RENDEZVOUS_STATUS_CLOSED


def test_user_error_on_all_nodes_fails_fast_without_spending_budget() -> None:
    sim = Sim(**TWO)
    sim.form("a", "b")
    sim.fail("a", rank=0, cls=pb.FAILURE_CLASS_USER, msg="NameError: name 'x' is not defined")
    assert sim.job.phase == "Restarting"
    sim.now += 0.5
    sim.fail("b", rank=2, cls=pb.FAILURE_CLASS_USER, msg="NameError: name 'x' is not defined")
    assert sim.job.phase == "Failed"
    assert "NameError" in sim.job.reason
    assert sim.job.restart_count == 1


def test_completion_of_every_member_succeeds_the_job() -> None:
    sim = Sim(**TWO)
    sim.form("a", "b")
    assert kinds([sim.complete("a")]) == ["NONE"]
    done = sim.complete("b")
    assert (kinds([done]), done.exit_code) == (["EXIT"], 0)
    assert sim.job.phase == "Succeeded"
    assert kinds(sim.hb("a")) == ["EXIT"]
    assert sim.hb("a")[0].exit_code == 0


def test_too_few_nodes_for_too_long_fails_the_job() -> None:
    sim = Sim(rendezvous={"min_nodes": 2, "max_nodes": 2, "min_nodes_timeout_s": 30.0})
    sim.register("a")
    t0 = sim.now
    for dt in range(1, 30):
        sim.hb("a")
        sim.at(t0 + dt)
    assert sim.job.phase == "Pending"
    sim.hb("a")
    sim.at(t0 + 31.0)
    assert sim.job.phase == "Failed"
    assert "only 1 of the 2 required nodes" in sim.job.reason


def test_new_incarnation_counts_as_failure_of_the_old() -> None:
    sim = Sim(**TWO)
    sim.form("a", "b")
    sim.register("b", inc="b-i2")
    assert sim.job.restart_count == 1
    assert sim.job.round_open
    assert kinds(sim.hb("a")) == ["REJOIN"]
    # the old incarnation is told to leave rather than refused as garbage
    old = pb.HeartbeatRequest(node_id="b", incarnation="b-i1")
    assert kinds(list(sim.job.heartbeat(old, now=sim.now).actions)) == ["EXIT"]


def test_resume_from_saved_state_keeps_round_and_grace() -> None:
    sim = Sim(**TWO)
    sim.form("a", "b")
    saved = json.loads(json.dumps(sim.job.durable()))
    t = sim.now + 100.0  # the master was down a long time
    resumed = Sim(Job(settings=settings(**TWO), now=t, saved=saved))
    resumed.now = t
    resumed.inc = dict(sim.inc)
    assert resumed.job.round_number == 1
    assert resumed.job.members == ["a", "b"]
    assert not resumed.job.round_open
    assert resumed.hb("a") == []  # accepted for the existing round, no new round
    resumed.at(t + 3.0)
    assert resumed.job.round_number == 1
    assert not resumed.job.round_open
    resumed.hb("a")
    resumed.at(t + 4.5)  # b never came back within one heartbeat timeout
    assert resumed.job.nodes["b"].status == "lost"
    assert resumed.job.round_open
    assert resumed.job.events.of_kind("master_resumed")


def test_one_shot_action_repeats_until_acknowledged() -> None:
    sim = Sim(restart={"max_restarts": 5}, **TWO)
    sim.form("a", "b")
    sim.fail("a", kind=pb.FAILURE_KIND_HANG, cls=pb.FAILURE_CLASS_HANG)
    # The answer carrying DUMP_STACKS is lost on the way (deadline passed, connection reset) ...
    assert sim.hb("b", lost=True) == []
    assert sim.hb("b", lost=True) == []
    # ... so the next answers carry it again, with the same seq, until a heartbeat acknowledges it.
    (dump,) = [a for a in sim.hb("b") if a.kind == pb.ACTION_KIND_DUMP_STACKS]
    assert dump.seq > 0
    assert sim.acked["b"] == dump.seq
    assert not any(a.kind == pb.ACTION_KIND_DUMP_STACKS for a in sim.hb("b"))
    assert sim.job.nodes["b"].pending == []  # the ack released it on the master too
    assert sim.job.stats.actions_repeated == 2  # phalanx_actions_repeated_total: two answers were lost


def test_action_seqs_keep_growing_across_a_master_restart() -> None:
    sim = Sim(restart={"max_restarts": 5}, **TWO)
    sim.form("a", "b")
    sim.fail("a", kind=pb.FAILURE_KIND_HANG, cls=pb.FAILURE_CLASS_HANG)
    (before,) = [a.seq for a in sim.hb("b") if a.kind == pb.ACTION_KIND_DUMP_STACKS]
    saved = json.loads(json.dumps(sim.job.durable()))
    assert saved["action_seq"] == before
    resumed = Job(settings=settings(restart={"max_restarts": 5}, **TWO), now=sim.now, saved=saved)
    node = resumed.nodes["b"]
    resumed.core.push(node, [pb.Action(kind=pb.ACTION_KIND_DUMP_STACKS, round=1)])
    # An agent that acknowledged `before` must not take the new action for a repeat of an old one.
    assert node.pending[0].seq > before


def test_checkpoint_commits_when_every_rank_persisted() -> None:
    sim = Sim(**TWO)
    sim.form("a", "b")

    def persist(node: str, ranks: list[int], step: int) -> int:
        return sim.persisted(node, step=step, ranks=ranks).committed_checkpoint_step

    assert persist("a", [0, 1], 10) == -1
    assert persist("b", [2, 3], 10) == 10
    assert persist("a", [0, 1], 20) == 10
    failed = pb.ReportCheckpointRequest(
        node_id="b", incarnation="b-i1", step=20, state=pb.CHECKPOINT_STATE_FAILED, error="disk full"
    )
    assert sim.job.report_checkpoint(failed, now=sim.now).committed_checkpoint_step == 10
    assert sim.job.phase == "Running"
    assert sim.job.durable()["committed_checkpoint_step"] == 10
    assert "disk full" in sim.job.events.of_kind("checkpoint_failed")[0].message


def test_hang_asks_for_stacks_and_evicts_the_odd_node_on_second_hang() -> None:
    sim = Sim(restart={"max_restarts": 5}, **TWO)
    sim.form("a", "b")
    action = sim.fail("a", kind=pb.FAILURE_KIND_HANG, cls=pb.FAILURE_CLASS_HANG)
    assert kinds([action]) == ["REJOIN"]
    assert kinds(sim.hb("b")) == ["DUMP_STACKS", "REJOIN"]
    waiting = 'Current thread 0x1:\n  File "c10d.py", line 1 in all_reduce\n'
    loader = 'Current thread 0x1:\n  File "loader.py", line 1 in next_batch\n'

    def stacks(node: str, per_rank: dict[int, str]) -> None:
        ranks = [pb.RankStacks(rank=r, stacks=s) for r, s in per_rank.items()]
        req = pb.ReportStacksRequest(node_id=node, incarnation=sim.inc[node], round=1, ranks=ranks)
        sim.job.report_stacks(req, now=sim.now)

    stacks("a", {0: waiting, 1: waiting})
    stacks("b", {2: waiting, 3: loader})
    analysis = sim.job.status().hang_analysis
    assert analysis.odd_nodes == ["b"]
    assert sim.job.hang_counts == {"b": 1}  # counted against the odd node, never against the reporter
    sim.join("a")
    sim.join("b")
    # b's agent sends its stacks before its report, as a real one does: its rank 3 is stopped, so the hang
    # counts against b at once, its second.
    ranks = [
        pb.RankStacks(rank=2, stacks=waiting, process_state="S"),
        pb.RankStacks(rank=3, process_state="T"),
    ]
    sim.job.report_stacks(
        pb.ReportStacksRequest(node_id="b", incarnation=sim.inc["b"], round=2, ranks=ranks), now=sim.now
    )
    evict = sim.fail("b", kind=pb.FAILURE_KIND_HANG, cls=pb.FAILURE_CLASS_HANG)
    assert (kinds([evict]), evict.round) == (["EXIT"], 0)
    assert sim.job.evictions[-1].node_id == "b"
    assert sim.job.evictions[-1].kind == "hang"


def test_stacks_sent_before_the_hang_report_count_in_the_analysis() -> None:
    """A real agent sends its stacks and then reports the hang, and when every rank blocks in one
    collective every node's detector fires at once: the stacks come before the analysis starts."""
    waiting = 'Current thread 0x1:\n  File "c10d.py", line 1 in all_reduce\n'
    stopped = "<no stack dump: the process did not answer SIGUSR1>"
    for others_first in (True, False):
        sim = Sim(
            restart={"max_restarts": 5}, rendezvous={"min_nodes": 1, "max_nodes": 3, "last_call_s": 1.0}
        )
        sim.form("a", "b", "c")

        def stacks(node: str, per_rank: dict[int, str], sim: Sim = sim) -> None:
            ranks = [pb.RankStacks(rank=r, stacks=text) for r, text in per_rank.items()]
            req = pb.ReportStacksRequest(node_id=node, incarnation=sim.inc[node], round=1, ranks=ranks)
            sim.job.report_stacks(req, now=sim.now)

        stacks("b", {2: stopped, 3: waiting})  # b's rank 2 was SIGSTOPped
        if others_first:
            stacks("a", {0: waiting, 1: waiting})
            stacks("c", {4: waiting, 5: waiting})
        sim.fail("b", kind=pb.FAILURE_KIND_HANG, cls=pb.FAILURE_CLASS_HANG)
        if others_first:  # everyone had sent theirs: the verdict is in, nobody is asked again
            assert kinds(sim.hb("a")) == ["REJOIN"]
        else:
            assert kinds(sim.hb("a")) == ["DUMP_STACKS", "REJOIN"]
            assert sim.job.status().hang_analysis is None
            stacks("a", {0: waiting, 1: waiting})
            stacks("c", {4: waiting, 5: waiting})
        analysis = sim.job.status().hang_analysis
        assert (analysis.odd_nodes, analysis.odd_ranks) == (["b"], [2]), analysis
        assert analysis.nodes_reported == ["a", "b", "c"]


def test_scale_up_and_unit_cut() -> None:
    sim = Sim(rendezvous={"min_nodes": 2, "max_nodes": 4, "unit": 2, "last_call_s": 1.0})
    sim.form("a", "b", "c")
    assert sim.job.members == ["a", "b"]
    assert sim.get("c", 1).status == pb.RENDEZVOUS_STATUS_NOT_MEMBER
    assert sim.join("c") == 2
    assert not sim.job.round_open  # 3 nodes still make a round of 2
    sim.register("d")
    sim.join("d")
    assert sim.job.round_open  # c and d make a round of 4: members are told to rejoin
    assert kinds(sim.hb("a")) == ["REJOIN"]
    sim.join("a")
    sim.join("b")
    assert sim.job.members == ["a", "b", "c", "d"]


def test_a_late_joiner_does_not_reopen_a_finishing_job() -> None:
    sim = Sim(rendezvous={"min_nodes": 1, "max_nodes": 3, "last_call_s": 1.0})
    sim.form("a", "b")
    assert kinds([sim.complete("a")]) == ["NONE"]  # a finished; b still runs
    sim.register("c")  # a replacement arrives after the training work of a is done
    sim.join("c")
    assert not sim.job.round_open  # no scale-up: it would retrain every worker
    assert kinds(sim.hb("b")) == []
    done = sim.complete("b")
    assert (kinds([done]), done.exit_code) == (["EXIT"], 0)
    assert sim.job.phase == "Succeeded"
    assert sim.get("c", sim.job.next_round).status == pb.RENDEZVOUS_STATUS_CLOSED


def _joined_as_training_ended(*, reports_steps: bool = True, newcomer_step: int | None = -1) -> Sim:
    """a and b train; c joins, and the round with it forms while a's and b's workers take their last
    step: they finish without ever forming it, and c's workers have not completed a step."""
    sim = Sim(rendezvous={"min_nodes": 1, "max_nodes": 3, "last_call_s": 1.0})
    sim.form("a", "b")
    sim.register("c")
    sim.join("c")
    assert sim.job.round_open  # scale up
    sim.join("a")
    sim.join("b")
    assert (sim.job.round_number, sim.job.members) == (2, ["a", "b", "c"])
    if newcomer_step is not None:
        sim.hb("c", step=newcomer_step)
    for n in "ab":
        sim.hb(n, step=500 if reports_steps else None)
    return sim


def test_a_newcomer_that_never_trained_does_not_hold_up_the_end_of_the_job() -> None:
    sim = _joined_as_training_ended()
    saved = json.loads(json.dumps(sim.job.durable()))
    assert [m["newcomer"] for m in saved["round"]["members"]] == [False, False, True]
    assert kinds([sim.complete("a")]) == ["NONE"]
    done = sim.complete("b")
    assert (kinds([done]), done.exit_code) == (["EXIT"], 0)
    assert sim.job.phase == "Succeeded"
    assert sim.job.reason == (
        "2 of 3 nodes completed round 2; c joined it as training ended and had nothing left to train"
    )
    leave = sim.hb("c", step=-1)
    assert (kinds(leave), leave[0].exit_code) == (["EXIT"], 0)
    # A restarted master knows who joined the round, too.
    resumed = Job(settings=settings(rendezvous={"min_nodes": 1, "max_nodes": 3}), now=sim.now, saved=saved)
    assert resumed.round is not None
    assert [m.newcomer for m in resumed.round.members] == [False, False, True]


def test_a_newcomer_whose_workers_report_after_the_others_completed_ends_the_job_then() -> None:
    sim = _joined_as_training_ended(newcomer_step=None)  # c's workers are not up yet
    sim.complete("a")
    assert kinds([sim.complete("b")]) == ["NONE"]
    assert sim.job.phase == "Running"
    leave = sim.hb("c", step=-1)
    assert (kinds(leave), leave[0].exit_code) == (["EXIT"], 0)
    assert sim.job.phase == "Succeeded"


def test_a_newcomer_that_trained_or_a_script_without_steps_is_waited_for() -> None:
    trained = _joined_as_training_ended(newcomer_step=471)
    silent = _joined_as_training_ended(reports_steps=False)  # steps tell nothing: c may have work left
    for sim in (trained, silent):
        sim.complete("a")
        assert kinds([sim.complete("b")]) == ["NONE"]
        assert sim.job.phase == "Running"
        done = sim.complete("c")
        assert (kinds([done]), done.exit_code) == (["EXIT"], 0)
        assert sim.job.reason == "all 3 nodes completed round 2"


def test_hardware_failure_evicts_and_replaces_the_node() -> None:
    sim = Sim(restart={"max_evictions": 1}, **TWO)
    sim.form("a", "b")
    action = sim.fail("b", rank=2, cls=pb.FAILURE_CLASS_HARDWARE, msg="Xid 79: GPU has fallen off the bus")
    assert (kinds([action]), action.exit_code) == (["EXIT"], 1)
    assert "evicted" in action.reason
    ev = sim.job.status().evictions
    assert [(e.node_id, e.kind) for e in ev] == [("b", "hardware")]
    assert "Xid 79" in ev[0].reason
    assert sim.job.restart_count == 0  # an eviction spends the eviction budget, not the restart budget
    assert kinds(sim.hb("a")) == ["REJOIN"]
    # the replacement registers under a new incarnation and joins the new round
    sim.register("b", inc="b-i2")
    sim.join("a")
    sim.join("b")
    assert sim.job.members == ["a", "b"]
    assert sim.job.round_number == 2
    # a second hardware failure finds the eviction budget spent: the job fails
    sim.fail("a", cls=pb.FAILURE_CLASS_HARDWARE, msg="ECC error")
    assert sim.job.phase == "Failed"
    assert "eviction budget (1)" in sim.job.reason


# Held heartbeats: a closed connection leaves the node out long before the heartbeat timeout.
DISCONNECT = {
    "rendezvous": {"min_nodes": 1, "max_nodes": 3, "last_call_s": 0.5},
    "heartbeat": {"interval_s": 1.0, "timeout_s": 10.0},
}


def test_a_member_whose_connection_closed_is_left_out_after_one_interval_not_the_timeout() -> None:
    sim = Sim(**DISCONNECT)
    sim.form("a", "b", "c")
    assert sim.job.round_number == 1
    sim.hb("a"), sim.hb("b"), sim.hb("c")
    version = sim.job.action_version
    sim.now += 0.3  # into c's held heartbeat
    sim.disconnect("c")
    closed = sim.now
    sim.at(sim.now + 0.9)  # within the grace (one interval): nothing yet
    assert not sim.job.round_open
    assert sim.job.events.of_kind("node_disconnected") == []
    sim.at(sim.now + 0.2)
    assert sim.job.round_open
    assert sim.job.action_version > version  # wakes the held heartbeats of a and b
    assert [e.node for e in sim.job.events.of_kind("node_disconnected")] == ["c"]
    assert sim.job.nodes["c"].status == "alive"  # not lost yet: a live agent reconnects within an interval
    assert sim.job.evictions == []
    assert kinds(sim.hb("a")) == ["REJOIN"]
    # the survivors' round completes without waiting for c
    sim.join("a"), sim.join("b")
    sim.at(sim.now + 0.6)
    assert (sim.job.round_number, sim.job.members) == (2, ["a", "b"])
    # one disconnection opens one round
    sim.at(sim.now + 1.0)
    assert not sim.job.round_open
    assert sim.job.nodes["c"].status == "alive"
    # still silent three intervals after its connection closed, while a and b are heard: lost, long before
    # the heartbeat timeout, without another round (it is no member)
    sim.hb("a"), sim.hb("b")
    sim.at(closed + 3.1)
    assert sim.job.nodes["c"].status == "lost"
    assert [(e.node_id, e.kind) for e in sim.job.evictions] == [("c", "connection_closed")]
    assert [e.message for e in sim.job.events.of_kind("node_lost")] == ["connection closed, silent for 3s"]
    assert not sim.job.round_open
    assert sim.job.round_number == 2


def test_a_member_whose_connection_closed_and_stays_silent_is_lost_before_its_survivors_rejoined() -> None:
    """The connection closes and the node stays silent past three intervals before the survivors' round
    formed (they were slow to rejoin): it is lost then, and its replacement may start at once."""
    sim = Sim(**DISCONNECT)
    sim.form("a", "b")
    sim.now += 0.3
    sim.disconnect("b")
    closed = sim.now
    for t in (1.0, 2.0, 3.0):
        sim.hb("a")
        sim.at(closed + t)
    assert sim.job.nodes["b"].status == "alive"
    sim.hb("a")
    sim.at(closed + 3.2)
    assert sim.job.nodes["b"].status == "lost"
    assert [(e.node_id, e.kind) for e in sim.job.evictions] == [("b", "connection_closed")]
    assert "b's connection closed, silent for 3s" in sim.job.evictions[0].reason


def test_a_closed_connection_is_left_to_the_heartbeat_timeout_when_no_other_node_is_heard() -> None:
    """Every connection closing at once, and nobody heard since, may be the master's own network: the
    heartbeat timeout decides, as for silence."""
    sim = Sim(**DISCONNECT)
    sim.form("a", "b")
    sim.hb("a"), sim.hb("b")
    sim.now += 0.3
    sim.disconnect("a"), sim.disconnect("b")
    closed = sim.now
    sim.at(closed + 5.0)
    assert [n.status for n in sim.job.nodes.values()] == ["alive", "alive"]
    assert sim.job.evictions == []
    sim.at(closed + 10.5)
    assert {e.kind for e in sim.job.evictions} == {"heartbeat_timeout"}


def test_a_restarted_master_does_not_hold_a_round_for_a_node_left_out_before_it_restarted() -> None:
    """c's connection closed and round 2 formed without it; then the master restarts. Before the fix, a
    worker failure's round waited for c until the straggler wait (the heartbeat timeout)."""
    sim = Sim(**DISCONNECT)
    sim.form("a", "b", "c")
    sim.disconnect("c")
    sim.at(sim.now + 1.1)
    sim.join("a"), sim.join("b")
    sim.at(sim.now + 0.6)
    assert sim.job.members == ["a", "b"]
    restarted = Sim(
        Job(settings=settings(**DISCONNECT), now=sim.now, saved=json.loads(json.dumps(sim.job.durable())))
    )
    restarted.now, restarted.inc, restarted.acked = sim.now, sim.inc, sim.acked
    restarted.hb("a"), restarted.hb("b")  # the members reach the new master within an interval
    restarted.at(restarted.now + 1.0)
    restarted.hb("a"), restarted.hb("b")
    restarted.at(restarted.now + 1.0)
    restarted.hb("a"), restarted.hb("b")
    # Within three intervals of the restart a silent node is still waited for: it may be on its way.
    restarted.fail("a")
    restarted.join("a"), restarted.join("b")
    restarted.at(restarted.now + 0.6)
    assert restarted.job.round_open
    # Past them, c is not.
    restarted.hb("a"), restarted.hb("b")
    restarted.at(restarted.now + 0.5)
    assert not restarted.job.round_open
    assert (restarted.job.round_number, restarted.job.members) == (3, ["a", "b"])
    # c comes back after all: it joins the next round, as a node back from a disconnection does.
    assert restarted.job.nodes["c"].status == "alive"
    restarted.hb("c")
    assert restarted.join("c") == 4


def test_a_member_that_died_while_the_master_was_down_holds_a_round_only_for_the_restore_grace() -> None:
    """b is SIGKILLed while the master is down; the restarted master never hears from it. Its absence opens
    no round (only the heartbeat timeout says a member is gone), but the round a's failure opens completes
    without it three intervals after the restart, not at the heartbeat timeout."""
    sim = Sim(**DISCONNECT)
    sim.form("a", "b")
    restarted = Sim(
        Job(settings=settings(**DISCONNECT), now=sim.now, saved=json.loads(json.dumps(sim.job.durable())))
    )
    restarted.now, restarted.inc, restarted.acked = sim.now, sim.inc, sim.acked
    for _ in range(4):
        restarted.hb("a")
        restarted.at(restarted.now + 1.0)
    assert not restarted.job.round_open  # b's silence alone is left to the heartbeat timeout
    assert restarted.job.nodes["b"].status == "alive"
    restarted.fail("a")  # a's workers lost their peers on b
    restarted.join("a")
    restarted.at(restarted.now + 0.6)
    assert (restarted.job.round_number, restarted.job.members) == (2, ["a"])


def test_a_node_heard_from_within_the_grace_is_not_left_out() -> None:
    sim = Sim(**DISCONNECT)
    sim.form("a", "b")
    sim.now += 0.3
    sim.disconnect("b")
    sim.at(sim.now + 0.5)
    sim.hb("b")  # its agent reconnected: a broken connection, not a dead agent
    sim.at(sim.now + 2.0)
    assert not sim.job.round_open
    assert sim.job.events.of_kind("node_disconnected") == []


def test_a_member_whose_agent_says_it_is_leaving_is_left_out_at_once() -> None:
    sim = Sim(**DISCONNECT)
    sim.form("a", "b", "c")
    sim.hb("a"), sim.hb("b")
    sim.hb("c", state=pb.NODE_STATE_LEAVING)  # its Pod was deleted: SIGTERM, checkpoint persisted, exiting
    sim.at(sim.now + 0.1)  # no grace: it said so
    assert sim.job.round_open
    assert [e.message for e in sim.job.events.of_kind("node_disconnected")] == ["its agent is leaving"]
    assert sim.job.nodes["c"].status == "alive"
    assert sim.job.evictions == []
    sim.at(sim.now + 1.0)
    assert len(sim.job.events.of_kind("node_disconnected")) == 1  # handled once


def test_a_leaving_agent_that_heartbeats_again_is_no_longer_absent() -> None:
    sim = Sim(**DISCONNECT)
    sim.form("a", "b")
    sim.hb("b", state=pb.NODE_STATE_LEAVING)
    sim.hb("b")
    sim.at(sim.now + 2.0)
    assert not sim.job.round_open


def test_a_disconnected_joiner_is_dropped_from_the_open_round() -> None:
    sim = Sim(rendezvous={"min_nodes": 1, "max_nodes": 3, "last_call_s": 5.0})
    sim.register("a"), sim.register("b")
    sim.join("a"), sim.join("b")
    sim.now += 0.3
    sim.disconnect("b")
    sim.at(sim.now + 1.5)
    assert set(sim.job.joiners) == {"a"}
    sim.at(sim.now + 5.0)
    assert sim.job.members == ["a"]


def test_a_disconnection_of_a_replaced_incarnation_or_after_the_end_changes_nothing() -> None:
    sim = Sim(**DISCONNECT)
    sim.form("a", "b")
    old = sim.inc["b"]
    sim.register("b", inc="b-i2")  # the agent restarted
    req = pb.HeartbeatRequest(node_id="b", incarnation=old, wait_s=1.0)
    sim.job.disconnected(req, now=sim.now)  # the old process's connection closing
    assert sim.job.nodes["b"].disconnected_at == 0.0


def test_held_heartbeat_answer_carries_new_actions_and_refreshes_liveness() -> None:
    sim = Sim(**DISCONNECT)
    sim.form("a", "b")
    req = pb.HeartbeatRequest(
        node_id="a", incarnation=sim.inc["a"], state=pb.NODE_STATE_RUNNING, round=1, wait_s=1.0
    )
    assert list(sim.job.heartbeat(req, now=sim.now).actions) == []
    sim.now += 0.8
    sim.fail("b", rank=2, msg="RuntimeError: boom")  # opens round 2
    answer = sim.job.heartbeat_answer(req, now=sim.now)
    assert kinds(list(answer.actions)) == ["REJOIN"]
    assert sim.job.nodes["a"].last_seen == sim.now


def test_registrations_beyond_the_cap_are_refused_and_silent_nodes_do_not_accumulate() -> None:
    """Anyone with the job token can call RegisterNode: a script registering node after node must neither grow
    the master without bound nor push out the job's own nodes."""
    from phalanx.master.errors import RequestError
    from phalanx.master.state.nodes import KEPT_LOST_RECORDS, registration_cap

    sim = Sim(restart={"max_evictions": 1000}, **TWO)
    cap = registration_cap(2)
    for i in range(cap):
        sim.register(f"n{i}")
    with pytest.raises(RequestError, match=rf"the most it accepts \({cap}") as refused:
        sim.register("one-too-many")
    assert refused.value.code == "failed_precondition"
    sim.register("n0", inc="n0-i2")  # a known node's new incarnation is no new record: accepted
    # Every node goes silent and is lost; registrations go on, and the lost records stay bounded.
    t = sim.now
    for wave in range(KEPT_LOST_RECORDS // cap + 2):  # more lost nodes than are kept
        t += 10.0
        sim.at(t)
        assert not sim.job.finished
        for i in range(cap):
            sim.now = t
            sim.register(f"w{wave}-{i}")
    lost = [n for n in sim.job.nodes.values() if n.status == "lost"]
    assert len(lost) == KEPT_LOST_RECORDS
    assert len(sim.job.nodes) <= KEPT_LOST_RECORDS + cap + len(sim.job.members)
