"""HeartbeatStream against the real ``phalanx master`` process: the token checked when the stream opens,
each beat answered in order with the semantics of a held Heartbeat call, and the stream's closing (a
SIGKILLed agent) noticed at once, even with no beat in flight."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from phalanx.agent.client import MasterClient
from phalanx.api.errors import AuthenticationError
from phalanx.api.v1 import master_pb2 as pb
from phalanx.api.v1 import master_pb2_grpc as pb_grpc

from .procs import TOKEN, Agent, Master

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

FLAGS = ("--nodes", "1:2", "--heartbeat-interval", "3", "--heartbeat-timeout", "10", "--last-call", "0.3")


def form_round(a: Agent, b: Agent) -> None:
    ra, rb = a.join(5001), b.join(5002)
    assert ra == rb
    t = threading.Thread(target=b.get, args=(rb,))
    t.start()
    assert a.get(ra).status == pb.RENDEZVOUS_STATUS_COMPLETE
    t.join(15)


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[Master, Agent, Agent]]:
    m = Master(tmp_path, *FLAGS)
    try:
        a, b = Agent(m, "node-a"), Agent(m, "node-b")
        a.register(), b.register()
        form_round(a, b)
        yield m, a, b
    finally:
        m.stop(signal.SIGKILL)


def beat(agent: Agent, *, step: int = -1, wait_s: float = 0.0) -> pb.HeartbeatRequest:
    ranks = [pb.RankProgress(rank=0, step=step, step_unix_ns=time.time_ns())] if step >= 0 else []
    return pb.HeartbeatRequest(
        node_id=agent.node_id,
        incarnation=agent.incarnation,
        state=pb.NODE_STATE_RUNNING,
        round=agent.round,
        ranks=ranks,
        wait_s=wait_s,
    )


def refused_without_the_token(m: Master, a: Agent) -> None:
    """A stream with a wrong or no token is refused when it opens, and none of its beats reaches the job."""
    stub = pb_grpc.MasterStub(m.channel)
    for metadata in ((("authorization", "Bearer not-the-token-of-this-job"),), ()):
        call = stub.HeartbeatStream(iter([beat(a, step=9)]), metadata=metadata, timeout=5)
        with pytest.raises(grpc.RpcError) as refused:
            next(call)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    wrong = MasterClient(address=m.grpc, token="not-the-token-of-this-job")
    try:
        with pytest.raises(AuthenticationError):
            wrong.heartbeat_stream().beat(beat(a, step=9), timeout=5)
    finally:
        wrong.close()
    assert stream_beats(m) == 0  # no beat of a refused stream reached the job
    assert m.job()["max_step"] == -1


def stream_beats(m: Master) -> float:
    """Beats the master answered on HeartbeatStream, from its own /metrics."""
    for line in m.client.get("/metrics").text.splitlines():
        if line.startswith('phalanx_rpc_duration_seconds_count{method="HeartbeatStream"}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_one_stream_per_agent_with_the_semantics_of_held_heartbeat_calls(
    pair: tuple[Master, Agent, Agent],
) -> None:
    m, a, b = pair
    refused_without_the_token(m, a)
    client = MasterClient(address=m.grpc, token=TOKEN)
    stream = client.heartbeat_stream()
    try:
        for step in (3, 4, 5):  # answered at once and in order, the progress arriving as with calls
            answer = stream.beat(beat(a, step=step), timeout=5)
            assert (answer.round, list(answer.actions)) == (1, [])
        assert m.job()["max_step"] == 5
        assert stream_beats(m) == 3

        held: list[tuple[float, pb.HeartbeatResponse]] = []

        def hold() -> None:
            started = time.monotonic()
            answer = stream.beat(beat(a, wait_s=3.0), timeout=8)
            held.append((time.monotonic() - started, answer))

        t = threading.Thread(target=hold)
        t.start()
        time.sleep(0.5)
        assert held == []  # nothing to say yet: the master holds the answer
        b.fail(rank=3, message="RuntimeError: boom")  # opens round 2
        t.join(10)
        took, answer = held[0]
        assert [(x.kind, x.round) for x in answer.actions] == [(pb.ACTION_KIND_REJOIN, 2)]
        assert took < 2.5  # pushed with the round, not at the end of the 3 s hold
        assert answer.held_s == pytest.approx(took, abs=0.3)

        form_round(a, b)  # nothing to say once both joined: the hold runs its course, on the same stream
        started = time.monotonic()
        answer = stream.beat(beat(a, wait_s=1.0), timeout=5)
        assert list(answer.actions) == []
        assert answer.round == 2
        assert time.monotonic() - started >= 0.9
        assert answer.held_s >= 0.9
        assert not stream.closed
        killed_between_beats_is_noticed(m, b)  # while this agent's stream stays open (closing it would tell)
    finally:
        stream.close()
        client.close()


def killed_between_beats_is_noticed(m: Master, b: Agent) -> None:
    """An agent SIGKILLed with its stream open and no beat held: the master learns it from the stream's
    closing and opens a new round, long before the heartbeat timeout."""
    streamer = subprocess.Popen(
        [sys.executable, "-c", STREAMER, m.grpc, TOKEN, b.node_id, b.incarnation],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert streamer.stdout is not None
    assert streamer.stdout.readline().strip() == "answered"
    killed = time.monotonic()
    streamer.kill()
    streamer.wait(10)
    streamer.stdout.close()
    m.wait_for(
        lambda job: job["round"] == 2 and job["phase"] == "Restarting", timeout=5.0, what="a new round"
    )
    assert time.monotonic() - killed < 5.0  # the heartbeat timeout is 10 s
    disconnected = [e for e in m.events() if e["kind"] == "node_disconnected"]
    assert [e["node"] for e in disconnected] == ["node-b"]
    assert "node_lost" not in [e["kind"] for e in m.events()]


STREAMER = """
import sys, time
from phalanx.agent.client import MasterClient
from phalanx.api.v1 import master_pb2 as pb
addr, token, node, inc = sys.argv[1:5]
stream = MasterClient(address=addr, token=token).heartbeat_stream()
stream.beat(pb.HeartbeatRequest(node_id=node, incarnation=inc, state=pb.NODE_STATE_RUNNING, round=2), 10)
print("answered", flush=True)
time.sleep(60)  # between beats: no beat in flight, the stream open
"""
