"""Master capacity: how many agent heartbeats per second one master process sustains on one core.

Starts the real ``phalanx master`` pinned to CPU 0 and drives it over real gRPC from client processes
pinned to the other CPUs. The nodes form one rendezvous round, and every heartbeat carries the progress of
8 ranks that step every 100 ms, as a node with 8 GPUs sends in training: the master's step-time bookkeeping
(per-rank intervals, the periodic straggler check) is part of the cost.
Phases, the first three with one unary ``Heartbeat`` call per beat, the last two on ``HeartbeatStream``
(one long-lived stream per node, one message each way per beat, the token checked once per stream):

* ``paced``: ``--nodes`` nodes heartbeating at 1 Hz, answered at once (agents before held heartbeats);
* ``held``: ``--nodes`` nodes each keeping one heartbeat held by the master (``wait_s`` = the 1 s interval),
  the pattern of agents against a master without the stream: about ``--nodes`` answers per second;
* ``saturated``: closed loop, ``--concurrency`` calls in flight, as fast as the master answers;
* ``stream_held``: ``held`` on streams, the agent's pattern now;
* ``stream_saturated``: closed loop on ``--concurrency`` streams, a beat answered at once (``wait_s`` 0)
  followed by the next, as fast as the master answers.

Each phase measures a training job: the held phases and the saturated ones run on masters of their own,
whose nodes formed a round (the clients of a held phase cut their nodes' connections as they exit, and the
job then opens a round without them), and every phase is checked to have ended before any new round opened.

For each: heartbeats answered per second, p50/p99/max latency, and the master's CPU use from
``/proc/<pid>/stat`` (1.0 = one core). When the master is below ~90% of its core in a saturated phase
the clients were the bottleneck (this is a Python client against a Python server); then that phase's
capacity per core is extrapolated as answered/s divided by the master's CPU fraction, and the JSON
says so (``capacity_per_core`` for calls, ``stream_capacity_per_core`` for streams). ``--clients``
spreads the load over more client processes (the client CPUs are shared among them). ``--baseline-src``
runs the saturated phases (unary and streams; ``--baseline-unary-only`` for a master without streams) once
more against another source tree's master (the code before a change) in the same run, for a fair
before/after; ``--repeat N`` alternates the saturated phases N times and
reports the median run of each (with every run's rate beside it); ``--grpc-floor`` drives both saturated
loads against a no-op server too (answers at once, no token check, no job): gRPC's own cost, the floor.
``heartbeats_per_master_cpu_s`` is each phase's rate per second of the master's CPU: its cost per beat,
whatever share of its core a shared machine gave it. Prints one JSON object on the last line.

    .venv/bin/python -m benchmarks.master_capacity --nodes 1000 --seconds 10

The committed result, with the master before a change beside it (its sources unpacked from git):

    mkdir -p /tmp/before && git archive HEAD src | tar -x -C /tmp/before
    .venv/bin/python -m benchmarks.master_capacity --nodes 1000 --seconds 8 --repeat 3 --pin-clients \
        --grpc-floor --baseline-src /tmp/before/src --baseline-label "..." --note "what else ran"
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


def start_master(
    tmp: Path, nodes: int, cpu: int, *, source: str = "", noop: bool = False
) -> tuple[subprocess.Popen[bytes], str, str]:
    """The master, from ``source`` (a source tree's ``src``) instead of this checkout when given, or with
    ``noop`` the no-op server of :func:`noop_server_main`."""
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
    if noop:
        cmd = [sys.executable, "-m", "benchmarks.master_capacity", "--noop-server"]
    env = {**os.environ, "PHALANX_LOG_LEVEL": "WARNING"}
    if source:
        env["PYTHONPATH"] = source
    # Pinned before exec, so every thread of the master (gRPC's included) inherits the single CPU.
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=env,
        cwd=Path(__file__).resolve().parent.parent,
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


def server_side_quantiles(http: str, method: str = "Heartbeat") -> dict[str, Any]:
    """The master's own Heartbeat latency histogram: service time, free of client scheduling delays."""
    import httpx

    text = httpx.get(f"http://{http}/metrics", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10).text
    buckets: list[tuple[float, float]] = []
    for line in text.splitlines():
        if line.startswith("phalanx_rpc_duration_seconds_bucket{") and f'method="{method}"' in line:
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
        ended: list[float] = []
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

        async def streamed(k: int, *, wait_s: float, nodes: list[int]) -> None:
            """One stream per node of ``nodes``, used in turn (a stream answers its beats in order, so a
            closed loop needs one stream per beat in flight)."""
            nonlocal errors
            req = pb.HeartbeatRequest()
            streams = [stub.HeartbeatStream(metadata=AUTH) for _ in nodes]
            await asyncio.sleep(max(0.0, start + (k / count if wait_s else 0.0) - loop.time()))
            i = 0
            while loop.time() < end:
                req.CopyFrom(reqs[nodes[i % len(nodes)]])
                req.wait_s = wait_s
                call = streams[i % len(nodes)]
                t0 = time.perf_counter()
                try:
                    await call.write(stamp(req))
                    answer = await call.read()
                    if answer is grpc.aio.EOF:
                        raise RuntimeError("the master ended a heartbeat stream")
                    latencies.append(time.perf_counter() - t0)
                except grpc.RpcError:
                    errors += 1
                    streams[i % len(nodes)] = stub.HeartbeatStream(metadata=AUTH)
                i += 1
            ended.append(time.time())  # before the streams are cut: the nodes are gone from here on
            for call in streams:
                call.cancel()

        if mode == "paced":
            await asyncio.gather(*(paced(k) for k in range(count)))
        elif mode == "held":
            await asyncio.gather(*(held(k) for k in range(count)))
        elif mode == "stream_held":
            await asyncio.gather(*(streamed(k, wait_s=1.0, nodes=[k]) for k in range(count)))
        elif mode == "stream_closed":
            # ``concurrency`` streams in flight; the nodes spread over them (each beat its node's own).
            await asyncio.gather(
                *(
                    streamed(k, wait_s=0.0, nodes=list(range(k, count, concurrency)) or [k % count])
                    for k in range(concurrency)
                )
            )
        else:
            await asyncio.gather(*(closed(k) for k in range(concurrency)))
    return {"latencies": latencies, "errors": errors, "ended_unix": min(ended, default=time.time())}


def noop_server_main() -> int:
    """A phalanx.v1.Master whose Heartbeat and HeartbeatStream answer at once with a constant and do
    nothing else: gRPC's own cost per call and per stream message, the floor under the master's."""
    from grpc import aio

    from phalanx.api.v1 import master_pb2 as pb
    from phalanx.api.v1 import master_pb2_grpc as pb_grpc

    answer = pb.HeartbeatResponse(round=1, committed_checkpoint_step=-1)

    class Noop(pb_grpc.MasterServicer):  # type: ignore[misc]
        async def Heartbeat(self, request: Any, context: Any) -> Any:
            return answer

        async def HeartbeatStream(self, requests: Any, context: Any) -> Any:
            async for _ in requests:
                yield answer

    async def serve() -> None:
        server = aio.server(options=[("grpc.so_reuseport", 0)])
        pb_grpc.add_MasterServicer_to_server(Noop(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        print(f"PHALANX_MASTER_GRPC=127.0.0.1:{port}", flush=True)
        print("PHALANX_MASTER_HTTP=-", flush=True)
        await server.wait_for_termination()

    asyncio.run(serve())
    return 0


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
    job = job_view(http)
    if job["round"] != 1 or len(job["members"]) != nodes:
        raise RuntimeError(f"the round did not form with all {nodes} nodes: round {job['round']}")


def job_view(http: str) -> dict[str, Any]:
    import httpx

    headers = {"Authorization": f"Bearer {TOKEN}"}
    return dict(httpx.get(f"http://{http}/v1/job", headers=headers, timeout=10).json())


def check_steady(http: str, name: str, *, until_unix: float) -> None:
    """No new round opened before ``until_unix``, when phase ``name``'s load ended: what the phase measured is
    the heartbeat of a training job (its step times kept, no REJOIN answered), not of a job restarting
    because the clients of an earlier phase went away. (Its own clients' streams, cancelled as they exit,
    are nodes gone, after the load.)"""
    import httpx

    headers = {"Authorization": f"Bearer {TOKEN}"}
    since = 0
    while True:
        page = httpx.get(
            f"http://{http}/v1/events", params={"since": since, "limit": 10_000}, headers=headers, timeout=10
        ).json()
        for event in page["events"]:
            if event["kind"] == "round_open" and event["unix"] < until_unix:
                raise RuntimeError(f"the job left its steady state during phase {name}: {event['message']}")
        if not page["events"]:
            return
        since = page["events"][-1]["seq"]


def phase(
    *,
    addr: str,
    pid: int,
    mode: str,
    nodes: int,
    seconds: float,
    concurrency: int,
    cpus: list[int],
    clients: int = 0,
) -> dict[str, Any]:
    clients = clients or (max(1, len(cpus)) if cpus else 1)
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
    ended: list[float] = []
    for out in outs:
        data = json.loads(out.decode().strip().splitlines()[-1])
        latencies.extend(data["latencies"])
        errors += data["errors"]
        ended.append(data["ended_unix"])
    latencies.sort()
    n = len(latencies)
    # The measured window includes up to ~1 s of client start-up slack; the rate uses the load window.
    return {
        "mode": mode,
        "nodes": nodes,
        "concurrency": concurrency if mode.endswith("closed") else None,
        "client_processes": clients,
        "seconds": seconds,
        "answered": n,
        "errors": errors,
        "heartbeats_per_s": round(n / seconds, 1),
        "p50_ms": round(latencies[n // 2] * 1000, 2) if n else None,
        "p99_ms": round(latencies[int(n * 0.99)] * 1000, 2) if n else None,
        "max_ms": round(latencies[-1] * 1000, 2) if n else None,
        "master_cpu_cores": round(cpu * wall / seconds, 3),
        # The master's cost per beat, free of how much of its core it got on a shared machine.
        "heartbeats_per_master_cpu_s": round(n / (cpu * wall), 0) if cpu > 0 else None,
        "load_ended_unix": min(ended),
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
    parser.add_argument(
        "--clients",
        type=int,
        default=0,
        help="client processes for the saturated phases (default: one per CPU)",
    )
    parser.add_argument("--note", default="", help="what else ran on the machine, recorded in the JSON")
    parser.add_argument(
        "--baseline-src",
        default="",
        help="also run the saturated unary phase against the master of this source tree's src/ (e.g. "
        "`git archive HEAD` unpacked), after the others, for a before/after in one run",
    )
    parser.add_argument("--baseline-label", default="", help="what the baseline is, for the JSON")
    parser.add_argument(
        "--baseline-unary-only",
        action="store_true",
        help="run only the unary phase against the baseline (a master from before the streams)",
    )
    parser.add_argument(
        "--grpc-floor",
        action="store_true",
        help="also drive a no-op server (gRPC's own cost: no token check, no job) with both saturated loads",
    )
    parser.add_argument("--noop-server", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--repeat", type=int, default=1, help="run the saturated phases this many times (medians reported)"
    )
    parser.add_argument(
        "--streams-only", action="store_true", help="only the two stream phases (a quick check while tuning)"
    )
    parser.add_argument(
        "--client",
        choices=["paced", "held", "closed", "stream_held", "stream_closed"],
        help=argparse.SUPPRESS,
    )
    parser.add_argument("--addr", help=argparse.SUPPRESS)
    parser.add_argument("--first", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--count", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.noop_server:
        return noop_server_main()
    if args.client:
        return client_main(args)

    available = sorted(os.sched_getaffinity(0))
    master_cpu, client_cpus = available[0], available[1:] or available
    pair = client_cpus[:2] if args.pin_clients else []
    every = client_cpus if args.pin_clients else []
    runs: dict[str, list[dict[str, Any]]] = {}

    def on_a_new_master(source: str, phases: list[tuple[str, str, dict[str, Any]]]) -> None:
        """Runs ``phases`` (name, client mode, arguments) in order against a master of its own, whose 1,000
        nodes formed a round, each phase checked to have left the job training (see check_steady). A
        phase whose clients leave a heartbeat held when they exit (the ``held`` ones) cuts its nodes'
        connections, so it is the last on its master: the job opens a round without them."""
        with tempfile.TemporaryDirectory() as tmp:
            proc, addr, http = start_master(Path(tmp), args.nodes, master_cpu, source=source)
            try:
                enroll_all(addr, http, args.nodes)
                common: dict[str, Any] = {
                    "addr": addr,
                    "pid": proc.pid,
                    "nodes": args.nodes,
                    "seconds": args.seconds,
                }
                for name, mode, kwargs in phases:
                    result = phase(mode=mode, **kwargs, **common)
                    check_steady(http, name, until_unix=result.pop("load_ended_unix"))
                    if name == "paced_1hz":
                        result["server_side"] = server_side_quantiles(http)
                    elif name == "stream_saturated":
                        result["server_side"] = server_side_quantiles(http, method="HeartbeatStream")
                    if source:
                        result["source"] = args.baseline_label or source
                    runs.setdefault(name, []).append(result)
            finally:
                proc.send_signal(signal.SIGTERM)
                proc.wait(30)

    saturated = {"concurrency": args.concurrency, "cpus": every, "clients": args.clients}
    paced = {"concurrency": 0, "cpus": pair}

    def measure(source: str, first: bool) -> None:
        if source:  # the baseline: the same saturated phases against the older master
            on_a_new_master(
                source,
                [("baseline_saturated", "closed", saturated)] * (not args.streams_only)
                + [("baseline_stream_saturated", "stream_closed", saturated)]
                * (not args.baseline_unary_only),
            )
            return
        if first and not args.streams_only:
            on_a_new_master("", [("paced_1hz", "paced", paced), ("held_1s", "held", paced)])
        if first:
            on_a_new_master("", [("stream_held_1s", "stream_held", paced)])
        on_a_new_master(
            "",
            [("saturated", "closed", saturated)] * (not args.streams_only)
            + [("stream_saturated", "stream_closed", saturated)],
        )

    # The saturated phases alternate, new master then baseline, ``--repeat`` times: on a shared machine
    # the load drifts, and alternating gives both the same drift.
    for i in range(args.repeat):
        measure("", first=i == 0)
        if args.baseline_src:
            measure(args.baseline_src, first=i == 0)

    def median_run(name: str) -> dict[str, Any]:
        """The run with the median rate, and every run's rate and CPU beside it."""
        ordered = sorted(runs[name], key=lambda r: r["heartbeats_per_s"])
        chosen = dict(ordered[(len(ordered) - 1) // 2])
        if len(ordered) > 1:
            chosen["repeats"] = [
                {"heartbeats_per_s": r["heartbeats_per_s"], "master_cpu_cores": r["master_cpu_cores"]}
                for r in runs[name]
            ]
        return chosen

    phases = {name: median_run(name) for name in runs}
    if args.grpc_floor:
        with tempfile.TemporaryDirectory() as tmp:
            proc, addr, _ = start_master(Path(tmp), args.nodes, master_cpu, noop=True)
            try:
                common = {"addr": addr, "pid": proc.pid, "nodes": args.nodes, "seconds": args.seconds}
                for name, mode in (("grpc_floor_unary", "closed"), ("grpc_floor_stream", "stream_closed")):
                    phases[name] = phase(mode=mode, **saturated, **common)
                    del phases[name]["load_ended_unix"]  # no job to check
            finally:
                proc.send_signal(signal.SIGTERM)
                proc.wait(30)

    def capacity(saturated: dict[str, Any]) -> dict[str, Any]:
        cpu = saturated["master_cpu_cores"]
        if cpu < 0.9 and cpu > 0:
            note = (
                "extrapolated: answered/s divided by the master's CPU fraction (the clients saturated first)"
            )
            return {
                "client_bound": True,
                "per_core": round(saturated["heartbeats_per_s"] / cpu, 0),
                "note": note,
            }
        note = "measured: the master's core was saturated"
        return {"client_bound": False, "per_core": saturated["heartbeats_per_s"], "note": note}

    result: dict[str, Any] = {
        "name": "master_capacity",
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": f"{len(available)} cores ({os.uname().nodename})",
        "note": args.note,
        "cpus": len(available),
        "master_pinned_to_cpu": master_cpu,
        "client_cpus": client_cpus,
        "clients_pinned": args.pin_clients,
        "repeat": args.repeat,
        **phases,
    }
    stream = capacity(phases["stream_saturated"])
    if "saturated" in phases:
        unary = capacity(phases["saturated"])
        result.update(
            client_bound=unary["client_bound"],
            capacity_per_core=unary["per_core"],
            capacity_note=unary["note"],
        )
    result.update(
        stream_client_bound=stream["client_bound"],
        stream_capacity_per_core=stream["per_core"],
        stream_capacity_note=stream["note"],
    )
    if result.get("capacity_per_core"):
        result["stream_vs_unary"] = round(stream["per_core"] / result["capacity_per_core"], 2)
    if "baseline_saturated" in phases:
        before = capacity(phases["baseline_saturated"])
        result["baseline_capacity_per_core"] = before["per_core"]
        result["stream_vs_baseline"] = (
            round(stream["per_core"] / before["per_core"], 2) if before["per_core"] else None
        )
    if "baseline_stream_saturated" in phases:
        # The agents' pattern against the same pattern of the older master: the change's own cost.
        before = capacity(phases["baseline_stream_saturated"])
        result["baseline_stream_capacity_per_core"] = before["per_core"]
        result["stream_vs_baseline_stream"] = (
            round(stream["per_core"] / before["per_core"], 2) if before["per_core"] else None
        )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
