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
  steps completed before the kill that were trained again;
* ``node_loss_s``: from the death of the node that runs one worker (containers: its kubelet, containerd and
  every container SIGKILLed at once, ``ContainerNodes.power_off``; processes: the test kubelet kills that
  node's Pods and stops renewing its Lease) to the first step completed after it, the replacement Pod
  started on the node still there and the step loaded from the survivor's memory; ``node_loss_steps_lost``
  as above. The master is placed on the node that stays (as the e2e scenario does), the workers one per
  node.

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
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from e2e.faults import KILL_ONE_RANK

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "k8s"))

from k8s_harness import containers as real_nodes  # noqa: E402
from k8s_harness.cluster import PROCESS_NODES, Cluster  # noqa: E402
from k8s_harness.controlplane import ControlPlane, find_binaries  # noqa: E402


@dataclass
class Target:
    """One cluster as the benchmark drives it."""

    kubectl: Callable[..., str]
    kill: Callable[[str], float]
    """SIGKILLs one training process of the job in that namespace; returns the kill's time (time.time())."""
    logs: Callable[[str], str]
    """The output of the namespace's workers that can still be read."""
    power_off: Callable[[str], None]
    power_on: Callable[[str], None]
    nodes: tuple[str, str]
    """(the node that keeps the master, the node that is lost)."""


def _example(*, steps: int, master_on: str) -> str:
    docs = [d for d in yaml.safe_load_all((ROOT / "examples" / "elasticjob.yaml").read_text()) if d]
    job = next(d for d in docs if d["kind"] == "ElasticJob")
    pod_spec = job["spec"]["template"]["spec"]
    (container,) = pod_spec["containers"]
    container["env"] = [{"name": "TINY_STEPS", "value": str(steps)}, {"name": "TINY_STEP_S", "value": "0.2"}]
    job["spec"]["master"] = {"template": {"spec": {"nodeSelector": {"kubernetes.io/hostname": master_on}}}}
    pod_spec["topologySpreadConstraints"] = [
        {
            "maxSkew": 1,
            "topologyKey": "kubernetes.io/hostname",
            "whenUnsatisfiable": "DoNotSchedule",
            "labelSelector": {"matchLabels": {"phalanx.dev/role": "worker"}},
            "nodeTaintsPolicy": "Honor",
        }
    ]
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
LOADED_LINE = re.compile(r"flash: loaded step \d+ from \w+ at (\d+\.\d+)")


def _steps(logs: str) -> list[tuple[int, float]]:
    return [(int(n), float(t)) for n, t in STEP_LINE.findall(logs)]


def _resumed(t: Target, ns: str, since: float) -> tuple[int, float]:
    """The first step the job completed after it recovered from a fault at ``since``: (its number, its time).
    A step a survivor completes before it notices the fault does not count: the first step after a restarted
    process loaded its state does."""

    def after() -> list[tuple[int, float]]:
        logs = t.logs(ns)
        loaded = [float(at) for at in LOADED_LINE.findall(logs) if float(at) > since]
        return [(n, at) for n, at in _steps(logs) if loaded and at > min(loaded)]

    _wait("a step after the fault", lambda: bool(after()), timeout=300)
    return min(after(), key=lambda s: s[1])


def one_job(t: Target, ns: str) -> dict[str, float]:
    kept, lost = t.nodes
    t.kubectl("create", "namespace", ns)
    created = time.monotonic()
    t.kubectl("apply", "-n", ns, "-f", "-", input_text=_example(steps=150, master_on=kept))
    first = _wait("the first step", lambda: _status(t.kubectl, ns).get("step", -1) >= 0, timeout=300)
    _wait("step 10", lambda: _status(t.kubectl, ns).get("step", -1) >= 10, timeout=300)

    killed = t.kill(ns)
    resumed_step, resumed_at = _resumed(t, ns, killed)
    before = max(n for n, at in _steps(t.logs(ns)) if at <= killed)
    result = {
        "start_s": round(first - created, 2),
        "worker_kill_s": round(resumed_at - killed, 2),
        "steps_lost": max(0, before - resumed_step + 1),
    }

    _wait("5 more steps", lambda: _status(t.kubectl, ns).get("step", -1) >= resumed_step + 5, timeout=300)
    workers = json.loads(t.kubectl("get", "pods", "-n", ns, "-l", "phalanx.dev/role=worker", "-o", "json"))
    on = sorted(p["spec"].get("nodeName", "") for p in workers["items"])
    if on != sorted(t.nodes):
        raise RuntimeError(f"the workers should run one per node {t.nodes}, not on {on}")
    before = max(n for n, _ in _steps(t.logs(ns)))  # the lost node's output is gone with it
    died = time.time()
    t.power_off(lost)
    try:
        resumed_step, resumed_at = _resumed(t, ns, died)
    finally:
        t.power_on(lost)
    result["node_loss_s"] = round(resumed_at - died, 2)
    result["node_loss_steps_lost"] = max(0, before - resumed_step + 1)

    # Gone before the next job starts: as processes, two jobs of one name on one machine share /tmp.
    t.kubectl("delete", "namespace", ns, "--wait=false")
    _wait(f"namespace {ns} gone", lambda: ns not in t.kubectl("get", "namespaces", "-o", "name"), timeout=300)
    return result


@contextlib.contextmanager
def containers(state: Path) -> Iterator[Target]:
    with real_nodes.running(state) as started:
        cp, nodes, _ = started
        kept, lost = nodes.names
        real_nodes.helm_install(
            started,
            namespace="phalanx-system",
            values=(
                "operator.reconcileIntervalSeconds=1",
                f"operator.nodeSelector.kubernetes\\.io/hostname={kept}",
            ),
        )

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

        yield Target(cp.kubectl, kill, logs, nodes.power_off, nodes.power_on, (kept, lost))


@contextlib.contextmanager
def processes(state: Path) -> Iterator[Target]:
    bin_dir = find_binaries()
    assert bin_dir is not None
    cp = ControlPlane(bin_dir=bin_dir, state_dir=state)
    cluster = Cluster(cp=cp)
    try:
        cp.start()
        cp.kubectl("apply", "--server-side", "-f", str(ROOT / "crds" / "elasticjobs.phalanx.dev.yaml"))
        cp.wait_established("elasticjobs.phalanx.dev")
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

        yield Target(cp.kubectl, kill, logs, cluster.power_off, cluster.power_on, PROCESS_NODES)
    finally:
        cluster.stop()
        cp.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--out", type=Path)
    p.add_argument(
        "--only", choices=("containers", "processes"), help="one side alone (no ratio): a quick check"
    )
    args = p.parse_args()
    results: dict[str, list[dict[str, float]]] = {}
    for mode, cluster in (("containers", containers), ("processes", processes)):
        if args.only not in (None, mode):
            continue
        state = Path(tempfile.mkdtemp(prefix=f"phalanx-bench-{mode}-"))
        with cluster(state) as target:
            results[mode] = [one_job(target, f"bench-{i}") for i in range(args.runs)]
            print(mode, results[mode], file=sys.stderr, flush=True)
        if os.environ.get("PHALANX_K8S_KEEP") != "1":  # else kept for a look at the logs
            shutil.rmtree(state, ignore_errors=True)
    measures = ("start_s", "worker_kill_s", "steps_lost", "node_loss_s", "node_loss_steps_lost")
    medians = {
        mode: {k: statistics.median(r[k] for r in runs) for k in measures} for mode, runs in results.items()
    }
    report = {
        "benchmark": "containers",
        "machine": f"{platform.node()} ({os.cpu_count()} cores)",
        "date": time.strftime("%Y-%m-%d"),
        "runs": results,
        "median": medians,
        "ratio_containers_to_processes": {
            k: round(medians["containers"][k] / medians["processes"][k], 2)
            for k in ("start_s", "worker_kill_s", "node_loss_s")
        }
        if len(medians) == 2
        else None,
    }
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report))  # one line: benchmarks/run_all.py reads the last JSON line
    return 0


if __name__ == "__main__":
    sys.exit(main())
