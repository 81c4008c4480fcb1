"""The agent's heartbeat link (:class:`phalanx.agent.link.Link`) on HeartbeatStream: it falls back to one
Heartbeat call per beat against a master that has no stream (UNIMPLEMENTED from gRPC itself), and opens a
new stream to a restarted master as it reconnects its calls."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from phalanx.agent.client import MasterClient
from phalanx.agent.link import Link, LogShipper
from phalanx.api.settings import LogSettings
from phalanx.api.v1 import master_pb2 as pb
from tests.eventually import eventually
from tests.master.procs import TOKEN, Agent, Master

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


def start_link(
    address: str, node_id: str, incarnation: str, *, interval_s: float
) -> tuple[Link, MasterClient]:
    client = MasterClient(address=address, token=TOKEN)
    link = Link(
        client=client,
        node_id=node_id,
        incarnation=incarnation,
        interval_s=interval_s,
        shipper=LogShipper(LogSettings()),
        reregister=lambda: None,
    )
    link.publish(state=pb.NODE_STATE_RUNNING, round=1, ranks=[pb.RankProgress(rank=0, step=7)])
    link.start()
    return link, client


@pytest.fixture
def older_master() -> Iterator[tuple[str, list[tuple[float, pb.HeartbeatRequest]]]]:
    """A gRPC server of the phalanx.v1.Master service as masters before HeartbeatStream served it: only
    Heartbeat (which is all a link calls); gRPC answers any other method UNIMPLEMENTED by itself."""
    beats: list[tuple[float, pb.HeartbeatRequest]] = []

    def heartbeat(request: pb.HeartbeatRequest, context: grpc.ServicerContext) -> pb.HeartbeatResponse:
        beats.append((time.monotonic(), request))
        return pb.HeartbeatResponse(round=1, committed_checkpoint_step=-1)

    handler = grpc.unary_unary_rpc_method_handler(
        heartbeat,
        request_deserializer=pb.HeartbeatRequest.FromString,
        response_serializer=pb.HeartbeatResponse.SerializeToString,
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    server.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler("phalanx.v1.Master", {"Heartbeat": handler})]
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}", beats
    finally:
        server.stop(0)


def test_against_a_master_without_the_stream_each_beat_is_a_call(
    older_master: tuple[str, list[tuple[float, pb.HeartbeatRequest]]],
) -> None:
    address, beats = older_master
    started = time.monotonic()
    link, client = start_link(address, "node-a", "inc-a", interval_s=0.3)
    try:
        eventually(lambda: len(beats) >= 3, timeout=10, what="three heartbeat calls")
        assert not link.streaming
        assert beats[0][0] - started < 1.0  # the first beat went out as a call at once, not lost
        assert [b.ranks[0].step for _, b in beats[:3]] == [7, 7, 7]
        assert [b.wait_s for _, b in beats[:3]] == [0.3] * 3  # still held beats
    finally:
        link.stop()
        client.close()


def stream_beats(m: Master) -> float:
    """Beats the master answered on HeartbeatStream, from its own /metrics."""
    for line in m.client.get("/metrics").text.splitlines():
        if line.startswith('phalanx_rpc_duration_seconds_count{method="HeartbeatStream"}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_beat_now_goes_beside_the_held_stream_beat_and_a_restarted_master_gets_a_new_stream(
    tmp_path: Path,
) -> None:
    flags = ("--nodes", "1:1", "--heartbeat-interval", "3", "--heartbeat-timeout", "10")
    m = Master(tmp_path, *flags)
    agent = Agent(m, "node-a")
    agent.register()  # durable: a master restarted on the same state knows the node
    link, client = start_link(m.grpc, agent.node_id, agent.incarnation, interval_s=3.0)
    restarted = None
    try:
        eventually(lambda: stream_beats(m) >= 1, timeout=10, what="a held beat on the stream")
        # The supervisor's beat_now (its thread, not the link's) is a call of its own: answered at once,
        # not queued behind the stream's beat that the master holds for 3 s.
        link.publish(state=pb.NODE_STATE_RUNNING, round=1, ranks=[pb.RankProgress(rank=0, step=42)])
        done = threading.Event()
        threading.Thread(target=lambda: (link.beat_now(), done.set()), daemon=True).start()
        assert done.wait(2.0)
        assert m.job()["max_step"] == 42

        # The registration is answered before its state is on disk (the master saves in the background): the
        # SIGKILL must come after that save, which a busy disk can take seconds to make.
        state = tmp_path / "state.json"
        eventually(
            lambda: state.exists() and agent.node_id in state.read_text(),
            timeout=15,
            what="the registration saved",
        )
        ports = m.ports
        m.stop(signal.SIGKILL)
        restarted = Master(tmp_path, *flags, ports=ports)
        eventually(lambda: stream_beats(restarted) >= 1, timeout=15, what="a beat on a new stream")
        assert link.streaming
        node = restarted.client.get("/v1/nodes").json()["nodes"][0]
        assert (node["node_id"], node["status"]) == ("node-a", "alive")
    finally:
        link.stop()
        client.close()
        if restarted is not None:
            restarted.stop(signal.SIGKILL)
        m.stop(signal.SIGKILL)
