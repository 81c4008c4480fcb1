"""Starts the real ``phalanx master`` process for integration tests and talks to it over real sockets."""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import httpx

from phalanx.api.v1 import master_pb2 as pb
from phalanx.api.v1 import master_pb2_grpc as pb_grpc

TOKEN = "s3cret-token-for-tests"


class Master:
    """One master process; ``grpc`` and ``http`` are the addresses from its first two stdout lines."""

    def __init__(
        self, tmp: Path, *args: str, state: Path | None = None, ports: tuple[int, int] = (0, 0)
    ) -> None:
        token_file = tmp / "token"
        token_file.write_text(TOKEN + "\n")
        self.stderr_path = tmp / f"master-{time.monotonic_ns()}.stderr"
        cmd = [
            sys.executable,
            "-m",
            "phalanx.cli.main",
            "master",
            "--job-id",
            "test-job",
            "--port",
            str(ports[0]),
            "--http-port",
            str(ports[1]),
            "--token-file",
            str(token_file),
            "--state",
            str(state or tmp / "state.json"),
            *args,
        ]
        self._stderr = self.stderr_path.open("wb")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self._stderr, env=env)
        self.grpc, self.http = self._addresses(timeout=20.0)
        self.channel = grpc.insecure_channel(self.grpc)
        self.stub = pb_grpc.MasterStub(self.channel)
        self.client = httpx.Client(
            base_url=f"http://{self.http}", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10.0
        )

    def _addresses(self, *, timeout: float) -> tuple[str, str]:
        assert self.proc.stdout is not None
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        lines: list[str] = []
        buf = b""
        deadline = time.monotonic() + timeout
        while len(lines) < 2:
            if not sel.select(max(0.0, deadline - time.monotonic())):
                raise AssertionError(f"master printed no addresses in {timeout}s: {self.stderr()}")
            chunk = os.read(self.proc.stdout.fileno(), 4096)
            if not chunk:
                raise AssertionError(f"master exited ({self.proc.wait()}): {self.stderr()}")
            buf += chunk
            *done, buf_rest = buf.split(b"\n")
            lines.extend(d.decode() for d in done)
            buf = buf_rest
        sel.close()
        grpc_line, http_line = lines[0], lines[1]
        assert grpc_line.startswith("PHALANX_MASTER_GRPC="), grpc_line
        assert http_line.startswith("PHALANX_MASTER_HTTP="), http_line
        return grpc_line.split("=", 1)[1], http_line.split("=", 1)[1]

    @property
    def ports(self) -> tuple[int, int]:
        return int(self.grpc.rsplit(":", 1)[1]), int(self.http.rsplit(":", 1)[1])

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")[-4000:]

    def job(self) -> dict[str, Any]:
        r = self.client.get("/v1/job")
        r.raise_for_status()
        return dict(r.json())

    def events(self, since: int = 0) -> list[dict[str, Any]]:
        return list(self.client.get("/v1/events", params={"since": since}).json()["events"])

    def wait_for(self, predicate: Any, *, timeout: float, what: str) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            job = self.job()
            if predicate(job):
                return job
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}; job: {job}")
            time.sleep(0.1)

    def stop(self, sig: int = signal.SIGTERM, *, timeout: float = 10.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self.close()
        return code

    def close(self) -> None:
        self.channel.close()
        self.client.close()
        if self.proc.stdout:
            self.proc.stdout.close()
        self._stderr.close()


AUTH = (("authorization", f"Bearer {TOKEN}"),)


class Agent:
    """A fake node agent: plain gRPC calls, as phalanx-run would make them."""

    def __init__(self, master: Master, node_id: str, *, nproc: int = 2, incarnation: str = "") -> None:
        self.stub = master.stub
        self.node_id = node_id
        self.nproc = nproc
        self.incarnation = incarnation or f"{node_id}-{time.monotonic_ns()}"
        self.round = 0

    def register(self) -> pb.RegisterNodeResponse:
        req = pb.RegisterNodeRequest(
            job_id="test-job",
            node_id=self.node_id,
            incarnation=self.incarnation,
            host="127.0.0.1",
            nproc_per_node=self.nproc,
        )
        return self.stub.RegisterNode(req, metadata=AUTH, timeout=10)

    def join(self, port: int) -> int:
        req = pb.JoinRendezvousRequest(
            node_id=self.node_id,
            incarnation=self.incarnation,
            nproc_per_node=self.nproc,
            store_host="127.0.0.1",
            store_port=port,
            last_round=self.round,
        )
        return int(self.stub.JoinRendezvous(req, metadata=AUTH, timeout=10).round)

    def get(self, round: int, *, wait_s: float = 10.0) -> pb.GetRendezvousResponse:
        req = pb.GetRendezvousRequest(
            node_id=self.node_id, incarnation=self.incarnation, round=round, wait_s=wait_s
        )
        resp = self.stub.GetRendezvous(req, metadata=AUTH, timeout=wait_s + 10)
        if resp.status == pb.RENDEZVOUS_STATUS_COMPLETE:
            self.round = resp.round
        return resp

    def heartbeat(self, *, step: int = -1, wait_s: float = 0.0) -> list[pb.Action]:
        ranks = [pb.RankProgress(rank=0, step=step)] if step >= 0 else []
        req = pb.HeartbeatRequest(
            node_id=self.node_id,
            incarnation=self.incarnation,
            state=pb.NODE_STATE_RUNNING,
            round=self.round,
            ranks=ranks,
            wait_s=wait_s,
        )
        return list(self.stub.Heartbeat(req, metadata=AUTH, timeout=wait_s + 10).actions)

    def fail(self, *, rank: int, message: str) -> pb.Action:
        req = pb.ReportFailureRequest(
            node_id=self.node_id,
            incarnation=self.incarnation,
            round=self.round,
            kind=pb.FAILURE_KIND_WORKER_EXIT,
            failures=[
                pb.WorkerFailure(
                    rank=rank,
                    exit_code=1,
                    failure_class=pb.FAILURE_CLASS_UNKNOWN,
                    error_message=message,
                    observed_unix_ns=time.time_ns(),
                    log_tail=["line 1", "line 2"],
                )
            ],
        )
        return self.stub.ReportFailure(req, metadata=AUTH, timeout=10).action

    def complete(self) -> pb.Action:
        req = pb.ReportCompletionRequest(node_id=self.node_id, incarnation=self.incarnation, round=self.round)
        return self.stub.ReportCompletion(req, metadata=AUTH, timeout=10).action
