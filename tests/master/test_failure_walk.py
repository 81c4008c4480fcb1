"""A failure report's walk through the master: planned once from the state (a pure function that writes
nothing), then applied by the job's one writer (:meth:`JobCore.apply`); each component of the job is entered
at most once, and every attribute of the job's state set during the walk is set by the writer.

A *component* is one of the job's objects (:class:`Job`, its writer, its components such as
:class:`Failures` and :class:`Hangs`); the pure decision functions (the failure policy, the hang evidence,
``plan_failure`` itself) are not components: they read and return values. The walk is traced with
``sys.setprofile`` on the real request handlers, driven as agents drive them.
"""

from __future__ import annotations

import inspect
import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

import pytest

from phalanx.api.v1 import master_pb2 as pb
from phalanx.master.job import Job
from phalanx.master.job import effects as fx
from phalanx.master.job.core import JobCore
from phalanx.master.job.failures import Failures, plan_failure
from phalanx.master.job.foldin import FoldIn
from phalanx.master.job.hangs import Hangs
from phalanx.master.job.heartbeats import Heartbeats
from phalanx.master.job.liveness import Liveness
from phalanx.master.job.probes import ProbeRounds
from phalanx.master.job.rounds import Rounds
from phalanx.master.job.stepchecks import StepChecks
from phalanx.master.state import snapshot
from phalanx.master.state.jobstate import JobState
from phalanx.master.state.nodes import Node

from .sim import Sim, failure_report, kinds
from .test_hang_blame import stacks, two_nodes

COMPONENTS = (Job, JobCore, Failures, Hangs, Rounds, Heartbeats, Liveness, FoldIn, ProbeRounds, StepChecks)
TWO: dict[str, Any] = {"rendezvous": {"min_nodes": 1, "max_nodes": 2, "last_call_s": 1.0}}


def _component(frame: FrameType | None) -> type | None:
    """The component whose method ``frame`` runs (None: a function, or an object of no component)."""
    owner = frame.f_locals.get("self") if frame is not None else None
    return next((c for c in COMPONENTS if isinstance(owner, c)), None)


@contextmanager
def entries() -> Iterator[Counter[str]]:
    """Counts, per component, the calls that enter it from outside it (a method calling another method of
    its own component is not an entry)."""
    counts: Counter[str] = Counter()

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event != "call":
            return
        callee = _component(frame)
        if callee is not None and callee is not _component(frame.f_back):
            counts[callee.__name__] += 1

    sys.setprofile(profile)
    try:
        yield counts
    finally:
        sys.setprofile(None)


@contextmanager
def state_writers(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[str, str]]]:
    """Every (attribute, function) that sets an attribute of a :class:`JobState` while the block runs."""
    writes: list[tuple[str, str]] = []
    plain = object.__setattr__

    def recording(self: JobState, name: str, value: Any) -> None:
        caller = inspect.currentframe()
        assert caller is not None
        assert caller.f_back is not None
        code = caller.f_back.f_code
        writes.append((name, f"{code.co_filename.rsplit('/', 1)[-1]}:{code.co_name}"))
        plain(self, name, value)

    monkeypatch.setattr(JobState, "__setattr__", recording)
    yield writes


def fingerprint(job: Job) -> Any:
    """What a failure report can change of the job's state, as plain values."""
    s = job.state
    return (
        snapshot.durable(s),
        [r.to_json() for r in s.round_failures],
        s.hang and (s.hang.round, sorted(s.hang.stacks), s.hang.charged),
        s.early_stacks[0],
        sorted(s.early_stacks[1]),
        s.last_hang_analysis and s.last_hang_analysis.to_dict(),
        dict(s.stats.failures),
        dict(s.stats.hang_verdicts),
        s.events.next_seq,
        [(n.node_id, n.status, n.last_seen, [a.seq for a in n.pending]) for n in s.nodes.values()],
        (s.status_version, s.durable_version, s.round_version, s.action_version),
    )


def walk(job: Job, req: pb.ReportFailureRequest, now: float, monkeypatch: pytest.MonkeyPatch) -> pb.Action:
    """Plans ``req`` (which must write nothing), then walks it through the job's real handler: each
    component entered at most once, every state attribute set by the writer."""
    before = fingerprint(job)
    plan = plan_failure(job.state, req, now=now)
    assert fingerprint(job) == before, "planning a failure report changed the job's state"
    with state_writers(monkeypatch) as writes, entries() as counts:
        answer = job.report_failure(req, now=now)
    assert answer == plan.answer
    assert counts
    assert max(counts.values()) == 1, f"a component was entered more than once: {counts}"
    assert set(counts) <= {"Job", "Failures", "JobCore"}, counts
    strangers = {(name, where) for name, where in writes if not where.startswith("core.py:")}
    assert strangers == set(), f"the job's state was written outside its writer: {strangers}"
    return answer


def report(
    sim: Sim, node: str, *, kind: int = pb.FAILURE_KIND_WORKER_EXIT, cls: int = 0, rank: int = 0
) -> Any:
    return failure_report(
        node,
        sim.inc[node],
        sim.job.round_number,
        kind=kind,
        cls=cls or pb.FAILURE_CLASS_KILLED,
        message="boom",
        rank=rank,
        now=sim.now,
    )


def test_a_restart_is_planned_then_written_by_the_writer_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    sim = Sim(**TWO)
    sim.form("a", "b")
    answer = walk(sim.job, report(sim, "b", rank=3), sim.now, monkeypatch)
    assert (kinds([answer]), answer.round) == (["REJOIN"], 2)
    assert sim.job.restart_count == 1
    assert sim.job.round_open
    assert sim.job.root_cause is not None
    assert sim.job.root_cause["rank"] == 3


def test_an_eviction_and_a_failed_job_walk_the_same_way(monkeypatch: pytest.MonkeyPatch) -> None:
    sim = Sim(**TWO)
    sim.form("a", "b")
    hardware = report(sim, "a", cls=pb.FAILURE_CLASS_HARDWARE)
    answer = walk(sim.job, hardware, sim.now, monkeypatch)
    assert kinds([answer]) == ["EXIT"]
    assert answer.reason.startswith("evicted: ")
    assert [e.node_id for e in sim.job.evictions] == ["a"]

    spent = Sim(restart={"max_restarts": 0}, **TWO)
    spent.form("a", "b")
    answer = walk(spent.job, report(spent, "a"), spent.now, monkeypatch)
    assert kinds([answer]) == ["EXIT"]
    assert spent.job.phase == "Failed"
    assert answer.reason == f"job failed: {spent.job.reason}"


def test_a_hang_whose_stacks_are_all_in_is_analysed_within_the_same_walk(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sim = two_nodes()
    round_no = sim.job.round_number
    stacks(sim, "a", round=round_no, stopped=False)
    stacks(sim, "b", round=round_no, stopped=True)
    hung = report(sim, "a", kind=pb.FAILURE_KIND_HANG, cls=pb.FAILURE_CLASS_HANG)
    plan = plan_failure(sim.job.state, hung, now=sim.now)
    assert [type(e) for e in plan.effects if isinstance(e, fx.AskStacks | fx.RecordHangAnalysis)] == [
        fx.AskStacks,
        fx.RecordHangAnalysis,
    ]
    walk(sim.job, hung, sim.now, monkeypatch)
    analysis = sim.job.last_hang_analysis
    assert analysis is not None
    assert analysis.blamed == "b"
    assert sim.job.hang is None
    assert sim.job.hang_counts == {"b": 1}


@pytest.mark.parametrize("when", ["stale", "suspended"])
def test_reports_the_round_does_not_act_on_walk_the_same_way(
    when: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    sim = Sim(**TWO)
    sim.form("a", "b")
    req = report(sim, "a")
    if when == "stale":
        req.round = sim.job.round_number - 1
    else:
        sim.job.suspend(True, now=sim.now)
    answer = walk(sim.job, req, sim.now, monkeypatch)
    assert kinds([answer]) == ["REJOIN"]
    assert sim.job.restart_count == 0


def test_the_tracers_see_a_component_entered_twice_and_a_write_outside_the_writer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The checks above can fail: a direct write of the state, and a component called back, are seen."""
    sim = Sim(**TWO)
    sim.form("a", "b")
    with state_writers(monkeypatch) as writes, entries() as counts:
        sim.job.core.changed()
        sim.job.core.changed()
        sim.job.state.reason = "written by a test"
    assert counts["JobCore"] == 2
    assert [where for name, where in writes if name == "reason"] == [f"test_failure_walk.py:{_this()}"]


def _this() -> str:
    return "test_the_tracers_see_a_component_entered_twice_and_a_write_outside_the_writer"


@contextmanager
def record_writers(monkeypatch: pytest.MonkeyPatch) -> Iterator[set[str]]:
    """Every ``file:function`` that sets an attribute of the job's state or of a node's record while the
    block runs."""
    writers: set[str] = set()
    for cls in (JobState, Node):
        plain = cls.__setattr__

        def recording(self: Any, name: str, value: Any, plain: Any = plain) -> None:
            caller = inspect.currentframe()
            assert caller is not None
            assert caller.f_back is not None
            code = caller.f_back.f_code
            writers.add(f"{code.co_filename.rsplit('/', 1)[-1]}:{code.co_name}")
            plain(self, name, value)

        monkeypatch.setattr(cls, "__setattr__", recording)
    yield writers


def test_a_job_s_whole_life_writes_its_state_through_the_writer_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Registration, rounds, heartbeats with progress, checkpoints and a save at breakpoint, a probe round, a
    failure, a hang and its stacks, a lost node, suspension and resumption, completion: every attribute of
    the state and of the nodes' records is set by the writer (the records' own ``heard`` is the writer's
    call; a constructor builds a record before the writer stores it)."""
    sim = Sim(
        rendezvous={"min_nodes": 1, "max_nodes": 3, "last_call_s": 1.0},
        heartbeat={"timeout_s": 5.0},
        restart={"max_restarts": 10, "max_evictions": 5},
        probes={"enabled": True, "timeout_s": 3.0},
    )
    with record_writers(monkeypatch) as writers:
        sim.form("a", "b", "c")
        for step in range(3):
            sim.at(sim.now + 0.5)
            for n in ("a", "b", "c"):
                sim.hb(n, step=step)
        for i, n in enumerate(("a", "b", "c")):
            sim.persisted(n, step=2, ranks=[2 * i, 2 * i + 1], world_size=6)
        probe = sim.job.start_probe(now=sim.now, trigger="test")
        for _ in range(4):  # the probe round times out, every node heartbeating
            sim.at(sim.now + 1)
            for n in ("a", "b", "c"):
                sim.hb(n, step=3)
        sim.fail("b", rank=2)
        sim.in_memory("a", round=sim.job.round_number, held=[2, 3])
        sim.form("a", "b", "c")
        round_no = sim.job.round_number
        stacks_req = pb.ReportStacksRequest(
            node_id="a", incarnation=sim.inc["a"], round=round_no, ranks=[pb.RankStacks(rank=0, stacks="x")]
        )
        sim.job.report_stacks(stacks_req, now=sim.now)
        sim.fail("a", kind=pb.FAILURE_KIND_HANG, cls=pb.FAILURE_CLASS_HANG)
        sim.at(sim.now + 6)  # no heartbeat from anyone: lost, and the hang analysis times out
        sim.register("d")
        sim.job.follow_spec(suspend=True, generation=2, now=sim.now, scheduled_workers=1)
        sim.job.follow_spec(suspend=False, generation=3, now=sim.now, scheduled_workers=1)
        sim.form("d")
        sim.hb("d", step=9)
        sim.complete("d")
    assert probe.result != "running"
    assert sim.job.checkpoints.committed == 2
    assert sim.job.phase == "Succeeded", sim.job.reason
    allowed = {"core.py", "jobstate.py:is_member", "nodes.py:heard", "nodes.py:__init__", "<string>:__init__"}
    strangers = {w for w in writers if w not in allowed and w.split(":")[0] not in allowed}
    assert strangers == set(), f"the state was written outside its writer: {strangers}"
