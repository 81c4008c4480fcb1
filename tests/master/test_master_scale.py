"""One master process keeps up with 1,000 nodes heartbeating at 1 Hz (real gRPC, real process)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import grpc
import pytest

from phalanx.api.v1 import master_pb2 as pb
from phalanx.api.v1 import master_pb2_grpc as pb_grpc

from .procs import AUTH, Master

pytestmark = pytest.mark.integration

NODES = 1000
SECONDS = 8.0


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


async def load(addr: str, pid: int) -> dict[str, float]:
    async with grpc.aio.insecure_channel(addr) as channel:
        stub = pb_grpc.MasterStub(channel)
        gate = asyncio.Semaphore(64)

        async def register(i: int) -> None:
            async with gate:
                req = pb.RegisterNodeRequest(
                    job_id="test-job", node_id=f"node-{i}", incarnation=f"inc-{i}", host="h", nproc_per_node=8
                )
                await stub.RegisterNode(req, metadata=AUTH, timeout=20)

        await asyncio.gather(*(register(i) for i in range(NODES)))
        latencies: list[float] = []
        errors: list[str] = []
        loop = asyncio.get_running_loop()
        start = loop.time() + 0.5
        end = start + SECONDS

        async def node(i: int) -> None:
            ranks = [pb.RankProgress(rank=i * 8 + r, local_rank=r, step=100) for r in range(8)]
            req = pb.HeartbeatRequest(
                node_id=f"node-{i}", incarnation=f"inc-{i}", state=pb.NODE_STATE_RUNNING, ranks=ranks
            )
            due = start + i / NODES  # spread the nodes evenly over the second, as real agents drift apart
            while due < end:
                await asyncio.sleep(max(0.0, due - loop.time()))
                t0 = time.perf_counter()
                try:
                    await stub.Heartbeat(req, metadata=AUTH, timeout=10)
                    latencies.append(time.perf_counter() - t0)
                except grpc.RpcError as exc:
                    errors.append(str(exc.code()))
                due += 1.0

        await asyncio.sleep(max(0.0, start - loop.time()))
        cpu0, wall0 = cpu_seconds(pid), time.monotonic()
        await asyncio.gather(*(node(i) for i in range(NODES)))
        cpu = (cpu_seconds(pid) - cpu0) / (time.monotonic() - wall0)
    latencies.sort()
    assert not errors, f"{len(errors)} heartbeats failed, e.g. {errors[:3]}"
    return {
        "answered": len(latencies),
        "p50": latencies[len(latencies) // 2],
        "p99": latencies[int(len(latencies) * 0.99)],
        "cpu": cpu,
    }


def master_side(metrics: str) -> tuple[float, float]:
    """(p99 upper bound of the master's Heartbeat handling time, its event-loop lag) from /metrics."""
    buckets = []
    lag = float("nan")
    for line in metrics.splitlines():
        if line.startswith("phalanx_rpc_duration_seconds_bucket{") and 'method="Heartbeat"' in line:
            le = line.split('le="', 1)[1].split('"', 1)[0]
            buckets.append((float(le), float(line.rsplit(" ", 1)[1])))
        elif line.startswith("phalanx_event_loop_lag_seconds "):
            lag = float(line.split()[1])
    buckets.sort()
    total = buckets[-1][1]
    p99 = next(le for le, cumulative in buckets if cumulative >= 0.99 * total)
    return p99, lag


@pytest.mark.timeout(60)
def test_thousand_nodes_at_one_hertz(tmp_path: Path) -> None:
    master = Master(tmp_path, "--nodes", f"1:{NODES}", "--heartbeat-timeout", "10")
    try:
        result = asyncio.run(load(master.grpc, master.proc.pid))
        p99_master, lag = master_side(master.client.get("/metrics").text)
        print(f"\n1000 nodes @1Hz: {result}; master-side p99 <= {p99_master}s, loop lag {lag:.3f}s")
        # All answered, none late enough to be declared lost, the master below one core and answering fast.
        # Client-side latency is printed, not asserted: on a shared 2-core machine it mostly measures how
        # long the test's own client waits for a CPU (the master is at ~0.3-0.5 of a core meanwhile).
        assert result["answered"] >= NODES * SECONDS * 0.95
        assert result["cpu"] < 1.0, result
        assert p99_master < 1.0
        assert lag < 1.0
        job = master.job()
        assert job["nodes_alive"] == NODES
        assert job["evictions"] == []
        assert job["max_step"] == 100
    finally:
        master.stop(signal.SIGKILL)
