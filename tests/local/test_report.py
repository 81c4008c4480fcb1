"""Which injected fault an event of the job is put down to (pure)."""

from __future__ import annotations

from phalanx.local.report import FailureRecord, cause_of, recovery_action


def fault(kind: str, node: str, at: float, *, healed_at: float | None = None) -> FailureRecord:
    return FailureRecord(kind=kind, node=node, rank=-1, injected_at=at, healed_at=healed_at)


def test_an_event_is_put_down_to_the_latest_fault_on_its_node_still_felt() -> None:
    hang, kill = fault("hang-worker", "node-1", 10.0), fault("kill-worker", "node-1", 20.0)
    other = fault("kill-worker", "node-2", 21.0)
    # The kill is noticed at once, the hang 60 s later: each event goes to the fault that caused it.
    assert cause_of([hang, kill, other], node="node-1", at=20.3) is kill
    kill.detected_at = 20.3
    assert cause_of([hang, kill, other], node="node-1", at=70.0) is hang
    assert cause_of([hang, kill, other], node="node-3", at=70.0) is None


def test_a_fault_healed_before_the_event_or_a_master_kill_is_not_its_cause() -> None:
    cut = fault("partition-node", "node-1", 17.6, healed_at=25.7)  # shorter than the heartbeat timeout
    master = fault("kill-master", "master", 30.0)
    assert cause_of([cut, master], node="node-1", at=26.2) is cut  # the news may arrive as it heals
    assert cause_of([cut, master], node="node-1", at=35.5) is None  # a later worker failure is not its doing
    assert cause_of([master], node="", at=31.0) is None


def test_recovery_is_named_from_whether_the_spared_workers_kept_their_processes() -> None:
    spared = {"node-0/0": 101, "node-0/1": 102}
    kept = {**spared, "node-3/0": 301}
    assert recovery_action(survivors=spared, running=kept, world=4, round_=2) == (
        "re-formed in process at world 4 (round 2)"
    )
    moved = {"node-0/0": 101, "node-0/1": 202}  # one survivor is a new process: the workers restarted
    moved_to = recovery_action(survivors=spared, running=moved, world=4, round_=3)
    assert moved_to == "workers restarted (round 3)"
    assert recovery_action(survivors={}, running=kept, world=2, round_=2) == "workers restarted (round 2)"
