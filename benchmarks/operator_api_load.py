"""The operator's load on the Kubernetes API server: requests per job per minute at steady state.

Starts a real control plane (tests/k8s/k8s_harness: etcd, kube-apiserver, kube-controller-manager,
kube-scheduler), creates ``--jobs`` ElasticJobs and runs ``phalanx operator`` (the chart's default
reconcile interval, 2 s). No kubelet: the Pods stay Pending, so the operator's requests are the only ones
that depend on the jobs (no master patches status, no kubelet reports Pods). Once every job has its master
and worker Pods, the API server's own counter ``apiserver_request_total`` (by verb, resource, subresource)
is read before and after a ``--window`` of seconds with the operator running, then over the same window with
the operator stopped (the controllers' and scheduler's requests); the difference is the operator's.
A WATCH counts when it ends (the operator's reconnects).

``--operator-src DIR`` runs the operator from another source tree (e.g. ``git archive HEAD`` unpacked) to
measure a version before a change on the same machine. Writes one JSON object to ``--out``
(default benchmarks/results/operator_api_load.json) and prints it.

    .venv/bin/python -m benchmarks.operator_api_load --jobs 50 --window 60
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "k8s"))

from k8s_harness.controlplane import ControlPlane, find_binaries  # noqa: E402

NAMESPACE = "load"
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


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--jobs", type=int, default=50)
    parser.add_argument("--window", type=float, default=60.0, help="seconds per measurement window")
    parser.add_argument("--operator-src", type=Path, default=ROOT / "src")
    parser.add_argument("--label", default="this tree")
    parser.add_argument(
        "--out", type=Path, default=ROOT / "benchmarks" / "results" / "operator_api_load.json"
    )
    args = parser.parse_args()
    bin_dir = find_binaries()
    if bin_dir is None:
        print("no Kubernetes binaries: run `make k8s-binaries`", file=sys.stderr)
        return 1
    state = Path(tempfile.mkdtemp(prefix="phalanx-apiload-"))
    cp = ControlPlane(bin_dir=bin_dir, state_dir=state)
    operator = None
    try:
        cp.start()
        cp.kubectl("apply", "--server-side", "-f", str(ROOT / "crds" / "elasticjobs.phalanx.dev.yaml"))
        cp.kubectl("wait", "--for=condition=Established", "crd/elasticjobs.phalanx.dev", "--timeout=30s")
        cp.kubectl("create", "namespace", NAMESPACE)
        cp.kubectl("apply", "-f", "-", input_text=job_manifests(args.jobs))
        operator = start_operator(cp, args.operator_src.resolve(), state / "operator.log")
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
        time.sleep(10)  # the status patches and Events of the start settle

        t0, before = time.monotonic(), requests(cp)
        time.sleep(args.window)
        running = delta(requests(cp), before)
        running_s = time.monotonic() - t0
        os.killpg(operator.pid, signal.SIGTERM)
        operator.wait(30)
        time.sleep(5)
        t0, before = time.monotonic(), requests(cp)
        time.sleep(args.window)
        idle = delta(requests(cp), before)
        idle_s = time.monotonic() - t0

        ops: dict[str, float] = {}
        for key in set(running) | set(idle):
            rate = running[key] / running_s * 60 - idle[key] / idle_s * 60
            if rate > 0.5:
                ops["/".join(k for k in key if k)] = round(rate, 1)
        total = sum(ops.values())
        result = {
            "benchmark": "operator_api_load",
            "operator": args.label,
            "jobs": args.jobs,
            "reconcile_interval_s": 2,
            "window_s": args.window,
            "seconds_to_create_all_pods": round(settle, 1),
            "operator_requests_per_minute": round(total, 1),
            "requests_per_job_per_minute": round(total / args.jobs, 2),
            "by_verb_resource_per_minute": dict(sorted(ops.items(), key=lambda kv: -kv[1])),
            "goal_per_job_per_minute": 5,
            "cpu_count": os.cpu_count(),
            "method": "apiserver_request_total over the window with the operator running minus the same "
            "window with it stopped; no kubelet (Pods Pending), so no master or kubelet requests",
        }
    finally:
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
