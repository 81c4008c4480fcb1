"""The decisions of ``phalanx local`` and its recovery accounting (pure: no process, no clock)."""

from __future__ import annotations

from phalanx.api.views import EvictionView
from phalanx.local import accounting, decide
from phalanx.local.decide import RunEnd, RunState, Steps
from phalanx.local.inject import Injection
from phalanx.local.report import FailureRecord
from phalanx.local.watch import SeenEvent
from tests.jobviews import job_view

# Two nodes of two ranks: (node, local rank) -> (step, unix_ns, pid).
STEPS: Steps = {
    ("node-0", 0): (7, 1_000, 100),
    ("node-0", 1): (6, 1_000, 101),
    ("node-1", 0): (7, 2_000, 200),
    ("node-1", 1): (-1, 0, 0),  # started, no step yet
}


def test_the_job_step_is_the_slowest_stepped_rank_and_the_fallback_before_any() -> None:
    assert decide.job_step(STEPS, fallback=-1) == 6
    assert decide.job_step({("node-0", 0): (-1, 0, 0)}, fallback=3) == 3
    assert decide.job_step({}, fallback=-1) == -1


def test_a_fault_fires_at_its_ranks_step_on_a_live_node_with_a_worker_to_hit() -> None:
    def fires(inj: Injection, *, max_step: int = 7, elapsed_s: float = 0.0, alive: bool = True) -> bool:
        return decide.should_inject(
            inj, steps=STEPS, max_step=max_step, elapsed_s=elapsed_s, node_alive=alive
        )

    assert fires(Injection(kind="kill-worker", step=6, node=0, rank=1))
    assert not fires(Injection(kind="kill-worker", step=7, node=0, rank=1))  # that rank is at step 6
    assert not fires(Injection(kind="kill-worker", step=6, node=0, rank=1), alive=False)
    # The rank has no beacon pid yet: a worker fault has nothing to hit, a node fault does.
    assert not fires(Injection(kind="hang-worker", step=-1, node=1, rank=1))
    assert fires(Injection(kind="kill-node", step=-1, node=1, rank=1))
    # A master kill goes by the highest step and needs no live node.
    assert fires(Injection(kind="kill-master", step=9), max_step=9, alive=False)
    assert not fires(Injection(kind="kill-master", step=9), max_step=8)
    assert not fires(Injection(kind="kill-node", after_s=5.0, node=0), elapsed_s=4.9)
    assert fires(Injection(kind="kill-node", after_s=5.0, node=0), elapsed_s=5.0)


def test_a_fired_fault_records_where_it_hit_and_the_workers_it_spared() -> None:
    worker = decide.failure_record(
        Injection(kind="kill-worker", node=0, rank=1), steps=STEPS, max_step=7, round_=2, injected_at=3.5
    )
    assert (worker.node, worker.rank, worker.step_at_injection, worker.round_at_injection) == (
        "node-0",
        1,
        6,
        2,
    )
    assert worker.survivors == {"node-0/0": 100, "node-1/0": 200, "node-1/1": 0}
    node = decide.failure_record(
        Injection(kind="kill-node", node=0), steps=STEPS, max_step=7, round_=2, injected_at=1
    )
    assert node.rank == -1
    assert node.survivors == {"node-1/0": 200, "node-1/1": 0}
    master = decide.failure_record(
        Injection(kind="kill-master"), steps={}, max_step=4, round_=1, injected_at=1
    )
    assert (master.node, master.step_at_injection) == ("master", 4)


def record(kind: str, **kw: object) -> FailureRecord:
    return FailureRecord(kind=kind, node="node-0", rank=-1, injected_at=2.0, **kw)  # type: ignore[arg-type]


def test_recovery_counts_from_the_new_round_seen_running_or_from_a_master_kill() -> None:
    def since(f: FailureRecord, *, round_now: int = 3, phase: str = "Running") -> int | None:
        return decide.recovery_since_ns(
            f, round_now=round_now, phase=phase, t0_unix_ns=10**9, now_ns=5 * 10**9
        )

    kill = record("kill-node", round_at_injection=2)
    assert since(kill, round_now=2) is None  # no new round yet
    assert since(kill, phase="Rendezvous") is None
    assert since(kill) == 5 * 10**9  # first seen now
    kill.recovery_round_seen_ns = 4 * 10**9
    assert since(kill) == 4 * 10**9  # and kept from then on
    kill.recovered_at = 9.0
    assert since(kill) is None
    master = record("kill-master")
    assert since(master) is None  # the master does not answer yet
    master.detected_at = 2.5
    assert since(master, round_now=0, phase=None) == 10**9 + 2 * 10**9  # from the kill, whatever the round
    # A slow node the job never noticed has nothing to recover from.
    assert since(record("slow-cpu", round_at_injection=0)) is None
    assert since(record("slow-cpu", round_at_injection=0, detected_at=3.0)) == 5 * 10**9


def test_the_resumed_step_is_the_first_one_completed_after_the_recovery_began() -> None:
    assert decide.resumed_step(STEPS, since_ns=1_000) == 7  # only node-1's rank 0 stepped since
    assert decide.resumed_step(STEPS, since_ns=2_000) is None
    assert decide.steps_lost(step_at_injection=9, resumed=7) == 3
    assert decide.steps_lost(step_at_injection=6, resumed=7) == 0


def test_each_eviction_is_carried_out_once() -> None:
    evictions = [
        EvictionView(node_id=node, machine="", reason=reason, kind="hang", requested_at=0.0)
        for node, reason in (("node-1", "lost"), ("", ""), ("node-2", ""), ("node-1", ""))
    ]
    assert decide.new_evictions(evictions, handled=set()) == [evictions[0], evictions[2]]
    assert decide.new_evictions(evictions, handled={"node-1"}) == [evictions[2]]
    assert decide.eviction_action("node-1", "lost") == "evicted node-1 (lost)"
    assert decide.eviction_action("node-1", None) == "evicted node-1"


def test_timed_items_come_due_and_a_slow_nodes_heal_is_moot_once_it_is_gone() -> None:
    assert decide.split_due([(1.0, "a"), (3.0, "b"), (2.0, "c")], now=2.0) == [(1.0, "a"), (2.0, "c")]
    net, cpu = Injection(kind="slow-network", node=1), Injection(kind="slow-cpu", node=1)
    assert not decide.heal_is_moot(net, nets={"node-1"}, cpu_groups=set())
    assert decide.heal_is_moot(net, nets=set(), cpu_groups={"node-1"})
    assert decide.heal_is_moot(cpu, nets={"node-1"}, cpu_groups=set())
    assert not decide.heal_is_moot(Injection(kind="partition-node", node=1), nets=set(), cpu_groups=set())


def test_the_status_line_shows_changes_at_most_once_a_second() -> None:
    job = job_view(phase="Running", round=2, world_size=4)
    line = decide.status_line(max_step=12, job=job, alive=["node-0", "node-1"])
    assert line == "step    12 | Running    | round 2 | world 4 | nodes node-0 node-1"
    assert (
        decide.status_line(max_step=-1, job=None, alive=[])
        == "step    -1 | ?          | round ? | world ? | nodes "
    )
    assert decide.status_due(line, last="", last_at=0.0, now=1.0)
    assert not decide.status_due(line, last="", last_at=0.5, now=1.4)
    assert not decide.status_due(line, last=line, last_at=0.0, now=9.0)


def test_the_run_ends_when_the_job_finished_and_its_nodes_exited_or_had_their_grace() -> None:
    def end(state: RunState, **kw: object) -> tuple[RunState, RunEnd | None]:
        args: dict[str, object] = {
            "phase": "Running",
            "reason": "",
            "any_alive": True,
            "work_left": False,
            "now": 10.0,
            "timeout_s": 100.0,
        }
        return decide.run_end(state, **{**args, **kw})  # type: ignore[arg-type]

    assert end(RunState()) == (RunState(), None)
    state, done = end(RunState(), phase="Succeeded")
    assert (state, done) == (RunState(end_seen_at=10.0), None)  # the nodes get their grace
    assert end(state, phase="Succeeded", now=25.1)[1] == RunEnd(code=0, exit="succeeded")
    failed = end(RunState(), phase="Failed", reason="budget spent", any_alive=False)[1]
    assert failed == RunEnd(code=1, exit="failed", reason="budget spent")


def test_the_run_gives_up_when_nothing_runs_for_long_or_its_time_is_up() -> None:
    def end(state: RunState, **kw: object) -> tuple[RunState, RunEnd | None]:
        args: dict[str, object] = {
            "phase": "Running",
            "reason": "",
            "any_alive": False,
            "work_left": False,
            "now": 10.0,
            "timeout_s": 100.0,
        }
        return decide.run_end(state, **{**args, **kw})  # type: ignore[arg-type]

    state, done = end(RunState())
    assert (state, done) == (RunState(idle_since=10.0), None)
    assert end(state, now=20.0)[1] is None
    gave_up = end(state, now=20.1)[1]
    assert gave_up is not None
    assert (gave_up.code, gave_up.exit) == (1, "")
    assert gave_up.reason == "every node exited but the master did not report the job as finished"
    assert end(state, now=30.0, work_left=True) == (RunState(), None)  # a replacement is due: not idle
    assert end(RunState(), any_alive=True, now=100.5)[1] == RunEnd(code=1, reason="timed out after 100s")


def test_recovery_accounting_names_the_resumed_step_and_how_the_job_recovered() -> None:
    kill = record("kill-worker", round_at_injection=1, step_at_injection=6, detected_at=2.2)
    kill.survivors = {"node-0/0": 100, "node-1/0": 200}
    job = job_view(round=2, phase="Running", world_size=4)

    def track(steps: Steps, *, at: float, running: set[int]) -> list[str]:
        return accounting.track_recovery(
            [kill], job=job, steps=steps, t0_unix_ns=0, now_ns=1_500, at=at, is_running=running.__contains__
        )

    assert track({("node-0", 0): (6, 1_000, 100)}, at=3.0, running={100, 200}) == []  # nothing fresh yet
    assert kill.recovery_round_seen_ns == 1_500
    lines = track(
        {("node-0", 0): (5, 1_600, 100), ("node-1", 0): (6, 1_700, 200)}, at=4.0, running={100, 200}
    )
    assert lines == [
        "recovered from kill-worker on node-0: step 5 completed 2.00s after the fault, 2 steps lost"
    ]
    assert (kill.resumed_step, kill.recovered_at, kill.steps_lost) == (5, 4.0, 2)
    assert kill.recovery == "re-formed in process at world 4 (round 2)"
    assert track({("node-0", 0): (9, 9_000, 100)}, at=5.0, running={100}) == []  # recovered once


def test_events_and_evictions_are_written_into_the_fault_they_are_put_down_to() -> None:
    cut = record("partition-node")
    master = record("kill-master")
    accounting.on_event([cut, master], _seen("eviction_requested", node="node-0", at=4.0))
    assert (cut.detected_at, cut.action) == (4.0, "evicted node-0")
    accounting.master_answers([cut, master], at=5.0)
    assert master.detected_at == 5.0
    accounting.evicted([cut], node="node-0", reason="lost")
    assert cut.action == "evicted node-0"  # said once
    evictions: list[dict[str, object]] = [{"node_id": "node-0"}]
    job = job_view(round=3, members=["node-1"], world_size=2)
    accounting.replaced([cut], evictions, lost="node-0", new="node-2", job=job)
    assert evictions == [{"node_id": "node-0", "replacement": "node-2"}]
    assert cut.action == "evicted node-0, replaced by node-2"
    assert cut.fold_in is not None
    assert cut.fold_in.node == "node-2"
    line = accounting.event_line(_seen("node_lost", node="node-0", message="silent 10s"))
    assert line == "event node_lost          node-0   silent 10s"


def _seen(kind: str, *, node: str, at: float = 0.0, message: str = "") -> SeenEvent:
    return SeenEvent(seq=1, unix=0.0, kind=kind, node=node, rank=-1, round=1, message=message, at=at)
