"""The same ElasticJob on real containers and as processes, side by side in one run.

Two clusters on this machine, one after the other, each with the same control plane and the same phalanx:

* ``containers``: two real nodes (kubelet, containerd, runc, CNI, kube-proxy, CoreDNS: the e2e suite's
  cluster, tests/k8s/k8s_harness/nodes.py), the images built here, phalanx installed by its Helm chart;
* ``processes``: the test kubelet of tests/k8s, which runs each Pod as a process of this checkout, and the
  operator as a local process.

Each run applies examples/elasticjob.yaml (2 nodes x 2 processes, 0.2 s steps) and measures, from the
ElasticJob's status (polled every 0.2 s):

* ``start_s``: from creating the ElasticJob to its first reported step (Pods created, scheduled, started,
  ``import torch``, rendezvous, one step);
* ``worker_kill_s``: from a SIGKILL of one training process (inside its container: ``kubectl exec``; as a
  process: ``kill``) to the first step completed after it (rank 0 prints each step with its time), the
  process restarted in place by its agent and the step loaded from the node's memory; ``steps_lost``: the
  steps completed before the kill that were trained again.

Medians over ``--runs`` jobs per cluster, and the ratios containers / processes, as one JSON line.

    .venv/bin/python -m benchmarks.containers --runs 3 --out benchmarks/results/containers.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import yaml
from e2e.faults import KILL_ONE_RANK

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "k8s"))

from k8s_harness import containers as real_nodes  # noqa: E402
from k8s_harness.cluster import Cluster  # noqa: E402
from k8s_harness.controlplane import ControlPlane, find_binaries  # noqa: E402


def _example(*, steps: int) -> str:
    docs = [d for d in yaml.safe_load_all((ROOT / "examples" / "elasticjob.yaml").read_text()) if d]
    job = next(d for d in docs if d["kind"] == "ElasticJob")
    (container,) = job["spec"]["template"]["spec"]["containers"]
    container["env"] = [{"name": "TINY_STEPS", "value": str(steps)}, {"name": "TINY_STEP_S", "value": "0.2"}]
    return yaml.safe_dump_all(docs)


def _status(kubectl: Callable[..., str], ns: str) -> dict[str, Any]:
    out = kubectl("get", "ej", "tiny", "-n", ns, "-o", "json")
    return dict(json.loads(out).get("status", {}))


def _wait(what: str, probe: Callable[[], bool], *, timeout: float) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if probe():
            return time.monotonic()
        time.sleep(0.2)
    raise RuntimeError(f"timed out waiting for {what}")


STEP_LINE = re.compile(r"step (\d+) loss \S+ world \d+ at (\d+\.\d+)")


def _steps(logs: str) -> list[tuple[int, float]]:
    return [(int(n), float(t)) for n, t in STEP_LINE.findall(logs)]


def one_job(
    kubectl: Callable[..., str], kill: Callable[[str], float], logs: Callable[[str], str], ns: str
) -> dict[str, float]:
    kubectl("create", "namespace", ns)
    created = time.monotonic()
    kubectl("apply", "-n", ns, "-f", "-", input_text=_example(steps=60))
    first = _wait("the first step", lambda: _status(kubectl, ns).get("step", -1) >= 0, timeout=300)
    _wait("step 10", lambda: _status(kubectl, ns).get("step", -1) >= 10, timeout=300)
    killed = kill(ns)

    def after() -> list[tuple[int, float]]:
        return [(n, t) for n, t in _steps(logs(ns)) if t > killed]

    _wait("a step after the kill", lambda: bool(after()), timeout=300)
    before = max(n for n, t in _steps(logs(ns)) if t <= killed)
    resumed_step, resumed_at = min(after(), key=lambda s: s[1])
    # Gone before the next job starts: as processes, two jobs of one name on one machine share /tmp.
    kubectl("delete", "namespace", ns, "--wait=false")
    _wait(f"namespace {ns} gone", lambda: ns not in kubectl("get", "namespaces", "-o", "name"), timeout=300)
    return {
        "start_s": round(first - created, 2),
        "worker_kill_s": round(resumed_at - killed, 2),
        "steps_lost": max(0, before - resumed_step + 1),
    }


@contextlib.contextmanager
def containers(
    state: Path,
) -> Iterator[tuple[Callable[..., str], Callable[[str], float], Callable[[str], str]]]:
    with real_nodes.running(state) as started:
        real_nodes.helm_install(
            started, namespace="phalanx-system", values=("operator.reconcileIntervalSeconds=1",)
        )
        cp = started[0]

        def kill(ns: str) -> float:  # the time of the kill itself: `kubectl exec` takes a while to get there
            pods = json.loads(
                cp.kubectl("get", "pods", "-n", ns, "-l", "phalanx.dev/role=worker", "-o", "json")
            )
            name = sorted(p["metadata"]["name"] for p in pods["items"])[0]
            return float(cp.kubectl("exec", "-n", ns, name, "--", "python", "-c", KILL_ONE_RANK).split()[1])

        def logs(ns: str) -> str:
            pods = json.loads(
                cp.kubectl("get", "pods", "-n", ns, "-l", "phalanx.dev/role=worker", "-o", "json")
            )
            return "".join(
                cp.kubectl("logs", "-n", ns, p["metadata"]["name"], check=False) for p in pods["items"]
            )

        yield cp.kubectl, kill, logs


@contextlib.contextmanager
def processes(
    state: Path,
) -> Iterator[tuple[Callable[..., str], Callable[[str], float], Callable[[str], str]]]:
    bin_dir = find_binaries()
    assert bin_dir is not None
    cp = ControlPlane(bin_dir=bin_dir, state_dir=state)
    cluster = Cluster(cp=cp)
    try:
        cp.start()
        cp.kubectl("apply", "--server-side", "-f", str(ROOT / "crds" / "elasticjobs.phalanx.dev.yaml"))
        cp.kubectl("wait", "--for=condition=Established", "crd/elasticjobs.phalanx.dev", "--timeout=30s")
        cluster.start_kubelet()
        cluster.install_operator_rbac()
        cluster.start_operator()

        def kill(ns: str) -> float:  # one job runs at a time: any of its ranks, found as in a container
            out = subprocess.run(
                [sys.executable, "-c", KILL_ONE_RANK], check=True, capture_output=True, text=True
            )
            return float(out.stdout.split()[1])

        def logs(ns: str) -> str:  # the test kubelet keeps each Pod's output in its sandbox
            return "".join(
                p.read_text(errors="replace") for p in cluster.kubelet_dir.glob(f"pods/{ns}_*/container.log")
            )

        yield cp.kubectl, kill, logs
    finally:
        cluster.stop()
        cp.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    results: dict[str, list[dict[str, float]]] = {}
    for mode, cluster in (("containers", containers), ("processes", processes)):
        with (
            tempfile.TemporaryDirectory(prefix=f"phalanx-bench-{mode}-") as d,
            cluster(Path(d)) as (kubectl, kill, logs),
        ):
            results[mode] = [one_job(kubectl, kill, logs, f"bench-{i}") for i in range(args.runs)]
            print(mode, results[mode], file=sys.stderr, flush=True)
    medians = {
        mode: {k: statistics.median(r[k] for r in runs) for k in ("start_s", "worker_kill_s", "steps_lost")}
        for mode, runs in results.items()
    }
    report = {
        "benchmark": "containers",
        "machine": f"{platform.node()} ({os.cpu_count()} cores)",
        "date": time.strftime("%Y-%m-%d"),
        "runs": results,
        "median": medians,
        "ratio_containers_to_processes": {
            k: round(medians["containers"][k] / medians["processes"][k], 2)
            for k in ("start_s", "worker_kill_s")
        },
    }
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report))  # one line: benchmarks/run_all.py reads the last JSON line
    return 0


if __name__ == "__main__":
    sys.exit(main())
