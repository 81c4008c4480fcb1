"""The root cause, not its echo: which of a round's failures is the first real one, and the sentence that says
so. The messages are verbatim from torch 2.x, gloo and NCCL (the gloo one from a real run: rank 1 SIGKILLed
mid all-reduce)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from phalanx.agent.failures import fit_failure_report
from phalanx.api.v1 import master_pb2 as pb
from phalanx.diagnostics.classify import FailureClass, classify
from phalanx.diagnostics.rootcause import explain, is_echo, pick

GLOO_CLOSED = (
    "RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:561] Connection closed "
    "by peer [127.0.0.1]:39836. This is typically caused by a remote worker crashing. Check the logs of the "
    "remote worker before reporting an error."
)
GLOO_RESET = (
    "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:598] Read error [10.0.0.2]:21841: "
    "Connection reset by peer"
)
GLOO_RECV_TIMEOUT = (
    "RuntimeError: [../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 1800000ms "
    "for recv operation to complete"
)
NCCL_REMOTE = (
    "torch.distributed.DistBackendError: NCCL error in: "
    "/pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:3356, "
    "remote process exited or there was a network error, NCCL version 2.27.3"
)
NCCL_REMOTE_ERROR = (
    "ncclRemoteError: A call failed possibly due to a network error or a remote process exiting prematurely."
)
NCCL_WATCHDOG = (
    "[rank0]:[E1126 00:12:01.123] [PG ID 0 PG GUID 0(default_pg) Rank 0] Watchdog caught collective "
    "operation timeout: WorkNCCL(SeqNum=7, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) "
    "ran for 600027 milliseconds before timing out."
)
NCCL_ABORTED = "torch.distributed.DistBackendError: NCCL communicator was aborted on rank 2."
STORE_RECV = (
    "torch.distributed.DistNetworkError: Failed to recv, got 0 bytes. Connection was likely closed. Did the "
    "remote server shutdown or crash?"
)
STORE_WAIT = "torch.distributed.DistStoreError: wait timeout after 300000ms, keys: /default_pg/0//cuda//0"
STORE_CLIENTS = (
    "torch.distributed.DistStoreError: Timed out after 901 seconds waiting for clients. 1/2 clients joined."
)
USER = "ValueError: bad batch at step 12"
OOM = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"

ECHOES = [
    GLOO_CLOSED,
    GLOO_RESET,
    GLOO_RECV_TIMEOUT,
    NCCL_REMOTE,
    NCCL_REMOTE_ERROR,
    NCCL_WATCHDOG,
    NCCL_ABORTED,
    STORE_RECV,
    STORE_WAIT,
    STORE_CLIENTS,
]


@dataclass(frozen=True)
class F:
    """A failure as the master keeps it (the fields ``rootcause.FailureLike`` names)."""

    rank: int
    failure_class: str
    unix: float
    message: str = ""
    exit_code: int = 1
    node_id: str = "node-0"


def failure(rank: int, *, code: int, message: str, unix: float, node: str = "node-0") -> F:
    """Classified as the agent classifies it: from the exit code and the worker's last line."""
    cls = classify(
        exit_code=code, log_tail=["Traceback (most recent call last):", message] if message else []
    )
    return F(rank, cls.name.lower(), unix, message, code, node)


@pytest.mark.parametrize("echo", ECHOES)
def test_every_peer_lost_message_is_classified_an_echo(echo: str) -> None:
    assert classify(exit_code=1, log_tail=[echo]) is FailureClass.COMM
    assert is_echo("comm", echo)
    assert is_echo("user", echo)  # an older agent's class: the message still tells


def test_a_watchdog_abort_is_an_echo_not_a_kill() -> None:
    # ProcessGroupNCCL aborts the process (SIGABRT) after the timeout: the stuck peer is the cause.
    assert classify(exit_code=-6, log_tail=[NCCL_WATCHDOG]) is FailureClass.COMM
    assert classify(exit_code=-6, log_tail=["step 3"]) is FailureClass.KILLED


@pytest.mark.parametrize("echo", ECHOES)
@pytest.mark.parametrize(
    ("code", "message", "said"),
    [
        (-9, "", "rank 1 on node-1 SIGKILLed at 12:00:01.2 UTC"),
        (137, "", "rank 1 on node-1 SIGKILLed at 12:00:01.2 UTC"),
        (-11, "", "rank 1 on node-1 killed by SIGSEGV at 12:00:01.2 UTC"),
        (1, USER, f"rank 1 on node-1 raised {USER} at 12:00:01.2 UTC"),
        (1, OOM, f"rank 1 on node-1 ran out of memory: {OOM} at 12:00:01.2 UTC"),
    ],
)
def test_a_real_cause_wins_over_earlier_echoes(echo: str, code: int, message: str, said: str) -> None:
    base = 1_795_003_201.25  # 2026-11-18 12:00:01.25 UTC
    # The echoes carry the earlier time (their error files), the cause is dated when its agent saw the exit.
    failures = [
        failure(0, code=1, message=echo, unix=base - 0.5),
        failure(2, code=1, message=echo, unix=base - 0.4, node="node-1"),
        failure(1, code=code, message=message, unix=base, node="node-1"),
        failure(3, code=1, message=echo, unix=base - 0.3, node="node-1"),
    ]
    root = pick(failures)
    assert root is failures[2]
    assert explain(root, failures) == f"{said}; ranks 0, 2, 3 lost their peer after it"


def test_among_real_causes_the_earliest_wins_then_the_lowest_rank() -> None:
    a = failure(3, code=1, message=USER, unix=10.0)
    b = failure(2, code=-9, message="", unix=11.0)
    c = failure(1, code=1, message=USER, unix=10.0)
    assert pick([a, b, c]) is c
    assert explain(c, [a, b, c]).endswith("; ranks 2, 3 also failed")


def test_an_unexplained_exit_ranks_between_a_cause_and_an_echo() -> None:
    echo = failure(0, code=1, message=GLOO_CLOSED, unix=1.0)
    unexplained = failure(1, code=2, message="", unix=2.0)
    assert unexplained.failure_class == "unknown"
    assert pick([echo, unexplained]) is unexplained
    killed = failure(2, code=-9, message="", unix=3.0)
    assert pick([echo, unexplained, killed]) is killed


def test_only_echoes_name_the_first_and_say_so() -> None:
    # A network failure: every rank lost its peers, none died first. The first to notice is named.
    a = failure(1, code=1, message=NCCL_REMOTE, unix=5.0, node="node-1")
    b = failure(0, code=1, message=GLOO_RESET, unix=4.0)
    root = pick([a, b])
    assert root is b
    sentence = explain(b, [a, b])
    assert sentence.startswith("rank 0 on node-0 lost its peers first: RuntimeError: [../third_party/gloo")
    assert sentence.endswith("; rank 1 too")


def test_a_hang_verdict_outranks_the_echo_it_causes() -> None:
    hung = F(2, "hang", 30.0, "rank 2 hung: no progress past step 159 for 10.1s (timeout 10.0s)", 0, "node-0")
    watchdog = failure(0, code=-6, message=NCCL_WATCHDOG, unix=20.0, node="node-1")
    assert watchdog.failure_class == "comm"
    assert pick([watchdog, hung]) is hung
    assert explain(hung, [watchdog, hung]) == (
        "rank 2 on node-0 hung: no progress past step 159 for 10.1s (timeout 10.0s) at 00:00:30.0 UTC; "
        "rank 0 lost its peer after it"
    )


def test_a_node_level_record_and_no_failures() -> None:
    agent = F(-1, "killed", 0.0, "the node's agent restarted (new incarnation)", 1, "node-2")
    assert explain(agent, [agent]) == "node-2: the node's agent restarted (new incarnation)"
    assert pick([]) is None


def test_an_agent_report_cut_to_one_entry_keeps_the_kill_not_its_earlier_echo() -> None:
    echo = pb.WorkerFailure(
        rank=0,
        exit_code=1,
        failure_class=pb.FAILURE_CLASS_COMM,
        error_message=GLOO_CLOSED,
        error_unix_ns=1_000_000_000,
        log_tail=["x" * 200] * 4,
    )
    killed = pb.WorkerFailure(
        rank=1, exit_code=-9, failure_class=pb.FAILURE_CLASS_KILLED, observed_unix_ns=2 * 10**9
    )
    request = pb.ReportFailureRequest(node_id="node-0", round=1, failures=[echo, killed])
    one = pb.ReportFailureRequest(node_id="node-0", round=1, failures=[killed]).ByteSize() + 8
    (kept,) = fit_failure_report(request, one).failures
    assert (kept.rank, kept.exit_code) == (1, -9)
