"""Failure reports and stack dumps cut to the master's limits before they are sent (pure functions)."""

from __future__ import annotations

from phalanx.agent import failures
from phalanx.api import limits
from phalanx.api.v1 import master_pb2 as pb

ROOT_CAUSE = "RuntimeError: the root cause\nsecond line of the message"


def huge_failure(rank: int, *, at_ns: int) -> pb.WorkerFailure:
    return pb.WorkerFailure(
        rank=rank,
        exit_code=1,
        failure_class=pb.FAILURE_CLASS_USER,
        error_message=ROOT_CAUSE + "\n" + "m" * 300_000,
        error_traceback="Traceback (most recent call last):\n"
        + '  File "train.py", line 1, in <module>\n' * 5_000
        + "RuntimeError: the root cause",
        error_unix_ns=at_ns,
        log_tail=[f"line {i} " + "t" * 2_000 for i in range(200)],
    )


def request(n: int) -> pb.ReportFailureRequest:
    return pb.ReportFailureRequest(
        node_id="n0",
        incarnation="i",
        round=1,
        failures=[huge_failure(r, at_ns=(100 - r) * 10**9) for r in range(n)],
    )


def test_head_and_tail_keep_the_ends_and_say_what_was_cut() -> None:
    text = "A" * 1000 + "B" * 1000
    cut = failures.head_and_tail(text, 400)
    assert len(cut) <= 400
    assert cut.startswith("A")
    assert cut.endswith("B" * 200)
    assert "characters cut by the agent" in cut
    assert failures.head(text, 300).startswith("A" * 200)
    assert len(failures.head(text, 300)) <= 300
    assert failures.head("short", 300) == "short"


def test_every_budget_is_met_and_the_root_cause_survives() -> None:
    req = request(8)
    assert req.ByteSize() > limits.DEFAULT_MAX_REQUEST_BYTES  # above even the default limit
    for budget in failures.REQUEST_BUDGETS:
        cut = failures.fit_failure_report(req, budget)
        assert cut.ByteSize() <= budget
        assert len(cut.failures) == 8  # every rank still reported (the policy needs them all)
        for f in cut.failures:
            assert f.error_message.startswith(ROOT_CAUSE)
            assert len(f.error_message) <= limits.MAX_MESSAGE_CHARS
            assert len(f.error_traceback) <= limits.MAX_TRACEBACK_CHARS
            assert len(f.log_tail) <= limits.MAX_TAIL_LINES
            assert f.log_tail[-1].startswith("line 199 ")  # the newest output line
    first = failures.fit_failure_report(req, failures.REQUEST_BUDGETS[0]).failures[0]
    assert first.error_traceback.startswith("Traceback (most recent call last):")
    assert first.error_traceback.endswith("RuntimeError: the root cause")


def test_too_many_ranks_for_the_budget_keep_the_earliest_failures() -> None:
    req = request(60)  # 60 failed ranks into 16 KiB: not all fit even cut to the minimum
    cut = failures.fit_failure_report(req, failures.REQUEST_BUDGETS[-1])
    assert cut.ByteSize() <= failures.REQUEST_BUDGETS[-1]
    assert 1 <= len(cut.failures) < 60
    assert cut.failures[0].rank == 59  # the earliest error first: the root cause
    assert cut.failures[0].error_message.startswith(ROOT_CAUSE)


def test_stacks_are_cut_to_the_masters_limit_in_equal_shares() -> None:
    ranks = [pb.RankStacks(rank=r, stacks=f"Thread 0x{r} main\n" + "frame\n" * 60_000) for r in range(4)]
    req = pb.ReportStacksRequest(node_id="n0", incarnation="i", round=1, ranks=ranks)
    assert sum(len(r.stacks) for r in req.ranks) > limits.MAX_STACKS_CHARS
    for budget in failures.REQUEST_BUDGETS:
        cut = failures.fit_stacks_report(req, budget)
        assert cut.ByteSize() <= budget
        assert sum(len(r.stacks) for r in cut.ranks) <= limits.MAX_STACKS_CHARS
        assert all(r.stacks.startswith(f"Thread 0x{r.rank} main") for r in cut.ranks)
