"""Master capacity: how many agent heartbeats per second one master process sustains on one core.

Starts the real ``phalanx master`` pinned to CPU 0 and drives it over real gRPC from client processes
pinned to the other CPUs. The nodes form one rendezvous round, and every heartbeat carries the progress of
8 ranks that step every 100 ms, as a node with 8 GPUs sends in training: the master's step-time bookkeeping
(per-rank intervals, the periodic straggler check) is part of the cost.
Two phases:

* ``paced``: ``--nodes`` nodes heartbeating at 1 Hz, answered at once (agents before held heartbeats);
* ``held``: ``--nodes`` nodes each keeping one heartbeat held by the master (``wait_s`` = the 1 s interval),
  the agent's pattern now: the master answers each after the interval, so about ``--nodes`` per second;
* ``saturated``: closed loop, ``--concurrency`` calls in flight, as fast as the master answers.

For each: heartbeats answered per second, p50/p99/max latency, and the master's CPU use from
``/proc/<pid>/stat`` (1.0 = one core). When the master is below ~90% of its core in the saturated phase
the clients were the bottleneck (this is a Python client against a Python server); then
``capacity_per_core`` is extrapolated as answered/s divided by the master's CPU fraction, and the JSON
says so. Prints one JSON object on the last line.

    .venv/bin/python -m benchmarks.master_capacity --nodes 1000 --seconds 10
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

TOKEN = "benchmark-token-0123"
STEP_S = 0.1  # the simulated ranks' step time
AUTH = (("authorization", f"Bearer {TOKEN}"),)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_master(tmp: Path, nodes: int, cpu: int) -> tuple[subprocess.Popen[bytes], str, str]:
    (tmp / "token").write_text(TOKEN)
    cmd = [
        sys.executable,
        "-m",
        "phalanx.cli.main",
        "master",
        "--job-id",
        "capacity",
        "--nodes",
        f"{nodes}:{nodes}",  # the round forms once every node joined
        "--port",
        "0",
        "--http-port",
        "0",
        "--token-file",
        str(tmp / "token"),
        "--state",
        str(tmp / "state.json"),
        "--heartbeat-timeout",
        "30",
    ]
    env = {**os.environ, "PHALANX_LOG_LEVEL": "WARNING"}
    # Pinned before exec, so every thread of the master (gRPC's included) inherits the single CPU.
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=env,
        preexec_fn=lambda: os.sched_setaffinity(0, {cpu}),  # noqa: PLW1509 (no threads here yet)
    )
    assert proc.stdout is not None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    if not sel.select(30):
        raise RuntimeError("the master printed no address in 30s")
    line = proc.stdout.readline().decode().strip()
    http = proc.stdout.readline().decode().strip()
    if not line.startswith("PHALANX_MASTER_GRPC="):
        raise RuntimeError(f"unexpected first line {line!r}")
    return proc, line.split("=", 1)[1], http.split("=", 1)[1]


def server_side_quantiles(http: str) -> dict[str, Any]:
    """The master's own Heartbeat latency histogram: service time, free of client scheduling delays."""
    import httpx

    text = httpx.get(f"http://{http}/metrics", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10).text
    buckets: list[tuple[float, float]] = []
    for line in text.splitlines():
        if line.startswith("phalanx_rpc_duration_seconds_bucket{") and 'method="Heartbeat"' in line:
            le = line.split('le="', 1)[1].split('"', 1)[0]
            buckets.append((float(le), float(line.rsplit(" ", 1)[1])))
    buckets.sort()
    total = buckets[-1][1] if buckets else 0.0

    def quantile(q: float) -> float | None:
        for le, cumulative in buckets:
            if cumulative >= q * total:
                return le * 1000
        return None

    return {"heartbeats": total, "p50_ms_at_most": quantile(0.5), "p99_ms_at_most": quantile(0.99)}


# --------------------------------------------------------------------------------------------------------
# Client process


async def client(
    addr: str, *, mode: str, first: int, count: int, seconds: float, concurrency: int
) -> dict[str, Any]:
    import grpc

    from phalanx.api.v1 import master_pb2 as pb
    from phalanx.api.v1 import master_pb2_grpc as pb_grpc

    async with grpc.aio.insecure_channel(addr) as channel:
        stub = pb_grpc.MasterStub(channel)
        reqs = []
        for i in range(first, first + count):
            ranks = [pb.RankProgress(rank=i * 8 + r, local_rank=r, step=0) for r in range(8)]
            reqs.append(
                pb.HeartbeatRequest(
                    node_id=f"node-{i}",
                    incarnation=f"inc-{i}",
                    state=pb.NODE_STATE_RUNNING,
                    round=1,
                    ranks=ranks,
                )
            )
        began = time.monotonic()

        def stamp(req: Any) -> Any:
            """The ranks' progress now: a step every STEP_S since the client began, ended just now."""
            step, now_ns = int((time.monotonic() - began) / STEP_S), time.time_ns()
            for rank in req.ranks:
                rank.step = step
                rank.step_unix_ns = now_ns
            return req

        await stub.Heartbeat(reqs[0], metadata=AUTH, timeout=30)  # connect before the clock starts
        latencies: list[float] = []
        errors = 0
        loop = asyncio.get_running_loop()
        start = loop.time() + 0.2
        end = start + seconds

        async def paced(k: int) -> None:
            nonlocal errors
            due = start + k / count
            while due < end:
                await asyncio.sleep(max(0.0, due - loop.time()))
                t0 = time.perf_counter()
                try:
                    await stub.Heartbeat(stamp(reqs[k]), metadata=AUTH, timeout=10)
                    latencies.append(time.perf_counter() - t0)
                except grpc.RpcError:
                    errors += 1
                due += 1.0

        async def held(k: int) -> None:
            nonlocal errors
            req = pb.HeartbeatRequest()
            req.CopyFrom(reqs[k])
            req.wait_s = 1.0
            await asyncio.sleep(max(0.0, start + k / count - loop.time()))
            while loop.time() < end:
                t0 = time.perf_counter()
                try:
                    await stub.Heartbeat(stamp(req), metadata=AUTH, timeout=10)
                    latencies.append(time.perf_counter() - t0)
                except grpc.RpcError:
                    errors += 1

        async def closed(k: int) -> None:
            nonlocal errors
            await asyncio.sleep(max(0.0, start - loop.time()))
            i = k
            while loop.time() < end:
                t0 = time.perf_counter()
                try:
                    await stub.Heartbeat(stamp(reqs[i % count]), metadata=AUTH, timeout=10)
                    latencies.append(time.perf_counter() - t0)
                except grpc.RpcError:
                    errors += 1
                i += concurrency

        if mode == "paced":
            await asyncio.gather(*(paced(k) for k in range(count)))
        elif mode == "held":
            await asyncio.gather(*(held(k) for k in range(count)))
        else:
            await asyncio.gather(*(closed(k) for k in range(concurrency)))
    return {"latencies": latencies, "errors": errors}


def client_main(args: argparse.Namespace) -> int:
    result = asyncio.run(
        client(
            args.addr,
            mode=args.client,
            first=args.first,
            count=args.count,
            seconds=args.seconds,
            concurrency=args.concurrency,
        )
    )
    print(json.dumps(result))
    return 0


# --------------------------------------------------------------------------------------------------------
# Driver


def enroll_all(addr: str, http: str, nodes: int) -> None:
    """Every node registers and joins the rendezvous; the round forms with all of them (checked through
    /v1/job)."""
    import grpc
    import httpx

    from phalanx.api.v1 import master_pb2 as pb
    from phalanx.api.v1 import master_pb2_grpc as pb_grpc

    async def run() -> None:
        async with grpc.aio.insecure_channel(addr) as channel:
            stub = pb_grpc.MasterStub(channel)
            gate = asyncio.Semaphore(64)

            async def one(i: int) -> None:
                node, inc = f"node-{i}", f"inc-{i}"
                async with gate:
                    reg = pb.RegisterNodeRequest(
                        job_id="capacity", node_id=node, incarnation=inc, host="h", nproc_per_node=8
                    )
                    await stub.RegisterNode(reg, metadata=AUTH, timeout=30)
                    join = pb.JoinRendezvousRequest(
                        node_id=node,
                        incarnation=inc,
                        nproc_per_node=8,
                        store_host="h",
                        store_port=20000 + i % 40000,
                    )
                    await stub.JoinRendezvous(join, metadata=AUTH, timeout=30)

            await asyncio.gather(*(one(i) for i in range(nodes)))

    asyncio.run(run())
    job = httpx.get(f"http://{http}/v1/job", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10).json()
    if job["round"] != 1 or len(job["members"]) != nodes:
        raise RuntimeError(f"the round did not form with all {nodes} nodes: round {job['round']}")


def phase(
    *, addr: str, pid: int, mode: str, nodes: int, seconds: float, concurrency: int, cpus: list[int]
) -> dict[str, Any]:
    clients = max(1, len(cpus)) if cpus else 1
    per = nodes // clients
    procs = []
    for c in range(clients):
        count = per if c < clients - 1 else nodes - per * (clients - 1)
        cmd = [
            sys.executable,
            "-m",
            "benchmarks.master_capacity",
            "--client",
            mode,
            "--addr",
            addr,
            "--first",
            str(c * per),
            "--count",
            str(count),
            "--seconds",
            str(seconds),
            "--concurrency",
            str(max(1, concurrency // clients)),
        ]
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, cwd=Path(__file__).resolve().parent.parent)
        if cpus:
            os.sched_setaffinity(p.pid, {cpus[c % len(cpus)]})
        procs.append(p)
    time.sleep(1.0)  # client start-up (imports) must not count as idle master time
    cpu0, wall0 = cpu_seconds(pid), time.monotonic()
    outs = [p.communicate(timeout=seconds + 120)[0] for p in procs]
    wall = time.monotonic() - wall0
    cpu = (cpu_seconds(pid) - cpu0) / wall
    latencies: list[float] = []
    errors = 0
    for out in outs:
        data = json.loads(out.decode().strip().splitlines()[-1])
        latencies.extend(data["latencies"])
        errors += data["errors"]
    latencies.sort()
    n = len(latencies)
    # The measured window includes up to ~1 s of client start-up slack; the rate uses the load window.
    return {
        "mode": mode,
        "nodes": nodes,
        "concurrency": concurrency if mode == "closed" else None,
        "seconds": seconds,
        "answered": n,
        "errors": errors,
        "heartbeats_per_s": round(n / seconds, 1),
        "p50_ms": round(latencies[n // 2] * 1000, 2) if n else None,
        "p99_ms": round(latencies[int(n * 0.99)] * 1000, 2) if n else None,
        "max_ms": round(latencies[-1] * 1000, 2) if n else None,
        "master_cpu_cores": round(cpu * wall / seconds, 3),
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument(
        "--pin-clients", action="store_true", help="pin the clients to the other CPUs (a quiet machine only)"
    )
    parser.add_argument("--client", choices=["paced", "held", "closed"], help=argparse.SUPPRESS)
    parser.add_argument("--addr", help=argparse.SUPPRESS)
    parser.add_argument("--first", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--count", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:
        return client_main(args)

    available = sorted(os.sched_getaffinity(0))
    master_cpu, client_cpus = available[0], available[1:] or available
    with tempfile.TemporaryDirectory() as tmp:
        proc, addr, http = start_master(Path(tmp), args.nodes, master_cpu)
        try:
            enroll_all(addr, http, args.nodes)
            common = {"addr": addr, "pid": proc.pid, "nodes": args.nodes, "seconds": args.seconds}
            paced = phase(
                mode="paced", concurrency=0, cpus=client_cpus[:2] if args.pin_clients else [], **common
            )  # type: ignore[arg-type]
            paced["server_side"] = server_side_quantiles(http)
            held = phase(
                mode="held", concurrency=0, cpus=client_cpus[:2] if args.pin_clients else [], **common
            )  # type: ignore[arg-type]
            closed = phase(
                mode="closed",
                concurrency=args.concurrency,
                cpus=client_cpus if args.pin_clients else [],
                **common,
            )  # type: ignore[arg-type]
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
    cpu = closed["master_cpu_cores"]
    client_bound = cpu < 0.9
    result = {
        "name": "master_capacity",
        "cpus": len(available),
        "master_pinned_to_cpu": master_cpu,
        "client_cpus": client_cpus,
        "paced_1hz": paced,
        "held_1s": held,
        "saturated": closed,
        "client_bound": client_bound,
        "capacity_per_core": round(closed["heartbeats_per_s"] / cpu, 0)
        if client_bound and cpu > 0
        else closed["heartbeats_per_s"],
        "capacity_note": (
            "extrapolated: answered/s divided by the master's CPU fraction (the clients saturated first)"
            if client_bound
            else "measured: the master's core was saturated"
        ),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
