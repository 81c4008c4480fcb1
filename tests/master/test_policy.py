"""Failure policy: root cause, user-error fail-fast, budgets, hardware and hang. Pure."""

from __future__ import annotations

from phalanx.api.failures import FailureClass
from phalanx.api.v1 import master_pb2 as pb
from phalanx.master.decide.failure_policy import (
    FailureRecord,
    PolicyInput,
    Verdict,
    decide_failure,
    failure_kind,
    records_from_request,
    root_cause,
)


def rec(
    node: str, rank: int, *, cls: str = "unknown", msg: str = "", at: float = 0.0, kind: str = "worker_exit"
):
    return FailureRecord(
        node_id=node,
        round=1,
        rank=rank,
        failure_class=FailureClass.from_label(cls),
        message=msg,
        unix=at,
        kind=kind,
    )


def inp(report, round_records=None, **kw) -> PolicyInput:
    base = dict(
        node_id=report[0].node_id,
        report=report,
        round_records=round_records if round_records is not None else report,
        members=["a", "b"],
        world_size=4,
        restart_count=0,
        max_restarts=3,
        eviction_count=0,
        max_evictions=2,
    )
    base.update(kw)
    return PolicyInput(**base)


def test_root_cause_is_first_by_error_time_then_observed_time() -> None:
    req = pb.ReportFailureRequest(
        node_id="b",
        round=3,
        kind=pb.FAILURE_KIND_WORKER_EXIT,
        failures=[
            pb.WorkerFailure(rank=3, exit_code=-15, observed_unix_ns=5_000_000_000),
            pb.WorkerFailure(
                rank=2,
                exit_code=1,
                failure_class=pb.FAILURE_CLASS_USER,
                observed_unix_ns=9_000_000_000,
                error_unix_ns=4_000_000_000,  # raised before rank 3 was killed
                error_message="ValueError: bad",
                log_tail=["x", "y"],
            ),
        ],
    )
    records = records_from_request(req, now=100.0)
    root = root_cause(records)
    assert root is not None
    assert (root.rank, root.unix, root.failure_class, root.message) == (
        2,
        4.0,
        FailureClass.USER,
        "ValueError: bad",
    )
    assert root.log_tail == ("x", "y")
    # a report without worker entries still yields one record, stamped with now
    bare = records_from_request(
        pb.ReportFailureRequest(node_id="a", round=1, kind=pb.FAILURE_KIND_HANG), now=7.0
    )
    assert (bare[0].kind, bare[0].failure_class, bare[0].unix) == ("hang", FailureClass.HANG, 7.0)


def test_ordinary_failure_restarts_until_budget_spent() -> None:
    d = decide_failure(inp([rec("a", 0, cls="killed")]), now=1.0)
    assert d.verdict is Verdict.RESTART
    d = decide_failure(inp([rec("a", 0, cls="killed", msg="boom")], restart_count=3), now=1.0)
    assert d.verdict is Verdict.FAIL
    assert "restart budget (3)" in d.reason
    assert "boom" in d.reason


def test_user_error_on_every_rank_fails_fast() -> None:
    records = [
        rec(n, r, cls="user", msg="ZeroDivisionError: x") for n, r in (("a", 0), ("a", 1), ("b", 2), ("b", 3))
    ]
    d = decide_failure(inp(records[2:], round_records=records), now=1.0)
    assert d.verdict is Verdict.FAIL
    assert "ZeroDivisionError: x" in d.reason


def test_user_error_from_every_node_within_window_fails_fast() -> None:
    a = rec("a", 0, cls="user", msg="KeyError: 'lr'", at=10.0)
    b_late = rec("b", 3, cls="user", msg="KeyError: 'lr'", at=30.0)
    b_soon = rec("b", 3, cls="user", msg="KeyError: 'lr'", at=12.0)
    assert decide_failure(inp([b_soon], round_records=[a, b_soon]), now=12.0).verdict is Verdict.FAIL
    # outside the window, or another message, or only one node: an ordinary restart
    assert decide_failure(inp([b_late], round_records=[a, b_late]), now=30.0).verdict is Verdict.RESTART
    other = rec("b", 3, cls="user", msg="OSError", at=11.0)
    assert decide_failure(inp([other], round_records=[a, other]), now=11.0).verdict is Verdict.RESTART
    assert decide_failure(inp([a]), now=10.0).verdict is Verdict.RESTART


def test_already_restarting_spends_no_second_restart() -> None:
    d = decide_failure(inp([rec("b", 2, cls="killed")], already_restarting=True), now=1.0)
    assert d.verdict is Verdict.NONE


def test_hardware_evicts_within_budget() -> None:
    d = decide_failure(inp([rec("b", 2, cls="hardware", msg="Xid 79")]), now=1.0)
    assert (d.verdict, d.evict_kind) == (Verdict.EVICT, "hardware")
    assert "Xid 79" in d.reason
    d = decide_failure(inp([rec("b", 2, cls="hardware")], eviction_count=2), now=1.0)
    assert d.verdict is Verdict.FAIL
    assert "eviction budget" in d.reason
    # even when another failure already restarts the round
    d = decide_failure(inp([rec("b", 2, cls="hardware")], already_restarting=True), now=1.0)
    assert d.verdict is Verdict.EVICT


def test_hang_restarts_with_stacks_then_evicts_on_second() -> None:
    hung = [rec("a", 0, kind="hang", cls="hang")]
    first = decide_failure(inp(hung, hang_suspect="a", hang_blame_why="rank 0 stopped"), now=1.0)
    assert (first.verdict, first.dump_stacks, first.blamed) == (Verdict.RESTART, True, "a")
    second = decide_failure(inp(hung, hang_suspect="a", suspect_hang_count=1), now=1.0)
    assert (second.verdict, second.evict_kind) == (Verdict.EVICT, "hang")
    # Nothing singles out a node: a restart with stacks, counted against nobody, even for a reporter that
    # hung before (it may be its peer's victim both times).
    unknown = decide_failure(inp(hung, hang_blame_why="no evidence singles out a node"), now=1.0)
    assert (unknown.verdict, unknown.dump_stacks, unknown.blamed) == (Verdict.RESTART, True, "")
    assert "counted against no node" in unknown.reason


def test_message_falls_back_to_the_exception_line_of_the_log_tail() -> None:
    tail = [
        "Traceback (most recent call last):",
        '  File "t.py", line 1',
        "[rank1]: ZeroDivisionError: always",
        "",
    ]
    req = pb.ReportFailureRequest(
        node_id="a",
        round=1,
        failures=[
            pb.WorkerFailure(rank=r, failure_class=pb.FAILURE_CLASS_USER, log_tail=tail, observed_unix_ns=1)
            for r in (0, 1)
        ],
    )
    records = records_from_request(req, now=1.0)
    assert [r.message for r in records] == ["ZeroDivisionError: always"] * 2
    # every rank of a one-node round: fail fast
    d = decide_failure(inp(records, members=["a"], world_size=2), now=1.0)
    assert d.verdict is Verdict.FAIL
    # one rank of two on a one-node round: no evidence that every rank hits it
    d = decide_failure(inp(records[:1], members=["a"], world_size=2), now=1.0)
    assert d.verdict is Verdict.RESTART


def test_the_failure_class_is_an_enum_that_prints_its_lowercase_label() -> None:
    req = pb.ReportFailureRequest(
        node_id="a",
        round=1,
        failures=[
            pb.WorkerFailure(
                rank=0, failure_class=99, error_message="x"
            ),  # a class this master does not know
            pb.WorkerFailure(rank=1, failure_class=pb.FAILURE_CLASS_OOM),
        ],
    )
    unknown, oom = records_from_request(req, now=1.0)
    assert (unknown.failure_class, oom.failure_class) == (FailureClass.UNKNOWN, FailureClass.OOM)
    assert unknown.to_json()["failure_class"] == "unknown"
    assert oom.summary() == "rank 1 on a (oom): exit code 0"
    assert FailureClass.from_label("hardware") is FailureClass.HARDWARE


def test_a_reports_kind_is_one_the_master_knows() -> None:
    assert failure_kind(pb.FAILURE_KIND_HANG) == "hang"
    assert failure_kind(pb.FAILURE_KIND_LAUNCH) == "launch"
    assert failure_kind(pb.FAILURE_KIND_WORKER_EXIT) == "worker_exit"
    assert failure_kind(pb.FAILURE_KIND_UNSPECIFIED) == "worker_exit"  # an older agent
    assert failure_kind(99) == "worker_exit"  # a newer agent's kind: proto3 enums are open
