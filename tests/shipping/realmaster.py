"""A real ``phalanx master`` process for the shipping tests (dashboards, alerts): started on free ports, its
addresses read from its first two stdout lines, and what its /metrics exposition offers."""

from __future__ import annotations

import contextlib
import os
import re
import selectors
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import grpc

from phalanx.api.v1 import master_pb2 as pb
from phalanx.api.v1 import master_pb2_grpc as pb_grpc

TOKEN = "dash-test-token-0123"


@contextlib.contextmanager
def running_master(tmp: Path, *, job_id: str, args: Sequence[str] = ()) -> Iterator[tuple[str, str]]:
    """A ``phalanx master`` for one job of one node (unless ``args`` say otherwise), accepting :data:`TOKEN`;
    yields its (gRPC, HTTP) addresses and stops it afterwards."""
    proc, grpc_addr, http_addr = start_master(tmp, job_id=job_id, args=args)
    try:
        yield grpc_addr, http_addr
    finally:
        proc.terminate()
        proc.wait(20)
        assert proc.stdout is not None
        proc.stdout.close()


AUTH = (("authorization", f"Bearer {TOKEN}"),)


def node_reports(grpc_addr: str, *, job_id: str, step: int = -1) -> None:
    """Node ``n0`` registers and heartbeats (rank 0 at ``step``): the RPC histogram gets real series."""
    with grpc.insecure_channel(grpc_addr) as channel:
        stub = pb_grpc.MasterStub(channel)
        stub.RegisterNode(
            pb.RegisterNodeRequest(
                job_id=job_id, node_id="n0", incarnation="i0", host="127.0.0.1", nproc_per_node=1
            ),
            metadata=AUTH,
            timeout=10,
        )
        ranks = [pb.RankProgress(rank=0, local_rank=0, step=step)] if step >= 0 else []
        request = pb.HeartbeatRequest(node_id="n0", incarnation="i0", ranks=ranks)
        stub.Heartbeat(request, metadata=AUTH, timeout=10)


def nodes_step(grpc_addr: str, *, job_id: str, step_s: Mapping[str, float], beats: int = 8) -> None:
    """The nodes of ``step_s`` register, form a rendezvous round, and report ``beats`` heartbeats each, their
    one rank stepping every ``step_s[node]`` seconds (times as reported, so the beats need not be spaced):
    the master's step-time check then scores them (per-node step times and straggler scores)."""
    with grpc.insecure_channel(grpc_addr) as channel:
        stub = pb_grpc.MasterStub(channel)
        for i, node in enumerate(step_s):
            stub.RegisterNode(
                pb.RegisterNodeRequest(
                    job_id=job_id, node_id=node, incarnation="i0", host="127.0.0.1", nproc_per_node=1
                ),
                metadata=AUTH,
                timeout=10,
            )
            join = pb.JoinRendezvousRequest(
                node_id=node, incarnation="i0", nproc_per_node=1, store_host="127.0.0.1", store_port=29500 + i
            )
            round_ = stub.JoinRendezvous(join, metadata=AUTH, timeout=10).round
        for node in step_s:
            got = pb.GetRendezvousRequest(node_id=node, incarnation="i0", round=round_, wait_s=5)
            answer = stub.GetRendezvous(got, metadata=AUTH, timeout=10)
            assert answer.status == pb.RENDEZVOUS_STATUS_COMPLETE, answer
        start = time.time()
        for beat in range(1, beats + 1):
            for node, every in step_s.items():
                rank = pb.RankProgress(
                    rank=list(step_s).index(node),
                    step=beat * 10,
                    step_unix_ns=int((start + beat * 10 * every) * 1e9),
                )
                request = pb.HeartbeatRequest(
                    node_id=node, incarnation="i0", state=pb.NODE_STATE_RUNNING, round=round_, ranks=[rank]
                )
                stub.Heartbeat(request, metadata=AUTH, timeout=10)


def persist_fails(grpc_addr: str, *, step: int) -> None:
    """Node ``n0`` (registered by :func:`node_reports`) reports that persisting ``step`` failed."""
    with grpc.insecure_channel(grpc_addr) as channel:
        request = pb.ReportCheckpointRequest(
            node_id="n0", incarnation="i0", step=step, state=pb.CHECKPOINT_STATE_FAILED,
            error="No space left on device",
        )  # fmt: skip
        pb_grpc.MasterStub(channel).ReportCheckpoint(request, metadata=AUTH, timeout=10)


def start_master(
    tmp: Path, *, job_id: str, args: Sequence[str] = ()
) -> tuple[subprocess.Popen[bytes], str, str]:
    token_file = tmp / "token"
    token_file.write_text(TOKEN + "\n")
    phalanx = Path(sys.executable).parent / "phalanx"
    cmd = [str(phalanx), "master", "--job-id", job_id, "--nodes", "1:1", "--port", "0"]
    cmd += ["--http-port", "0", "--token-file", str(token_file), "--state", str(tmp / "state.json"), *args]
    with (tmp / "master.stderr").open("wb") as stderr:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr)
    assert proc.stdout is not None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    buf = b""
    deadline = time.monotonic() + 30
    while buf.count(b"\n") < 2:
        if not sel.select(max(0.0, deadline - time.monotonic())):
            proc.kill()
            proc.wait()
            proc.stdout.close()
            raise AssertionError(f"master printed no addresses: {(tmp / 'master.stderr').read_text()}")
        chunk = os.read(proc.stdout.fileno(), 4096)
        if not chunk:
            proc.stdout.close()
            raise AssertionError(f"master exited {proc.wait()}: {(tmp / 'master.stderr').read_text()}")
        buf += chunk
    sel.close()
    grpc_line, http_line = buf.decode().splitlines()[:2]
    assert grpc_line.startswith("PHALANX_MASTER_GRPC=")
    assert http_line.startswith("PHALANX_MASTER_HTTP=")
    return proc, grpc_line.split("=", 1)[1], http_line.split("=", 1)[1]


def exported_series(text: str) -> tuple[set[str], set[str]]:
    """(sample names, label names) a Prometheus text exposition offers, families without samples included."""
    names: set[str] = set()
    labels: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, family, kind = line.split(" ", 3)
            base = family.removesuffix("_total")
            suffixes = {
                "counter": ["_total"],
                "histogram": ["_bucket", "_sum", "_count"],
                "summary": ["_sum", "_count", ""],
            }.get(kind, [""])
            names.update(base + s for s in suffixes)
        elif line and not line.startswith("#"):
            sample = re.match(r"([a-zA-Z_:][\w:]*)(\{[^}]*\})?", line)
            assert sample, line
            names.add(sample[1])
            labels.update(re.findall(r'(\w+)="', sample[2] or ""))
    return names, labels
