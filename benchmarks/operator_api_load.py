"""The operator's load on the Kubernetes API server: requests per job per minute at steady state.

Starts a real control plane (tests/k8s/k8s_harness: etcd, kube-apiserver, kube-controller-manager,
kube-scheduler), creates ``--jobs`` ElasticJobs and runs ``phalanx operator`` (the chart's default
reconcile interval, 2 s). No kubelet: the Pods stay Pending, so the operator's requests are the only ones
that depend on the jobs (no master patches status, no kubelet reports Pods). Once every job has its master
and worker Pods, the API server's own counter ``apiserver_request_total`` (by verb, resource, subresource)
is read before and after a ``--window`` of seconds with the operator running, then over the same window with
the operator stopped (the controllers' and scheduler's requests); the difference is the operator's.
A WATCH counts when it ends (the operator's reconnects).

With ``--masters M`` the first M jobs also get their master: a real ``phalanx master --state
k8s://load/job-NNN`` process each, run here (no kubelet), with a kubeconfig holding the token of the job's
own master ServiceAccount (so it works under the Role the operator made), and training progress from real
gRPC heartbeats: one node per job registers, joins the rendezvous and then heartbeats every second (the
agent's default) with one rank whose step advances every 100 ms. The windows are then: everything running;
the masters and their nodes stopped (the operator alone); the operator stopped too (the control plane's
own). The differences are the masters' and the operator's requests, reported per job per minute separately.
``--idle`` runs the masters without nodes: a job waiting for its Pods, or suspended, changes nothing.

``--operator-src DIR`` runs the operator and the masters from another source tree (e.g. ``git archive HEAD``
unpacked) to measure a version before a change on the same machine; the nodes' gRPC client is this tree's.
``--compare-src DIR`` runs a second operator from another tree right after the first, on the same control
plane and jobs (side by side in one run), and reports both and their ratio.
Writes one JSON object to ``--out`` (default benchmarks/results/operator_api_load.json) and prints it.

    .venv/bin/python -m benchmarks.operator_api_load --jobs 50 --window 60
    .venv/bin/python -m benchmarks.operator_api_load --jobs 50 --masters 20 --window 60 \\
        --out benchmarks/results/operator_api_load_masters.json
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "k8s"))

from k8s_harness.controlplane import ControlPlane, find_binaries, write_kubeconfig  # noqa: E402

NAMESPACE = "load"
NODE_TOKEN = "api-load-benchmark-token-0123456789"
HEARTBEAT_S = 1.0  # the agent's default heartbeat interval
STEP_S = 0.1  # the simulated rank's step time
SAMPLE = re.compile(r"^apiserver_request_total\{(?P<labels>[^}]*)\} (?P<value>\S+)$")


def requests(cp: ControlPlane) -> Counter[tuple[str, str, str]]:
    """apiserver_request_total summed by (verb, resource, subresource)."""
    totals: Counter[tuple[str, str, str]] = Counter()
    for line in cp.kubectl("get", "--raw", "/metrics").splitlines():
        m = SAMPLE.match(line)
        if not m:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m["labels"]))
        totals[(labels.get("verb", ""), labels.get("resource", ""), labels.get("subresource", ""))] += int(
            float(m["value"])
        )
    return totals


def job_manifests(count: int) -> str:
    docs = [d for d in yaml.safe_load_all((ROOT / "examples" / "elasticjob.yaml").read_text()) if d]
    job = next(d for d in docs if d["kind"] == "ElasticJob")
    out = []
    for i in range(count):
        j = copy.deepcopy(job)
        j["metadata"] = {"name": f"job-{i:03d}", "namespace": NAMESPACE}
        out.append(j)
    return yaml.safe_dump_all(out)


def start_operator(cp: ControlPlane, src: Path, log: Path) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "KUBECONFIG": str(cp.kubeconfig),  # the admin: the request count does not depend on the identity
        "PYTHONPATH": str(src),
        "PHALANX_OPERATOR_RECONCILE_INTERVAL_S": "2",
        "PHALANX_OPERATOR_HTTP_PORT": "0",
        "PHALANX_OPERATOR_LEASE_NAMESPACE": "default",
    }
    env.pop("KUBERNETES_SERVICE_HOST", None)
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "phalanx", "operator"],
            stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=src.parent,
        )  # fmt: skip


def pods_made(cp: ControlPlane) -> int:
    return len(cp.kubectl("get", "pods", "-n", NAMESPACE, "-o", "name").split())


def delta(after: Counter[tuple[str, str, str]], before: Counter[tuple[str, str, str]]) -> Counter[Any]:
    return Counter({k: after[k] - before[k] for k in after if after[k] - before[k] > 0})


# --------------------------------------------------------------------------------------------------------
# Masters and their nodes


def start_master(cp: ControlPlane, src: Path, state: Path, job: str) -> tuple[subprocess.Popen[bytes], str]:
    """A real master of ``job`` as its own ServiceAccount; returns the process and its gRPC address."""
    token = cp.kubectl("create", "token", f"{job}-master", "-n", NAMESPACE, "--duration=2h").strip()
    kubeconfig = write_kubeconfig(state / f"{job}.kubeconfig", server=cp.server, ca=cp.ca, token=token)
    (state / "node-token").write_text(NODE_TOKEN)
    env = {
        **os.environ,
        "KUBECONFIG": str(kubeconfig),
        "PYTHONPATH": str(src),
        "PHALANX_LOG_LEVEL": "WARNING",
    }
    env.pop("KUBERNETES_SERVICE_HOST", None)
    cmd = [
        sys.executable, "-m", "phalanx", "master", "--job-id", job, "--nodes", "1:1",
        "--port", "0", "--http-port", "0", "--token-file", str(state / "node-token"),
        "--state", f"k8s://{NAMESPACE}/{job}",
    ]  # fmt: skip
    with (state / f"{job}.log").open("ab") as err:
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=err, env=env, start_new_session=True, cwd=src.parent
        )
    assert proc.stdout is not None
    line = proc.stdout.readline().decode().strip()
    if not line.startswith("PHALANX_MASTER_GRPC="):
        raise RuntimeError(f"master {job} printed {line!r}; see {state}/{job}.log")
    return proc, line.split("=", 1)[1]


async def drive_node(addr: str, job: str, stop: threading.Event) -> int:
    """One node of ``job``: registers, joins the rendezvous, then heartbeats as a training agent does, with
    a step that advances every STEP_S. Returns the heartbeats sent."""
    import grpc

    from phalanx.api.v1 import master_pb2 as pb
    from phalanx.api.v1 import master_pb2_grpc as pb_grpc

    auth = (("authorization", f"Bearer {NODE_TOKEN}"),)
    node, inc = f"{job}-worker-0-0", "inc-0"
    sent = 0
    async with grpc.aio.insecure_channel(addr) as channel:
        stub = pb_grpc.MasterStub(channel)
        reg = pb.RegisterNodeRequest(job_id=job, node_id=node, incarnation=inc, host="h", nproc_per_node=1)
        await stub.RegisterNode(reg, metadata=auth, timeout=30)
        join = pb.JoinRendezvousRequest(
            node_id=node, incarnation=inc, nproc_per_node=1, store_host="h", store_port=20000
        )
        joined = await stub.JoinRendezvous(join, metadata=auth, timeout=60)
        began = time.monotonic()
        while not stop.is_set():
            rank = pb.RankProgress(
                rank=0,
                local_rank=0,
                step=int((time.monotonic() - began) / STEP_S),
                step_unix_ns=time.time_ns(),
            )
            req = pb.HeartbeatRequest(
                node_id=node, incarnation=inc, state=pb.NODE_STATE_RUNNING, round=joined.round, ranks=[rank]
            )
            try:
                await stub.Heartbeat(req, metadata=auth, timeout=10)
                sent += 1
            except grpc.RpcError as exc:
                print(f"{job}: heartbeat failed: {exc.code()}", file=sys.stderr)
            await asyncio.sleep(HEARTBEAT_S)
    return sent


def drive_nodes(addrs: dict[str, str], stop: threading.Event, sent: list[int]) -> None:
    async def run() -> None:
        sent.extend(await asyncio.gather(*(drive_node(a, job, stop) for job, a in addrs.items())))

    asyncio.run(run())


def stop_all(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)


def rates(running: Counter[Any], running_s: float, idle: Counter[Any], idle_s: float) -> dict[str, float]:
    """Requests per minute by verb/resource/subresource: ``running`` minus ``idle`` (each per its window)."""
    out: dict[str, float] = {}
    for key in set(running) | set(idle):
        rate = running[key] / running_s * 60 - idle[key] / idle_s * 60
        if rate > 0.5:
            out["/".join(k for k in key if k)] = round(rate, 1)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def window(cp: ControlPlane, seconds: float) -> tuple[Counter[Any], float]:
    t0, before = time.monotonic(), requests(cp)
    time.sleep(seconds)
    return delta(requests(cp), before), time.monotonic() - t0


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--jobs", type=int, default=50)
    parser.add_argument("--masters", type=int, default=0, help="run the masters of this many of the jobs")
    parser.add_argument(
        "--idle", action="store_true", help="no nodes: the masters wait (no progress, no status changes)"
    )
    parser.add_argument("--window", type=float, default=60.0, help="seconds per measurement window")
    parser.add_argument("--operator-src", type=Path, default=ROOT / "src")
    parser.add_argument("--label", default="this tree")
    parser.add_argument(
        "--compare-src", type=Path, default=None,
        help="also run the operator from this source tree, on the same control plane and jobs, right after "
        "the first one (side by side: one run, one machine state); its figures go under 'compared'",
    )  # fmt: skip
    parser.add_argument("--compare-label", default="compared tree")
    parser.add_argument(
        "--out", type=Path, default=ROOT / "benchmarks" / "results" / "operator_api_load.json"
    )
    args = parser.parse_args()
    if not 0 <= args.masters <= args.jobs:
        parser.error("--masters must be between 0 and --jobs")
    bin_dir = find_binaries()
    if bin_dir is None:
        print("no Kubernetes binaries: run `make go-tools`", file=sys.stderr)
        return 1
    src = args.operator_src.resolve()
    state = Path(tempfile.mkdtemp(prefix="phalanx-apiload-"))
    cp = ControlPlane(bin_dir=bin_dir, state_dir=state)
    operator = None
    masters: list[subprocess.Popen[bytes]] = []
    stop_nodes = threading.Event()
    try:
        cp.start()
        cp.kubectl("apply", "--server-side", "-f", str(ROOT / "crds" / "elasticjobs.phalanx.dev.yaml"))
        cp.wait_established("elasticjobs.phalanx.dev")
        cp.kubectl("create", "namespace", NAMESPACE)
        cp.kubectl("apply", "-f", "-", input_text=job_manifests(args.jobs))
        operator = start_operator(cp, src, state / "operator.log")
        started = time.monotonic()
        wanted = 3 * args.jobs  # a master and two workers each
        while pods_made(cp) < wanted:
            if time.monotonic() - started > 600:
                raise RuntimeError(
                    f"only {pods_made(cp)} of {wanted} Pods after 600 s; see {state}/operator.log"
                )
            if operator.poll() is not None:
                raise RuntimeError(f"the operator exited; see {state}/operator.log")
            time.sleep(2)
        settle = time.monotonic() - started

        heartbeats: list[int] = []
        driver = None
        if args.masters:
            addrs = {}
            for i in range(args.masters):
                job = f"job-{i:03d}"
                proc, addrs[job] = start_master(cp, src, state, job)
                masters.append(proc)
            if not args.idle:
                driver = threading.Thread(
                    target=drive_nodes, args=(addrs, stop_nodes, heartbeats), daemon=True
                )
                driver.start()
        time.sleep(
            20 if args.masters else 10
        )  # rounds form; the status patches and Events of the start settle

        with_masters: Counter[Any] = Counter()
        with_masters_s = 1.0
        if args.masters:
            with_masters, with_masters_s = window(cp, args.window)
            stop_nodes.set()
            if driver is not None:
                driver.join(30)
            stop_all(masters)
            time.sleep(5)
        running, running_s = window(cp, args.window)
        stop_all([operator])  # it hands its Lease over
        compared_run: tuple[Counter[Any], float] | None = None
        if args.compare_src is not None:
            operator = start_operator(cp, args.compare_src.resolve(), state / "operator-compared.log")
            time.sleep(20)  # it takes the Lease, lists everything and passes every job: nothing to create
            compared_run = window(cp, args.window)
            stop_all([operator])
        time.sleep(5)
        idle, idle_s = window(cp, args.window)

        ops = rates(running, running_s, idle, idle_s)
        total = sum(ops.values())
        result: dict[str, Any] = {
            "benchmark": "operator_api_load",
            "operator": args.label,
            "jobs": args.jobs,
            "reconcile_interval_s": 2,
            "window_s": args.window,
            "seconds_to_create_all_pods": round(settle, 1),
            "operator_requests_per_minute": round(total, 1),
            "requests_per_job_per_minute": round(total / args.jobs, 2),
            "by_verb_resource_per_minute": ops,
            "goal_per_job_per_minute": 5,
            "cpu_count": os.cpu_count(),
            "method": "apiserver_request_total over the window with the operator running minus the same "
            "window with it stopped; no kubelet (Pods Pending), so no kubelet requests",
        }
        if compared_run is not None:
            theirs = rates(*compared_run, idle, idle_s)
            their_total = sum(theirs.values())
            result["compared"] = {
                "operator": args.compare_label,
                "operator_requests_per_minute": round(their_total, 1),
                "requests_per_job_per_minute": round(their_total / args.jobs, 2),
                "by_verb_resource_per_minute": theirs,
            }
            result["ratio_to_compared"] = round(total / their_total, 2) if their_total else None
        if args.masters:
            by_masters = rates(with_masters, with_masters_s, running, running_s)
            master_total = sum(by_masters.values())
            result["masters"] = {
                "masters": args.masters,
                "nodes": "none (idle masters)" if args.idle else "one per master, heartbeating",
                "heartbeat_s": HEARTBEAT_S,
                "step_s": STEP_S,
                "heartbeats_sent": sum(heartbeats),
                "masters_requests_per_minute": round(master_total, 1),
                "requests_per_job_per_minute": round(master_total / args.masters, 2),
                "by_verb_resource_per_minute": by_masters,
                "method": "the window with masters, their nodes and the operator running minus the window "
                "with the operator alone; the masters run here as processes with their ServiceAccount's "
                "token",
            }
    finally:
        stop_nodes.set()
        stop_all(masters)
        if operator is not None and operator.poll() is None:
            os.killpg(operator.pid, signal.SIGKILL)
        cp.stop()
        cp.remove()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    previous = json.loads(args.out.read_text()) if args.out.exists() else {}
    runs = {r["operator"]: r for r in previous.get("runs", [])}
    runs[args.label] = result
    args.out.write_text(json.dumps({"runs": list(runs.values())}, indent=2) + "\n")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
