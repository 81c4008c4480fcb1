"""A beacon-only hang of a 2-node job (no interval recorder): the node that reports first may be the victim,
so the hang counts against the node the evidence singles out (a stopped rank), or against none. The job is
driven through its real request handlers, as agents drive it (stacks first, then the failure report)."""

from __future__ import annotations

from phalanx.api import limits
from phalanx.api.v1 import master_pb2 as pb

from .sim import Sim, kinds

TWO = {"rendezvous": {"min_nodes": 1, "max_nodes": 2, "last_call_s": 1.0}, "heartbeat": {"timeout_s": 4.0}}
WAITING = 'Current thread 0x1 (most recent call first):\n  File "/t/c10d.py", line 9 in all_reduce\n'
STOPPED = "<process 42 is stopped (SIGSTOP); no stack dump possible>"
RANK = {"a": 0, "b": 1}


def two_nodes() -> Sim:
    sim = Sim(restart={"max_restarts": 10}, **TWO)
    for node in ("a", "b"):
        sim.register(node, nproc=1)
    rejoin(sim)
    return sim


def rejoin(sim: Sim) -> None:
    for i, node in enumerate(("a", "b")):
        sim.join(node, port=2000 + i, nproc=1)
    sim.at(sim.now + 1.5)
    assert sim.job.members == ["a", "b"]
    assert not sim.job.round_open


def stacks(sim: Sim, node: str, *, round: int, stopped: bool) -> None:
    """What ``node``'s agent sends for its one rank: a stopped process, or one waiting in a collective."""
    rank = pb.RankStacks(
        rank=RANK[node], stacks=STOPPED if stopped else WAITING, process_state="T" if stopped else "S"
    )
    req = pb.ReportStacksRequest(node_id=node, incarnation=sim.inc[node], round=round, ranks=[rank])
    sim.job.report_stacks(req, now=sim.now)


def beacon_hang(sim: Sim, reporter: str, *, stopped: str) -> pb.Action:
    """``reporter``'s agent finds its rank's beacon stale: it sends its stacks, then reports the hang; the
    other node sends its stacks when asked. ``stopped``: the node whose rank is SIGSTOPped ("": none)."""
    round_no = sim.job.round_number
    stacks(sim, reporter, round=round_no, stopped=stopped == reporter)
    act = sim.fail(reporter, rank=RANK[reporter], kind=pb.FAILURE_KIND_HANG, cls=pb.FAILURE_CLASS_HANG)
    other = "b" if reporter == "a" else "a"
    if sim.job.hang is not None:
        assert kinds(sim.hb(other))[0] == "DUMP_STACKS"
        stacks(sim, other, round=round_no, stopped=stopped == other)
    return act


def test_the_victim_reporting_first_is_never_charged_and_the_stopped_node_is_evicted_at_its_second() -> None:
    sim = two_nodes()
    for n in (1, 2):
        act = beacon_hang(sim, "a", stopped="b")  # b's rank is stopped; a, its victim, reports first
        restart = sim.job.events.of_kind("restart")[-1].message
        assert "counted against no node for now" in restart, restart
        analysis = sim.job.status().hang_analysis
        assert (analysis.hung_node, analysis.blamed) == ("a", "b"), analysis
        assert "rank(s) 1 on b stopped" in analysis.reason, analysis
        assert sim.job.hang_counts.get("a", 0) == 0
        assert sim.job.hang_counts["b"] == n
        if n == 1:
            assert kinds([act]) == ["REJOIN"]
            assert sim.job.evictions == []
            rejoin(sim)
    (evicted,) = sim.job.evictions
    assert (evicted.node_id, evicted.kind) == ("b", "hang")
    assert "b hung 2 times (rank(s) 1 on b stopped" in evicted.reason
    assert sim.job.nodes["a"].status == "alive"


def test_the_stopped_node_reporting_first_is_charged_at_once() -> None:
    sim = two_nodes()
    beacon_hang(sim, "b", stopped="b")
    hang_event = sim.job.events.of_kind("hang")[-1]
    assert (hang_event.node, "counted against b" in hang_event.message) == ("b", True)
    assert sim.job.hang_counts == {"b": 1}
    rejoin(sim)
    # Its second hang evicts it when it reports: its own stacks, sent first, show the stopped rank.
    act = beacon_hang(sim, "b", stopped="b")
    assert kinds([act]) == ["EXIT"]
    assert [e.node_id for e in sim.job.evictions] == ["b"]


def test_without_evidence_two_hangs_restart_twice_and_charge_nobody() -> None:
    """Two stacks that tie and no stopped rank (a deadlock, say): before, the reporter was charged and
    evicted as "hung 2 times" at the second hang, though its peer may have held it up both times."""
    sim = two_nodes()
    for n in (1, 2):
        act = beacon_hang(sim, "a", stopped="")
        assert kinds([act]) == ["REJOIN"], act
        analysis = sim.job.status().hang_analysis
        assert (analysis.blamed, analysis.odd_nodes) == ("", [])
        assert "counted against no node" in analysis.reason
        if n == 1:
            rejoin(sim)
    assert sim.job.evictions == []
    assert sum(sim.job.hang_counts.values()) == 0
    assert sim.job.restart_count == 2


def test_stacks_that_never_come_charge_nobody() -> None:
    sim = two_nodes()
    round_no = sim.job.round_number
    stacks(sim, "a", round=round_no, stopped=False)
    sim.fail("a", rank=0, kind=pb.FAILURE_KIND_HANG, cls=pb.FAILURE_CLASS_HANG)
    sim.at(sim.now + 3.0)
    sim.hb("b")  # b's agent is there but its stacks never arrive
    sim.at(sim.now + 1.5)  # past the heartbeat timeout: the analysis goes by what it has
    analysis = sim.job.status().hang_analysis
    assert (analysis.nodes_reported, analysis.blamed) == (["a"], ""), analysis
    assert sum(sim.job.hang_counts.values()) == 0


def _hang_report(sim: Sim, node: str, *, trace: str) -> pb.ReportFailureRequest:
    """A device-side hang of ``node``'s rank in all_reduce #7, with its NCCL flight-recorder dump."""
    current = pb.Interval(name="all_reduce", group="dp:0,1", seq=7, device=True)
    evidence = pb.HangEvidence(
        side="device", age_s=12.5, timeout_s=10.0, activity=pb.RankActivity(current=current), nccl_trace=trace
    )
    failure = pb.WorkerFailure(
        rank=RANK[node], failure_class=pb.FAILURE_CLASS_HANG, error_message="hung", hang=evidence
    )
    return pb.ReportFailureRequest(
        node_id=node,
        incarnation=sim.inc[node],
        round=sim.job.round_number,
        kind=pb.FAILURE_KIND_HANG,
        failures=[failure],
    )


def test_a_hang_reports_evidence_and_nccl_dump_are_kept_with_its_failure() -> None:
    sim = two_nodes()
    dump = '{"version": "2.10", "entries": [{"profiling_name": "nccl:all_reduce", "state": "started"}]}'
    sim.job.report_failure(_hang_report(sim, "b", trace=dump), now=sim.now)
    (failure,) = [f for f in sim.job.timeline.failures() if f["kind"] == "failure"]
    assert failure["node"] == "b"
    (rank,) = failure["hang"]
    assert rank == {
        "rank": 1,
        "local_rank": 0,
        "side": "device",
        "age_s": 12.5,
        "timeout_s": 10.0,
        "collective": {"op": "all_reduce", "group": "dp:0,1", "seq": 7},
        "nccl_trace": dump,
    }
    window = sim.job.timeline.window(start=sim.now - 60, end=sim.now + 60, now=sim.now)
    assert [f.get("hang") for f in window["failures"] if f["kind"] == "failure"] == [[rank]]


def test_an_agents_oversized_or_odd_evidence_is_cut_to_the_bounds() -> None:
    sim = two_nodes()
    req = _hang_report(sim, "a", trace="x" * (limits.MAX_NCCL_TRACE_BYTES * 4))
    req.failures[0].hang.side = "elsewhere"
    req.failures[0].hang.activity.current.name = "n" * 1000
    sim.job.report_failure(req, now=sim.now)
    (failure,) = [f for f in sim.job.timeline.failures() if f["kind"] == "failure"]
    (rank,) = failure["hang"]
    assert rank["side"] == "beacon", "a side the master does not know is not repeated"
    assert len(rank["collective"]["op"]) == limits.MAX_NAME_CHARS
    assert len(rank["nccl_trace"]) == limits.MAX_NCCL_TRACE_BYTES + 16
