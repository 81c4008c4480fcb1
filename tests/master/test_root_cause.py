"""The master names the root cause, not its echo, when reports of one round come from several nodes in any
order: the restart, its event, ``root_cause`` and the job's reason. The job driven with an injected clock.
The restart is immediate; its event waits for the round's other reports (at most ``rootcause.SETTLE_S``)."""

from __future__ import annotations

from phalanx.api.v1 import master_pb2 as pb
from phalanx.diagnostics import rootcause

from .sim import Sim

TWO = {"rendezvous": {"min_nodes": 1, "max_nodes": 2, "last_call_s": 1.0}, "heartbeat": {"timeout_s": 4.0}}
GLOO = (
    "RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:561] Connection closed "
    "by peer [127.0.0.1]:39836. This is typically caused by a remote worker crashing."
)


def echo(sim: Sim, node: str, rank: int, *, at: float) -> pb.ReportFailureRequest:
    """A rank that lost its peer: a gloo error, dated by its error file (before the kill was noticed)."""
    return pb.ReportFailureRequest(
        node_id=node,
        incarnation=sim.inc[node],
        round=sim.job.round_number,
        kind=pb.FAILURE_KIND_WORKER_EXIT,
        failures=[
            pb.WorkerFailure(
                rank=rank,
                exit_code=1,
                failure_class=pb.FAILURE_CLASS_COMM,
                error_message=GLOO,
                error_unix_ns=int(at * 1e9),
                observed_unix_ns=int((at + 0.2) * 1e9),
            )
        ],
    )


def kill(sim: Sim, node: str, rank: int, *, at: float) -> pb.ReportFailureRequest:
    """A SIGKILLed rank: no error file, dated when its agent saw the exit."""
    return pb.ReportFailureRequest(
        node_id=node,
        incarnation=sim.inc[node],
        round=sim.job.round_number,
        kind=pb.FAILURE_KIND_WORKER_EXIT,
        failures=[
            pb.WorkerFailure(
                rank=rank, exit_code=-9, failure_class=pb.FAILURE_CLASS_KILLED, observed_unix_ns=int(at * 1e9)
            )
        ],
    )


def messages(sim: Sim, kind: str) -> list[str]:
    return [e.message for e in sim.job.events.of_kind(kind)]


def test_the_restart_event_names_the_kill_reported_after_its_echo_without_a_second_restart() -> None:
    sim = Sim(**TWO)
    sim.form("a", "b")  # a: ranks 0, 1; b: ranks 2, 3
    t = sim.now
    first = sim.job.report_failure(echo(sim, "a", 0, at=t - 0.5), now=t)
    assert first.kind == pb.ACTION_KIND_REJOIN, "the restart itself does not wait"
    assert sim.job.restart_count == 1
    assert sim.job.round_open
    assert messages(sim, "restart") == [], "its event waits for the round's other reports"

    sim.now = t + 0.3
    second = sim.job.report_failure(kill(sim, "b", 3, at=t), now=sim.now)
    assert second.kind == pb.ACTION_KIND_REJOIN
    assert sim.job.restart_count == 1, "a better cause revises the record; it does not restart again"
    root = sim.job.status().root_cause
    assert (root.node_id, root.rank, root.failure_class) == ("b", 3, "killed")
    assert root.explanation.startswith("rank 3 on b SIGKILLed at ")
    assert root.explanation.endswith("; rank 0 lost its peer after it")
    # Every member has reported: the event goes out now, naming the kill, dated when the restart was done.
    (restart,) = sim.job.events.of_kind("restart")
    assert (restart.node, restart.rank, restart.unix) == ("b", 3, t)
    assert restart.message == f"worker failure: {root.explanation}"
    assert sim.job.events.of_kind("root_cause") == [], "nothing to revise"
    kinds = [e.kind for e in sim.job.events.since(0, limit=1000)]
    assert kinds[-4:] == ["failure", "round_open", "failure", "restart"]


def test_after_the_window_the_restart_event_goes_out_and_a_later_kill_revises_it() -> None:
    sim = Sim(**TWO)
    sim.form("a", "b")
    t = sim.now
    sim.job.report_failure(echo(sim, "a", 0, at=t - 0.5), now=t)
    sim.job.tick(now=t + rootcause.SETTLE_S - 0.1)
    assert messages(sim, "restart") == []
    sim.job.tick(now=t + rootcause.SETTLE_S)
    (restart,) = messages(sim, "restart")
    assert restart.startswith("worker failure: rank 0 on a lost its peers first: RuntimeError")
    sim.job.report_failure(kill(sim, "b", 3, at=t), now=t + rootcause.SETTLE_S + 0.5)
    assert len(messages(sim, "restart")) == 1
    (revised,) = sim.job.events.of_kind("root_cause")
    assert (revised.node, revised.rank) == ("b", 3)
    assert revised.message == f"revised: {sim.job.status().root_cause.explanation}"


def test_a_new_round_completing_first_emits_the_waiting_restart_event_before_its_own() -> None:
    sim = Sim(**{**TWO, "rendezvous": {"min_nodes": 1, "max_nodes": 2, "last_call_s": 0.0}})
    sim.form("a", "b")
    t = sim.now
    sim.job.report_failure(echo(sim, "a", 0, at=t - 0.5), now=t)
    sim.now = t + 0.1
    sim.join("a", port=2100)
    sim.join("b", port=2200)
    sim.job.tick(now=sim.now)
    kinds = [e.kind for e in sim.job.events.since(0, limit=1000)]
    assert "round_complete" in kinds[kinds.index("failure") :], kinds
    assert kinds.index("restart") < len(kinds) - 1 - kinds[::-1].index("round_complete"), kinds


def test_the_kill_and_its_echo_in_one_report_name_the_kill() -> None:
    sim = Sim(**TWO)
    sim.form("a", "b")
    t = sim.now
    both = echo(sim, "b", 2, at=t - 0.4)  # the echo's error file is older than the kill's observation
    both.failures.extend(kill(sim, "b", 3, at=t).failures)
    sim.job.report_failure(both, now=t)
    (failure,) = messages(sim, "failure")
    assert failure.startswith("rank 3 on b (killed)")
    # The echo the other node sends next changes nothing.
    sim.job.report_failure(echo(sim, "a", 0, at=t - 0.6), now=t + 0.2)
    (restart,) = messages(sim, "restart")
    assert restart.startswith("worker failure: rank 3 on b SIGKILLed at ")
    assert restart.endswith("; ranks 0, 2 lost their peer after it"), "the event waited for a's echo too"
    assert sim.job.events.of_kind("root_cause") == []
    assert sim.job.status().root_cause.rank == 3


def test_a_job_failed_on_the_echo_names_the_kill_in_its_reason() -> None:
    sim = Sim(**TWO, restart={"max_restarts": 0})
    sim.form("a", "b")
    t = sim.now
    sim.job.report_failure(echo(sim, "a", 0, at=t - 0.5), now=t)
    assert sim.job.phase == "Failed"
    assert "root cause: rank 0 on a lost its peers first" in sim.job.status().reason
    exit_action = sim.job.report_failure(kill(sim, "b", 3, at=t), now=t + 0.3)
    assert exit_action.kind == pb.ACTION_KIND_EXIT
    reason = sim.job.status().reason
    assert reason.startswith("restart budget (0) spent; root cause: rank 3 on b SIGKILLed at "), reason
    assert reason.endswith("; rank 0 lost its peer after it")
    assert sim.job.status().root_cause.rank == 3
