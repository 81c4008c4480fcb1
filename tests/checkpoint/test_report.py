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
from phalanx.checkpoint import Checkpointer, storage
from phalanx.checkpoint import host as host_mod

pytestmark = pytest.mark.integration

TOKEN = "s3cret-token"


class Recorder(master_pb2_grpc.MasterServicer):
    """A master that only records ReportCheckpoint calls and refuses a wrong token."""

    def __init__(self) -> None:
        self.requests: list[master_pb2.ReportCheckpointRequest] = []
        self.arrived = threading.Event()
        self.answering = threading.Event()
        """Cleared: the master takes each call and does not answer (a partitioned or overloaded one)."""
        self.answering.set()

    def ReportCheckpoint(self, request: Any, context: Any) -> Any:
        if dict(context.invocation_metadata()).get("authorization") != f"Bearer {TOKEN}":
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "bad token")
        self.requests.append(request)
        self.arrived.set()
        self.answering.wait(30)
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


def _reporting_host(
    addr: str, job_id: str, store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> host_mod.HostHandle:
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
    return handle


def test_persisted_shard_is_reported_to_the_master(
    master: tuple[Recorder, str], job_id: str, store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    recorder, addr = master
    handle = _reporting_host(addr, job_id, store, tmp_path, monkeypatch)
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


def test_persisting_goes_on_while_the_master_does_not_answer(
    master: tuple[Recorder, str], job_id: str, store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reports wait for the master; the shards do not: each is on storage (and the trainer's wait
    returns) while the master still holds the first report. Then every report arrives, in order."""
    recorder, addr = master
    recorder.answering.clear()
    handle = _reporting_host(addr, job_id, store, tmp_path, monkeypatch)
    try:
        ckpt = Checkpointer()
        for step in (1, 2, 3):
            ckpt.save(step, {"w": torch.full((8,), float(step))}, persist=True)
            assert [r["step"] for r in ckpt.wait(timeout_s=5)] == [step]
        assert storage.committed_steps(storage.LocalStorage(store)) == [2, 3]  # keep_last=2
        assert recorder.arrived.wait(10)
        assert [r.step for r in recorder.requests] == [1]  # the master has not answered it yet
        recorder.answering.set()
        ckpt.close()
    finally:
        handle.stop()  # sends what is queued before the host exits
    assert [r.step for r in recorder.requests] == [1, 2, 3]
