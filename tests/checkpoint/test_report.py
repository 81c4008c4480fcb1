"""The host reports persisted shards to a real gRPC server with the job's bearer token."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from phalanx.api.v1 import master_pb2, master_pb2_grpc
from phalanx.checkpoint import Checkpointer
from phalanx.checkpoint import host as host_mod

pytestmark = pytest.mark.integration

TOKEN = "s3cret-token"


class Recorder(master_pb2_grpc.MasterServicer):
    """A master that only records ReportCheckpoint calls and refuses a wrong token."""

    def __init__(self) -> None:
        self.requests: list[master_pb2.ReportCheckpointRequest] = []
        self.arrived = threading.Event()

    def ReportCheckpoint(self, request: Any, context: Any) -> Any:
        if dict(context.invocation_metadata()).get("authorization") != f"Bearer {TOKEN}":
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "bad token")
        self.requests.append(request)
        self.arrived.set()
        return master_pb2.ReportCheckpointResponse(committed_checkpoint_step=request.step)


@pytest.fixture
def master() -> Iterator[tuple[Recorder, str]]:
    recorder = Recorder()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    master_pb2_grpc.add_MasterServicer_to_server(recorder, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield recorder, f"127.0.0.1:{port}"
    server.stop(grace=None)


def test_persisted_shard_is_reported_to_the_master(
    master: tuple[Recorder, str], job_id: str, store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    recorder, addr = master
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    handle = host_mod.start(
        job_id=job_id,
        storage=str(store),
        socket_path=tmp_path / "h.sock",
        master_addr=addr,
        token_file=str(token),
        node_id="node-0",
        incarnation="inc-1",
    )
    for key, value in handle.env().items():
        monkeypatch.setenv(key, value)
    try:
        ckpt = Checkpointer()
        ckpt.save(12, {"w": torch.ones(8)}, persist=True)
        ckpt.wait()
        ckpt.close()
        assert recorder.arrived.wait(10)
    finally:
        handle.stop()
    (request,) = recorder.requests
    assert request.step == 12
    assert request.state == master_pb2.CHECKPOINT_STATE_PERSISTED
    assert list(request.ranks) == [0]
    assert request.world_size == 1
    assert request.node_id == "node-0"
    assert request.incarnation == "inc-1"
    assert request.path.endswith("step-000000000012")
